"""The prefill/decode data path as a trust boundary (issue 24), on real servers.

A real prefill + decode pair behind ``kvflow router``, all with the deployment's internal
key, and a lying bootstrap endpoint (``tests/disagg/fake_bootstrap.py``, a test double)
that the decode also trusts. Each attack must end safely: the decode never decodes KV it
did not receive (its slots are zeroed), never decodes another prompt's KV (claims carry
the prompt's hash), is not stalled by one silent peer, and survives whatever a peer
answers. After each attack both servers are healthy and idle, with no KV held.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from pd_flags import COMMON, PD_INTERNAL_KEY
from router_process import RouterProcess
from server_process import ServerProcess, free_port

from kvflow import contract

sys.path.insert(0, str(Path(__file__).parents[1] / "disagg"))

from fake_bootstrap import FakeBootstrap, done_with, reports, stall, states

pytestmark = pytest.mark.slow

KEY = PD_INTERNAL_KEY  # in every server's and router's environment (conftest.py)
SECRETS = (
    "The password of the vault is PINEAPPLE-7731. Never tell anyone the password.",
    "My neighbour Gertrude keeps eleven green parrots called Bob in her small garden.",
)


class Stack:
    def __init__(self, logs: Path) -> None:
        self.fake = FakeBootstrap(stall)
        self.bootstrap_port = free_port()
        trusted = [f"127.0.0.1:{self.bootstrap_port}", self.fake.address]
        assert os.environ[contract.INTERNAL_KEY_ENV] == KEY
        prefill = ("--role", "prefill", "--bootstrap-port", str(self.bootstrap_port))
        decode = ("--role", "decode", "--disaggregation-trusted-prefills", *trusted)
        with ThreadPoolExecutor(2) as pool:  # each load takes tens of seconds
            starts = [
                pool.submit(ServerProcess, *prefill, *COMMON, log=logs / "prefill.log"),
                pool.submit(ServerProcess, *decode, *COMMON, log=logs / "decode.log"),
            ]
        failed = [f.exception() for f in starts if f.exception() is not None]
        if failed:
            for start in starts:
                if start.exception() is None:
                    start.result().stop()
            self.fake.stop()
            raise failed[0]  # type: ignore[misc]
        self.prefill, self.decode = (f.result() for f in starts)
        try:
            self.router = RouterProcess(
                "--prefill-urls",
                f"{self.prefill.url}#{self.bootstrap_port}",
                "--decode-urls",
                self.decode.url,
                log=logs / "router.log",
            )
        except BaseException:
            for proc in (self.prefill, self.decode):
                proc.stop()
            self.fake.stop()
            raise

    def stop(self) -> None:
        for proc in (self.router, self.prefill, self.decode):
            proc.stop()
        self.fake.stop()

    def healthy_and_idle(self) -> None:
        for server in (self.prefill, self.decode):
            assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
            server.wait_idle_and_free(timeout=30)


@pytest.fixture(scope="module")
def stack(model_path, tmp_path_factory) -> Iterator[Stack]:
    stack = Stack(tmp_path_factory.mktemp("pd-trust"))
    yield stack
    stack.stop()


def _generate(url: str, ids: list[int], timeout: float = 60, **extra: Any) -> httpx.Response:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
        **extra,
    }
    return httpx.post(f"{url}/generate", json=body, timeout=timeout)


def _at(port: int, room: int | None = None) -> dict[str, Any]:
    room = random.getrandbits(63) if room is None else room
    return {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": room}


def test_the_bootstrap_routes_need_the_key(stack) -> None:
    for path in ("/register", "/rooms", "/rooms/status"):
        url = f"http://127.0.0.1:{stack.bootstrap_port}{path}"
        for headers in ({}, {"Authorization": "Bearer not-the-key"}):
            response = httpx.post(url, json={"rooms": [], "cancel": [1]}, headers=headers)
            assert response.status_code == 401, response.text
            assert "internal key" in response.json()["error"]
    ids = list(range(2000, 2020))
    assert _generate(stack.router.url, ids).status_code == 200  # the decode sends the key
    stack.healthy_and_idle()


def test_a_room_done_without_kv_never_decodes_what_the_slots_held(stack, tokenizer) -> None:
    """The fake says ``done`` with a valid first token and writes nothing. Before, the
    decode generated from its slots' last contents (another user's prompt). Now they are
    zeros: the answer is the same whatever the slots held before."""
    stack.fake.script = done_with({"first_token": 578})
    prompts = [tokenizer.encode(secret) for secret in SECRETS]
    length = min(len(ids) for ids in prompts)  # one length: the same positions each time
    answers = []
    for ids in (ids[:length] for ids in prompts):
        assert _generate(stack.router.url, ids).status_code == 200  # its KV in the slots
        attack = _generate(stack.decode.url, [13] * len(ids), **_at(stack.fake.port))
        assert attack.status_code == 200, attack.text  # the decode cannot tell a lie here
        answers.append(attack.json()["output_ids"])
        stack.healthy_and_idle()
    assert answers[0] == answers[1]
    text = tokenizer.decode(answers[0])
    assert "PINEAPPLE" not in text and "parrot" not in text
    assert ("/register", f"Bearer {KEY}") in [(p, auth) for p, _, auth in stack.fake.calls]


@pytest.mark.parametrize(
    ("script", "why"),
    [
        (done_with({"first_token": -1}), "outside the vocabulary"),
        (done_with({"first_token": 49152}), "outside the vocabulary"),
        (done_with({"first_token": None}), "no first_token"),
        (done_with({}), "no first_token"),
        (done_with({"first_token": "5"}), "outside the vocabulary"),
        (done_with({"first_token": 5, "top_logprobs": [[-1, -0.1]]}), "outside the vocab"),
        (done_with({"first_token": 5, "input_logprobs": "x"}), "input_logprobs"),
        (done_with([5]), "malformed"),
        (reports(["done"]), "malformed"),
        (reports({"state": "done!"}), "malformed"),
        (reports({"state": "failed", "message": {"x": 1}}), "malformed"),
        (states([1, 2]), "not an object"),  # no valid answer: fails after the timeout
        (states({"room": {"state": "done"}}), "not a number"),
    ],
)
def test_whatever_a_prefill_reports_the_decode_survives(stack, script, why) -> None:
    stack.fake.script = script
    start = time.monotonic()
    response = _generate(stack.decode.url, list(range(2000, 2012)), **_at(stack.fake.port))
    assert response.status_code == 503, response.text
    assert why in response.text
    assert time.monotonic() - start < 15
    assert _generate(stack.router.url, list(range(2000, 2012))).status_code == 200
    stack.healthy_and_idle()


def test_rooms_a_prefill_was_not_asked_about_are_ignored(stack) -> None:
    extra = {str(-1): {"state": "done"}, str(1 << 80): [], "7": {"state": "failed"}}
    stack.fake.script = reports({"state": "done", "result": {"first_token": 578}}, extra)
    response = _generate(stack.decode.url, list(range(2000, 2012)), **_at(stack.fake.port))
    assert response.status_code == 200, response.text
    stack.fake.script = done_with({"first_token": None})  # no token: only for max_new_tokens 0
    zero = {"sampling_params": {"max_new_tokens": 0}, **_at(stack.fake.port)}
    response = httpx.post(
        f"{stack.decode.url}/generate", json={"input_ids": [2000, 2001], **zero}, timeout=60
    )
    assert response.status_code == 200 and response.json()["output_ids"] == []
    stack.healthy_and_idle()


def test_a_decode_never_gets_the_kv_of_another_prompt(stack, tokenizer) -> None:
    """The prefill runs one prompt and the decode another with the same room and length:
    the claim's prompt hash differs, the room fails on both sides, the decode answers an
    error (before: it decoded " Paris." for Spain)."""
    france = tokenizer.encode("The capital of France is")
    spain = tokenizer.encode("The capital of Spain is")
    assert len(france) == len(spain) and france != spain

    def pair(prefill_ids: list[int], decode_ids: list[int]) -> tuple[httpx.Response, ...]:
        room = _at(stack.bootstrap_port)
        answers: dict[str, httpx.Response] = {}

        def send(name: str, url: str, ids: list[int]) -> None:
            answers[name] = _generate(url, ids, **room)

        threads = [
            threading.Thread(target=send, args=("prefill", stack.prefill.url, prefill_ids)),
            threading.Thread(target=send, args=("decode", stack.decode.url, decode_ids)),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(90)
        return answers["prefill"], answers["decode"]

    _, same = pair(france, france)
    assert same.status_code == 200, same.text
    paris = same.json()["output_ids"]
    _, other = pair(france, spain)
    assert other.status_code == 503, other.text
    assert "not this room's prompt" in other.text
    assert "output_ids" not in other.json() or not set(paris) & set(other.json()["output_ids"])
    assert "not this room's prompt" in stack.prefill.log.read_text()
    stack.healthy_and_idle()


def test_a_silent_prefill_does_not_stall_other_requests(stack) -> None:
    """Five requests name a bootstrap that accepts and never answers; a request through the
    router meanwhile takes its usual time (before: 3.6 s instead of 0.2 s: one watcher
    thread served every prefill and waited 2 s per call)."""
    ids = list(range(3000, 3016))

    def timed() -> float:
        start = time.monotonic()
        assert _generate(stack.router.url, ids).status_code == 200
        return time.monotonic() - start

    def during_a_stall() -> float:
        """One normal request's time, sent as the fake starts holding the decode's call."""
        stalled: list[int] = []

        def victim() -> None:
            response = _generate(stack.decode.url, ids, **_at(stack.fake.port))
            stalled.append(response.status_code)

        calls = len(stack.fake.calls)
        victims = [threading.Thread(target=victim) for _ in range(5)]
        for thread in victims:
            thread.start()
        deadline = time.monotonic() + 30
        while len(stack.fake.calls) == calls:  # until the decode waits on the fake
            assert time.monotonic() < deadline, "the decode never called the fake"
            time.sleep(0.01)
        took = timed()  # the fake holds the call for 2 s from now, or longer
        for thread in victims:
            thread.join(60)
        assert stalled == [503] * 5
        return took

    before = sorted(timed() for _ in range(3))
    # a loaded machine slows every request: the bound follows the request's own time, and
    # one retry absorbs a scheduling hiccup (a serialised watcher adds >= 1.5 s each time)
    limit = max(1.0, before[1] + 0.5)
    stack.fake.script = stall
    during = [during_a_stall()]
    if during[0] >= limit:
        during.append(during_a_stall())
    print(f"normal request latency (s): before {before}, during the stall {during}")
    assert min(during) < limit, f"stalled by another prefill: {during} (before: {before})"
    stack.healthy_and_idle()
