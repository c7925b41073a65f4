"""A real ``kvflow serve --is-embedding``: /v1/embeddings through the openai client, /encode,
bad input as 400 with the server serving on and no KV leaked, generation refused."""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch
from server_process import ServerProcess

CONTEXT = 256


@pytest.fixture(scope="module")
def embedding_server(embedded_ready, tmp_path_factory) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        "--is-embedding",
        "--max-total-tokens",
        "4000",
        "--context-length",
        str(CONTEXT),
        log=tmp_path_factory.mktemp("embedding") / "server.log",
    )
    yield proc
    proc.stop()


def reference(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        hidden = hf_model.model(torch.tensor([ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(hidden, dim=0)


def _floats(embedding: list[float] | str) -> list[float]:
    if isinstance(embedding, str):  # little-endian float32, as OpenAI's base64
        raw = base64.b64decode(embedding)
        return list(struct.unpack(f"<{len(raw) // 4}f", raw))
    return embedding


def test_openai_client_embeddings(embedding_server, hf_model, tokenizer):
    client = openai.OpenAI(base_url=f"{embedding_server.url}/v1", api_key="none")
    texts = ["The capital of France is Paris.", "hello there"]
    # left out, the client asks for base64 and decodes it itself; asked for, it does not
    for fmt in (openai.NOT_GIVEN, "float", "base64"):
        response = client.embeddings.create(
            model="SmolLM2-135M-Instruct", input=texts, encoding_format=fmt
        )
        assert response.object == "list" and response.model == "SmolLM2-135M-Instruct"
        assert [d.index for d in response.data] == [0, 1]
        ids = [list(tokenizer.encode(t)) for t in texts]
        assert response.usage.prompt_tokens == response.usage.total_tokens == sum(map(len, ids))
        for data, prompt_ids in zip(response.data, ids, strict=True):
            assert data.object == "embedding"
            ours = torch.tensor(_floats(data.embedding))
            assert ours.shape == (576,)
            assert torch.dot(ours, reference(hf_model, prompt_ids)).item() >= 0.999
    single = client.embeddings.create(model="x", input="hello there", encoding_format="float")
    token_ids = client.embeddings.create(model="x", input=[ids[1], ids[0]], encoding_format="float")
    assert len(token_ids.data) == 2
    assert (
        torch.dot(torch.tensor(single.data[0].embedding), torch.tensor(token_ids.data[0].embedding))
        > 0.9999
    )
    embedding_server.wait_idle_and_free()


def test_native_encode(embedding_server):
    one = httpx.post(f"{embedding_server.url}/encode", json={"text": "hello"}, timeout=60).json()
    assert len(one["embedding"]) == 576 and one["meta_info"]["prompt_tokens"] >= 1
    batch = httpx.post(
        f"{embedding_server.url}/encode", json={"input_ids": [[1, 2, 3], [4, 5]]}, timeout=60
    ).json()
    assert [b["meta_info"]["prompt_tokens"] for b in batch] == [3, 2]


@pytest.mark.parametrize(
    "body",
    [
        {"input": ""},
        {"input": []},
        {"input": ["fine", "  "]},
        {"input": [[]]},
        {"input": [1] * CONTEXT},
        {"input": [10**9]},
        {"input": "hi", "dimensions": 8},
        {"input": "hi", "encoding_format": "int8"},
    ],
)
def test_bad_input_is_400_and_the_server_serves_on(embedding_server, body):
    response = httpx.post(f"{embedding_server.url}/v1/embeddings", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"]
    ok = httpx.post(f"{embedding_server.url}/v1/embeddings", json={"input": "hi"}, timeout=60)
    assert ok.status_code == 200
    embedding_server.wait_idle_and_free()


def test_generation_is_refused_on_an_embedding_server(embedding_server):
    for path, body in [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/generate", {"text": "hi"}),
    ]:
        response = httpx.post(f"{embedding_server.url}{path}", json=body, timeout=60)
        assert response.status_code == 400
        assert "--is-embedding" in response.json()["error"]["message"]
    assert httpx.get(f"{embedding_server.url}/health_generate", timeout=60).status_code == 200
    info = httpx.get(f"{embedding_server.url}/get_model_info", timeout=60).json()
    assert info["is_generation"] is False


def test_embeddings_are_refused_on_a_generation_server(server):
    response = httpx.post(f"{server.url}/v1/embeddings", json={"input": "hi"}, timeout=60)
    assert response.status_code == 400
    assert "--is-embedding" in response.json()["error"]["message"]
