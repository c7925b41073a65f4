"""A server speculating with NGRAM: streamed text (several tokens per chunk) equals the
non-streamed text, ``spec_accept_length`` in /get_server_info and /metrics, KV freed. (Greedy
equality with the plain path: tests/speculative/test_spec_greedy.py.)"""

from __future__ import annotations

import json

import httpx
from server_process import ServerProcess

CODE = "def area(width, height):\n    return width * height\n\nprint(area(3, 4))\n"
MESSAGES = [{"role": "user", "content": f"Repeat this code, renaming width to w:\n{CODE}"}]


def test_ngram_server_streams_and_reports_accept_length(embedded_ready, tmp_path):
    body = {"model": "m", "messages": MESSAGES, "temperature": 0, "max_tokens": 40}
    proc = ServerProcess(
        "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "6",
        log=tmp_path / "server.log",
    )  # fmt: skip
    try:
        url = f"{proc.url}/v1/chat/completions"
        whole = httpx.post(url, json=body, timeout=120).json()
        text = whole["choices"][0]["message"]["content"]
        pieces = []
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    pieces.append(delta.get("content") or "")
        assert "".join(pieces) == text
        info = proc.wait_idle_and_free()
        assert info["stats"]["spec_accept_length"] > 1.0
        assert info["internal_states"][0]["avg_spec_accept_length"] > 1.0
        metrics = httpx.get(f"{proc.url}/metrics", timeout=30).text
        line = next(m for m in metrics.splitlines() if m.startswith("sglang:spec_accept_length"))
        assert float(line.split()[-1]) > 1.0
    finally:
        proc.stop()
