"""``--quantization gguf`` loading on a tiny Llama GGUF written here (``gguf.GGUFWriter``,
blocks by ``gguf.quants.quantize``; q and k rows permuted as llama.cpp's converter does):
each projection equals transformers' (which loads the same file, dequantized) on random
rows, the tied head runs the token embedding's Q8_0 blocks; and the CLI's refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kvflow.kernels import cpu
from kvflow.runtime.server.args import parse_args

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 96, 2, 4, 2, 128
LORA_TARGET = ["--lora-target-modules", "q_proj"]
MARKER = ".kvflow-converted"  # runtime/models/embedded.py: a folder converted from a GGUF

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no native CPU kernels here")


def _permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py permutation of q_proj / k_proj rows."""
    return (
        rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


def _write_gguf(path: Path, projection_type: str = "Q4_1") -> None:
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(VOCAB)

    def add(name: str, shape: tuple[int, ...], kind: str, heads: int = 0) -> None:
        values = (rng.standard_normal(shape) * 0.2).astype(np.float32)
        if heads:
            values = _permute(values, heads)
        if kind == "F32":
            writer.add_tensor(name, values)
            return
        qtype = GGMLQuantizationType[kind]
        writer.add_tensor(name, quantize(values, qtype), raw_dtype=qtype)

    add("token_embd.weight", (VOCAB, HIDDEN), "Q8_0")
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", (HIDDEN,), "F32")
        add(f"blk.{i}.attn_q.weight", (HIDDEN, HIDDEN), projection_type, HEADS)
        add(f"blk.{i}.attn_k.weight", (HIDDEN // HEADS * KV_HEADS, HIDDEN), "Q4_1", KV_HEADS)
        add(f"blk.{i}.attn_v.weight", (HIDDEN // HEADS * KV_HEADS, HIDDEN), "Q4_1")
        add(f"blk.{i}.attn_output.weight", (HIDDEN, HIDDEN), "Q4_1")
        add(f"blk.{i}.ffn_norm.weight", (HIDDEN,), "F32")
        add(f"blk.{i}.ffn_gate.weight", (FFN, HIDDEN), "Q8_0")
        add(f"blk.{i}.ffn_up.weight", (FFN, HIDDEN), "Q8_0")
        add(f"blk.{i}.ffn_down.weight", (HIDDEN, FFN), "Q8_0")
    add("output_norm.weight", (HIDDEN,), "F32")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A folder "converted" from the tiny GGUF (config.json and the marker naming the
    file) and transformers' float32 model of that GGUF."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("tiny-gguf")
    _write_gguf(folder / "tiny.gguf")
    hf = AutoModelForCausalLM.from_pretrained(
        str(folder), gguf_file="tiny.gguf", dtype=torch.float32
    ).eval()
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    (folder / MARKER).write_text(str(folder / "tiny.gguf") + "\n")
    return folder, hf


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_projections_match_transformers_on_the_same_gguf(tiny, dtype) -> None:
    from kvflow.runtime.config import ModelConfig
    from kvflow.runtime.models.loader import load_model

    folder, hf = tiny
    ours = load_model(folder, ModelConfig.from_path(folder), "auto", dtype, "cpu", 0, None, "gguf")
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(1))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for i in range(LAYERS):
        theirs, mine = hf.model.layers[i], ours.layers[i]
        attn = theirs.self_attn
        qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        got = mine.self_attn.qkv_proj(x.to(dtype)).float()
        torch.testing.assert_close(got, x @ qkv.T, atol=tol, rtol=tol)
        mlp = theirs.mlp
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        got = mine.mlp.gate_up_proj(x.to(dtype)).float()
        torch.testing.assert_close(got, x @ gate_up.T, atol=tol, rtol=tol)
        wide = torch.randn(3, FFN)
        got = mine.mlp.down_proj(wide.to(dtype)).float()
        torch.testing.assert_close(got, wide @ mlp.down_proj.weight.T, atol=tol, rtol=tol)
        norm = mine.input_layernorm.weight.float()
        torch.testing.assert_close(norm, theirs.input_layernorm.weight, atol=tol, rtol=tol)
    embed = hf.model.embed_tokens.weight
    # read from the tied head's Q8_0 blocks: bit for bit the dequantized embedding's rows
    ids = torch.tensor([[0, 17, VOCAB - 1], [5, 5, 16]])
    assert torch.equal(ours.embed_tokens(ids), embed.to(dtype)[ids])
    logits = ours.compute_logits(x.to(dtype))  # the tied head in Q8_0 blocks
    assert type(ours.packed_head).__name__ == "QuantHead"
    torch.testing.assert_close(logits, x @ embed.T, atol=tol, rtol=tol)


def test_a_tied_q8_0_embedding_keeps_no_float_copy(tiny) -> None:
    from kvflow.runtime.config import ModelConfig
    from kvflow.runtime.layers.quantization.gguf import QuantEmbedding
    from kvflow.runtime.models.loader import load_model

    folder, _ = tiny
    config = ModelConfig.from_path(folder)
    ours = load_model(folder, config, "auto", torch.bfloat16, "cpu", 0, None, "gguf")
    assert isinstance(ours.embed_tokens, QuantEmbedding)
    floats = [p for p in ours.parameters() if p.is_floating_point()]
    assert floats and all(p.numel() < VOCAB * HIDDEN for p in floats)
    # the float path (no --quantization gguf) still holds it
    dense = load_model(folder, config, "dummy", torch.bfloat16, "cpu", 0)
    assert dense.embed_tokens.weight.shape == (VOCAB, HIDDEN)


def _config(folder: Path) -> None:
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
    }
    (folder / "config.json").write_text(json.dumps(raw))


def _refusal(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_a_block_type_the_kernels_do_not_serve_is_refused(tmp_path, capsys) -> None:
    _write_gguf(tmp_path / "tiny.gguf", projection_type="Q5_0")
    _config(tmp_path)
    (tmp_path / MARKER).write_text(str(tmp_path / "tiny.gguf"))
    argv = ["--model-path", str(tmp_path), "--quantization", "gguf", "--device", "cpu"]
    err = _refusal(argv, capsys)
    assert "blk.0.attn_q.weight is Q5_0; the CPU kernels serve Q8_0, Q4_1" in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--device", "cuda"], "runs on CPU only"),
        (["--device", "cpu", "--tp-size", "2"], "--tp-size 1"),
        (["--device", "cpu", "--load-format", "dummy"], "drop --load-format dummy"),
        (
            ["--device", "cpu", "--enable-lora", "--max-lora-rank", "8", *LORA_TARGET],
            "--enable-lora with --quantization gguf",
        ),
    ],
)
def test_gguf_off_cpu_or_sharded_is_refused(capsys, flags, message) -> None:
    assert message in _refusal(["--quantization", "gguf", *flags], capsys)


def test_a_model_without_a_gguf_is_refused(tmp_path, capsys) -> None:
    _config(tmp_path)
    argv = ["--model-path", str(tmp_path), "--quantization", "gguf", "--device", "cpu"]
    assert "this model has no GGUF file" in _refusal(argv, capsys)


def test_the_embedded_model_takes_gguf() -> None:
    assert parse_args(["--quantization", "gguf", "--device", "cpu"]).engine.quantization == "gguf"
