"""``kvflow serve --quantization gguf`` over HTTP: the embedded model served from its GGUF's
blocks answers a chat request as transformers on the same GGUF does (greedy, float32: the
token-level check is tests/runtime/test_gguf_parity.py)."""

from __future__ import annotations

import httpx
import pytest
from server_process import ServerProcess

from kvflow.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no native CPU kernels here")


def test_a_gguf_server_answers(embedded_ready, tmp_path) -> None:
    server = ServerProcess(
        "--quantization",
        "gguf",
        "--device",
        "cpu",
        "--max-total-tokens",
        "2000",
        log=tmp_path / "server.log",
    )
    try:
        body = {
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0,
            "max_tokens": 16,
        }
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
        assert reply.status_code == 200
        assert reply.json()["choices"][0]["message"]["content"].startswith(
            "The capital of France is Paris."
        )
        assert "GGUF Q4_1 weights" in server.log.read_text()
    finally:
        assert server.stop() == 0
