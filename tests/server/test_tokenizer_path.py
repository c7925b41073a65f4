"""``--tokenizer-path`` (SGLang's flag): a model folder without tokenizer files serves text
with the tokenizer of another folder, as dummy-weight configs need for text benchmarks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_process import ServerProcess

from kvflow.runtime.tokenizer import tokenizer_folder

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def weights_only(embedded_ready: Path, tmp_path_factory) -> Path:
    """The embedded model's config and weights, without any tokenizer file."""
    folder = tmp_path_factory.mktemp("weights-only")
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        if (embedded_ready / name).exists():
            (folder / name).symlink_to(embedded_ready / name)
    assert not list(folder.glob("tokenizer*"))
    return folder


@pytest.fixture(scope="module")
def split_server(weights_only, embedded_ready, tmp_path_factory) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        "--model-path",
        str(weights_only),
        "--tokenizer-path",
        str(embedded_ready),
        "--max-total-tokens",
        "4000",
        "--context-length",
        "1024",
        log=tmp_path_factory.mktemp("server") / "server.log",
    )
    yield proc
    proc.stop()


def test_tokenizer_folder_choice(tmp_path):
    config = tmp_path / "config.json"
    assert tokenizer_folder(None, False, tmp_path) == tmp_path
    assert tokenizer_folder(None, False, config) == tmp_path  # a config file: its folder
    assert tokenizer_folder("/elsewhere", False, tmp_path) == Path("/elsewhere")
    assert tokenizer_folder("/elsewhere", True, tmp_path) is None  # skip wins, as in SGLang


def test_completion_text_from_the_other_folders_tokenizer(
    split_server, weights_only, tokenizer, model_path
):
    from kvflow.runtime.engine import Engine

    body = {"model": "m", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    reply = httpx.post(f"{split_server.url}/v1/completions", json=body, timeout=120).json()
    assert reply["usage"]["prompt_tokens"] == len(tokenizer.encode(PROMPT))
    expected = Engine(str(model_path), max_total_tokens=2000, context_length=1024).generate(
        PROMPT, {"max_new_tokens": 12, "temperature": 0}
    )
    assert reply["choices"][0]["text"] == expected.text
    info = httpx.get(f"{split_server.url}/get_model_info", timeout=30).json()
    assert info["tokenizer_path"] == str(model_path)
    assert info["model_path"] == str(weights_only)
