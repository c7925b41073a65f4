"""The decode's room watcher against lying prefills (``fake_bootstrap``): one link per
prefill, so a silent one delays only its own rooms; a bounded number of links; whatever a
peer answers ends as an outcome, never as a dead thread."""

from __future__ import annotations

import threading
import time

import pytest
from fake_bootstrap import STALL, FakeBootstrap, done_with, stall, states
from kv_helpers import kv_pool, model_config

from kvflow.runtime.disagg import layout_of, watcher
from kvflow.runtime.disagg.bootstrap_client import RoomReport
from kvflow.runtime.disagg.watcher import RoomWatcher
from kvflow.runtime.wire import Bootstrap

HASH = "cd" * 16


@pytest.fixture(scope="module")
def layout():
    config = model_config()
    return layout_of(kv_pool(config, num_slots=8), config, page_size=1)


def _wait(room_watcher: RoomWatcher, count: int, limit_s: float) -> dict[str, RoomReport]:
    outcomes: dict[str, RoomReport] = {}
    deadline = time.monotonic() + limit_s
    while len(outcomes) < count and time.monotonic() < deadline:
        outcomes.update(room_watcher.done())
        time.sleep(0.01)
    return outcomes


def _at(fake: FakeBootstrap, room: int) -> Bootstrap:
    return Bootstrap("127.0.0.1", fake.port, room)


def test_a_silent_prefill_does_not_delay_another(layout) -> None:
    room_watcher = RoomWatcher("127.0.0.1:1", layout, timeout_s=1.0)
    with FakeBootstrap(stall) as silent, FakeBootstrap(done_with({"first_token": 5})) as good:
        for room in range(5):
            room_watcher.claim(f"stalled-{room}", _at(silent, room), [room], HASH)
        time.sleep(0.2)  # the silent prefill's link is inside its call now
        start = time.monotonic()
        room_watcher.claim("normal", _at(good, 9), [0, 1], HASH)
        normal = _wait(room_watcher, 1, limit_s=5)
        took = time.monotonic() - start
        assert normal == {"normal": RoomReport("done", {"first_token": 5}, "")}
        assert took < 0.5, f"the normal room took {took:.2f} s"
        stalled = _wait(room_watcher, 5, limit_s=5)  # each call ends within the timeout
        assert set(stalled) == {f"stalled-{room}" for room in range(5)}
        assert all(o.state == "failed" and "unreachable" in o.message for o in stalled.values())
        assert good.calls[0][0] == "/register" and good.calls[1][1]["claims"][0] == {
            "room": 9,
            "slots": [0, 1],
            "prompt_hash": HASH,
        }


def test_peers_past_the_cap_fail_at_once_and_idle_links_end(
    layout, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(watcher, "_IDLE_S", 0.3)
    room_watcher = RoomWatcher("127.0.0.1:1", layout, timeout_s=2.0, max_peers=1)
    with FakeBootstrap(stall) as silent, FakeBootstrap(done_with({"first_token": 5})) as good:
        room_watcher.claim("a", _at(silent, 1), [0], HASH)
        room_watcher.claim("b", _at(good, 2), [0], HASH)
        outcome = _wait(room_watcher, 1, limit_s=1)["b"]
        assert outcome.state == "failed" and "watches 1 prefills already" in outcome.message
        assert room_watcher.peers() == 1
        assert _wait(room_watcher, 1, limit_s=5)["a"].state == "failed"
        deadline = time.monotonic() + 5
        while room_watcher.peers() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert room_watcher.peers() == 0  # the idle link ended: the next prefill may come
        room_watcher.claim("c", _at(good, 3), [0], HASH)
        assert _wait(room_watcher, 1, limit_s=2)["c"].state == "done"


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        ({"1": {"state": "done", "result": "x"}}, "malformed"),
        ({"1": {"state": "weird"}}, "malformed"),
        ({"1": ["done"]}, "malformed"),
        ({"1": {"state": "unknown"}}, "lost the room"),
        ({"1": {"state": "failed", "message": 42}}, "malformed"),
        ([1], "not an object"),  # the call itself fails: the room ends after the timeout
        ({"x": {}}, "not a number"),
    ],
)
def test_whatever_a_prefill_reports_ends_as_an_outcome(layout, raw, why) -> None:
    room_watcher = RoomWatcher("127.0.0.1:1", layout, timeout_s=0.5)
    with FakeBootstrap(states(raw)) as fake:
        room_watcher.claim("k", _at(fake, 1), [0], HASH)
        outcome = _wait(room_watcher, 1, limit_s=5)["k"]
    assert outcome.state == "failed" and why in outcome.message


def test_rooms_not_final_keep_being_polled_and_others_are_ignored(layout) -> None:
    room_watcher = RoomWatcher("127.0.0.1:1", layout, timeout_s=0.5)
    raw = {"1": {"state": "transferring"}, "2": {"state": "done"}, "-5": {"state": "done"}}
    with FakeBootstrap(states(raw)) as fake:
        room_watcher.claim("k", _at(fake, 1), [0], HASH)
        assert _wait(room_watcher, 1, limit_s=0.8) == {}
        assert fake.paths().count("/rooms/status") > 3


def test_the_key_goes_with_every_call_and_a_room_is_claimed_once(layout) -> None:
    room_watcher = RoomWatcher("127.0.0.1:1", layout, timeout_s=1.0, key="k3y")
    with FakeBootstrap(states({"4": {"state": "transferring"}})) as fake:
        room_watcher.claim("first", _at(fake, 4), [0], HASH)
        room_watcher.claim("second", _at(fake, 4), [1], HASH)
        outcome = _wait(room_watcher, 1, limit_s=2)["second"]
        assert outcome.state == "failed" and "in use" in outcome.message
        assert {auth for _, _, auth in fake.calls} == {"Bearer k3y"}


def test_a_claim_without_an_answer_is_withdrawn_before_its_slots_are_reused(layout) -> None:
    """The claim call timed out: the prefill may hold the claim and write later. The room
    ends only once the prefill confirms the cancel, as failed with the claim's error."""

    def claim_lost(path: str, body: dict):
        if path == "/rooms":
            return STALL
        if path == "/rooms/status":
            report = {"state": "cancelled", "result": {}, "message": "cancelled by the decode"}
            return 200, {"states": {str(room): report for room in body["rooms"]}}
        return 200, {"layout": body["layout"]}

    room_watcher = RoomWatcher("127.0.0.1:1", layout, timeout_s=0.5)
    with FakeBootstrap(claim_lost) as fake:
        room_watcher.claim("k", _at(fake, 6), [0], HASH)
        outcome = _wait(room_watcher, 1, limit_s=5)["k"]
        status = [body for path, body, _ in fake.calls if path == "/rooms/status"]
    assert outcome.state == "failed" and "unreachable" in outcome.message
    # the poll carries the cancel, and waits at the prefill (a timeout of 0.5 s: 100 ms)
    assert status and status[0] == {"rooms": [6], "cancel": [6], "wait_ms": 100}


def test_an_outcome_wakes_the_decode_loop_and_polls_ask_the_prefill_to_wait(layout) -> None:
    """The decode's scheduler loop hears of a room's end when the watcher does
    (``on_outcome``), not at its next look; the watcher's polls let the prefill answer
    when a room ends (``wait_ms``) instead of asking every few milliseconds."""
    woken = threading.Event()
    room_watcher = RoomWatcher("127.0.0.1:1", layout, timeout_s=1.0, on_outcome=woken.set)
    with FakeBootstrap(done_with({"first_token": 5})) as fake:
        room_watcher.claim("k", _at(fake, 3), [0], HASH)
        assert woken.wait(timeout=30)
        assert room_watcher.done() == [("k", RoomReport("done", {"first_token": 5}, ""))]
        polls = [body for path, body, _ in fake.calls if path == "/rooms/status"]
    assert polls == [{"rooms": [3], "cancel": [], "wait_ms": 100}]
