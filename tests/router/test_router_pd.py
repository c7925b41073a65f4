"""PD pairing against a recording fake prefill/decode pair (see ``fake_worker.py`` for why)."""

from __future__ import annotations

import json

import httpx
import pytest
from fake_worker import FakeWorker
from router_process import RouterProcess

pytestmark = pytest.mark.timeout(120)

BOOTSTRAP_PORT = 9911


@pytest.fixture
def pd(tmp_path):
    prefill, decode = FakeWorker("prefill"), FakeWorker("decode")
    router = RouterProcess(
        "--prefill-urls",
        f"{prefill.url}#{BOOTSTRAP_PORT}",
        "--decode-urls",
        decode.url,
        "--policy",
        "cache_aware",
        log=tmp_path / "router.log",
    )
    yield router, prefill, decode
    router.stop()
    prefill.stop()
    decode.stop()


def test_both_workers_get_the_request_with_one_bootstrap_room(pd):
    router, prefill, decode = pd
    chat = {"messages": [{"role": "user", "content": "Hi"}], "stream": True}
    with httpx.stream(
        "POST", f"{router.url}/v1/chat/completions", json=chat, timeout=30
    ) as response:
        assert response.status_code == 200
        text = "".join(
            json.loads(line[6:])["text"]
            for line in response.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        )
    assert text == "from decode", "the client gets the decode worker's stream"
    sent_prefill, sent_decode = prefill.bodies[-1], decode.bodies[-1]
    assert sent_prefill == sent_decode
    assert sent_decode["bootstrap_host"] == "127.0.0.1"
    assert sent_decode["bootstrap_port"] == BOOTSTRAP_PORT
    assert 0 <= sent_decode["bootstrap_room"] < 2**63
    assert sent_decode["messages"] == chat["messages"]

    reply = httpx.post(f"{router.url}/generate", json={"text": ["a", "b"]}, timeout=30)
    assert reply.json()["worker"] == "decode"
    batch = decode.bodies[-1]
    assert batch == prefill.bodies[-1] and len(set(batch["bootstrap_room"])) == 2
    assert batch["bootstrap_port"] == [BOOTSTRAP_PORT] * 2

    other = httpx.post(f"{router.url}/generate", json={"text": "c"}, timeout=30)
    assert other.status_code == 200
    assert decode.bodies[-1]["bootstrap_room"] != sent_decode["bootstrap_room"]
    roles = {w["url"]: w["role"] for w in router.workers().values()}
    assert roles == {prefill.url: "prefill", decode.url: "decode"}


def test_prefill_errors_fail_the_request_and_bad_json_is_the_routers_400(pd):
    router, prefill, _ = pd
    prefill.fail_status = 400
    refused = httpx.post(f"{router.url}/generate", json={"text": "x"}, timeout=30)
    assert refused.status_code == 400 and "prefill refuses" in refused.text
    prefill.fail_status = 500
    failed = httpx.post(f"{router.url}/generate", json={"text": "x"}, timeout=30)
    assert failed.status_code == 500, "one prefill worker only: nowhere to retry"
    prefill.fail_status = None
    bad = httpx.post(
        f"{router.url}/generate",
        content=b"{not json",
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert bad.status_code == 400 and "malformed JSON" in bad.json()["error"]["message"]
    assert httpx.post(f"{router.url}/generate", json={"text": "x"}, timeout=30).status_code == 200
