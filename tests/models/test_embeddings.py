"""``is_embedding`` engines against transformers: each prompt's final-norm hidden state
pooled (last token, or mean where a sentence-transformers config says) and normalised."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from family_parity import build_hf, prompts

from kvflow.runtime.engine import Engine
from kvflow.runtime.pooling import PoolingType, pooling_of


def hf_embeddings(hf: torch.nn.Module, batch: list[list[int]], pooling: str) -> torch.Tensor:
    """transformers' reference: the base model's last hidden state (after the final norm)."""
    rows = []
    with torch.no_grad():
        for ids in batch:
            hidden = hf.model(torch.tensor([ids])).last_hidden_state[0]
            pooled = hidden[-1] if pooling == "last" else hidden.mean(0)
            rows.append(torch.nn.functional.normalize(pooled, dim=0))
    return torch.stack(rows)


def mark_mean_pooling(folder: Path) -> None:
    """Make ``folder`` a sentence-transformers folder that mean-pools."""
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True})
    )
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    (folder / "modules.json").write_text(json.dumps(modules))


def check_close(engine: Engine, hf: torch.nn.Module, batch: list[list[int]], pooling: str) -> None:
    ours = torch.tensor(engine.embed(batch))
    assert ours.shape == (len(batch), hf.config.hidden_size)
    assert torch.allclose(ours.norm(dim=1), torch.ones(len(batch)), atol=1e-5)
    cosine = (ours * hf_embeddings(hf, batch, pooling)).sum(1)
    assert cosine.min().item() >= 0.999, cosine
    assert engine.is_memory_free()


@pytest.mark.parametrize(
    ("family", "pooling"),
    [("Qwen2", "last"), ("Qwen2", "mean"), ("Llama", "mean")],
)
def test_tiny_model_embeddings_equal_transformers(tmp_path, family, pooling):
    hf = build_hf(tmp_path, f"{family}ForCausalLM", f"{family}Config", num_key_value_heads=2)
    if pooling == "mean":
        mark_mean_pooling(tmp_path)
    assert pooling_of(tmp_path) is PoolingType(pooling)
    # chunks of 16 tokens: a prompt's pooling spans several prefill steps
    engine = Engine(
        str(tmp_path), is_embedding=True, skip_tokenizer_init=True, chunked_prefill_size=16
    )
    batch = prompts()
    check_close(engine, hf, batch, pooling)
    # again, now over the prefixes the first round cached (reused by last-token pooling)
    check_close(engine, hf, [*batch[:3], batch[1][:30]], pooling)


def test_embedded_model_embeddings_equal_transformers(model_path, hf_model, tokenizer):
    engine = Engine(is_embedding=True)
    texts = ["The capital of France is Paris.", "hello", "A longer sentence " * 12]
    batch = [list(tokenizer.encode(t)) for t in texts]
    check_close(engine, hf_model, batch, "last")


def test_unknown_pooling_mode_is_refused(tmp_path):
    mark_mean_pooling(tmp_path)
    (tmp_path / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_cls_token": True})
    )
    with pytest.raises(ValueError, match="cls_token"):
        pooling_of(tmp_path)
