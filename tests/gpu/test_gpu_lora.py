"""Multi-LoRA on a GPU: every LoRA path inside the engine (an eager batch's per-segment or
masked matmuls, the Triton kernels of decode graphs and of eager batches past
``MASKED_ROWS``), against transformers with each adapter merged into the weights (``W +
scaling * B @ A``).

Self-contained (no peft on the GPU machine): the adapters are written in PEFT's format by
hand. Skipped without CUDA; run on the accelerator machine with
``pytest -m gpu tests/gpu/test_gpu_lora.py tests/kernels/test_lora_kernel.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SMALL = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, targets); the slots are sized for the largest rank (64), so the
# others run below it (the kernels stop at each slot's own rank)
ADAPTERS = {
    "a": (16, 32, ALL),
    "b": (8, 8, ["q_proj", "v_proj", "down_proj"]),
    "c": (4, 16, ALL),
    "d": (64, 64, ALL),
}
MAX_NEW = 24
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}


def _module(model, layer: int, name: str) -> torch.nn.Linear:
    block = model.model.layers[layer]
    return getattr(block.self_attn if name in ALL[:4] else block.mlp, name)


def _write_adapter(hf, folder: Path, seed: int, rank: int, alpha: int, targets: list[str]):
    """PEFT's files for a random adapter; returns {(layer, module): (A, B)}."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    weights, tensors = {}, {}
    for layer in range(SMALL["num_hidden_layers"]):
        for name in targets:
            linear = _module(hf, layer, name)
            a = torch.randn(rank, linear.in_features, generator=gen) * 0.1
            b = torch.randn(linear.out_features, rank, generator=gen) * 0.1
            weights[(layer, name)] = (a, b)
            part = "self_attn" if name in ALL[:4] else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    folder.mkdir()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets}
    (folder / "adapter_config.json").write_text(json.dumps({**config, "bias": "none"}))
    return weights


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("gpu-lora")
    hf = LlamaForCausalLM(LlamaConfig(**SMALL)).float()
    for param in hf.parameters():
        if param.dim() > 1:
            param.data.normal_(0, 0.08)
    hf.save_pretrained(root / "base")
    merged_state = {}
    for seed, (name, (rank, alpha, targets)) in enumerate(ADAPTERS.items(), start=1):
        weights = _write_adapter(hf, root / name, seed, rank, alpha, targets)
        state = {k: v.clone() for k, v in hf.state_dict().items()}
        for (layer, module), (a, b) in weights.items():
            part = "self_attn" if module in ALL[:4] else "mlp"
            key = f"model.layers.{layer}.{part}.{module}.weight"
            state[key] += (alpha / rank) * b @ a
        merged_state[name] = state
    return root, hf, merged_state


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [
        torch.randint(0, 1000, (n,), generator=g).tolist() for n in (3, 17, 64, 5, 129, 33, 250, 8)
    ]


def _hf_greedy(hf, state, batch) -> list[list[int]]:
    hf.load_state_dict(state)
    model = hf.cuda().eval()
    out = []
    with torch.no_grad():
        for ids in batch:
            # NOTE: the mask given: inferred, it would hide the prompt's tokens equal to
            # pad_token_id (a 600-token random prompt likely holds a 0)
            prompt = torch.tensor([ids], device="cuda")
            full = model.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=MAX_NEW,
                min_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0,
            )  # fmt: skip
            out.append(full[0, len(ids) :].tolist())
    return out


def _merged_greedy(hf, merged, batch, adapters) -> dict:
    """transformers' greedy tokens per adapter of ``adapters`` (its weights merged; None: the
    base model), the base weights put back afterwards."""
    base_state = {k: v.clone() for k, v in hf.state_dict().items()}
    want = {name: _hf_greedy(hf, merged[name], batch) for name in set(adapters) - {None}}
    want[None] = _hf_greedy(hf, base_state, batch)
    hf.load_state_dict(base_state)
    return want


def _lora_engine(root, dtype: str = "float32", **engine):
    """A CUDA engine on the base model with every adapter of ADAPTERS."""
    from kvflow.runtime.engine import Engine

    return Engine(
        str(root / "base"), device="cuda", dtype=dtype, skip_tokenizer_init=True,
        enable_lora=True, lora_paths=tuple(f"{n}={root / n}" for n in ADAPTERS),
        mem_fraction_static=0.3, **engine,
    )  # fmt: skip


def test_eager_layouts_compile_at_start_up(setup, monkeypatch):
    """``LoraManager.warm_kernels`` compiles the eager layouts' Triton kernels while the
    engine starts: prefills past MASKED_ROWS rows in several segments (the segmented
    kernels: long segments, many short ones) and a short one (the masked matmuls) then
    compile nothing (on an H200 that first compile stalled serving ~4.5 s). bf16, first in
    this module: no earlier test compiled this model's shapes."""
    from kvflow.kernels import lora as lora_kernels
    from kvflow.runtime.lora.batch import MASKED_ROWS

    root, _, _ = setup
    engine = _lora_engine(root, "bfloat16")
    compiled: list[str] = []
    kernels = (
        lora_kernels._shrink_kernel,
        lora_kernels._expand_kernel,
        lora_kernels._sum_splits_kernel,
    )
    for kernel in kernels:

        def counting(*args, _compile=kernel.compile, _name=kernel.fn.__name__, **kwargs):
            compiled.append(_name)
            return _compile(*args, **kwargs)

        monkeypatch.setattr(kernel, "compile", counting)
    g = torch.Generator().manual_seed(3)
    long = [torch.randint(0, 1000, (240,), generator=g).tolist() for _ in range(9)]  # 2160 rows
    short = [torch.randint(0, 1000, (16,), generator=g).tolist() for _ in range(130)]  # 2080
    assert sum(map(len, long)) > MASKED_ROWS and sum(map(len, short)) > MASKED_ROWS
    for batch in (long, short, _prompts()[:2]):
        adapters = [("a", "b", None, "c", "d")[i % 5] for i in range(len(batch))]
        engine.generate(input_ids=batch, sampling_params=GREEDY, lora_path=adapters)
    assert compiled == []
    assert engine.is_memory_free()
    del engine
    torch.cuda.empty_cache()


@pytest.mark.parametrize(
    ("max_loras_per_batch", "disable_cuda_graph"), [(3, False), (1, False), (3, True)]
)
def test_mixed_adapters_match_merged_weights_fp32(setup, max_loras_per_batch, disable_cuda_graph):
    """Decode runs in CUDA graphs (the rows grouped by adapter slot) unless disabled;
    with one slot, adapters are swapped between steps, under the graphs too."""
    root, hf, merged = setup
    batch = _prompts()
    adapters = ["a", None, "b", "c", "a", "b", None, "c"]
    want = _merged_greedy(hf, merged, batch, adapters)
    engine = _lora_engine(
        root, max_loras_per_batch=max_loras_per_batch, disable_cuda_graph=disable_cuda_graph
    )
    assert (engine.runner.graph_runner is None) == disable_cuda_graph
    results = engine.generate(input_ids=batch, sampling_params=GREEDY, lora_path=adapters)
    got = [r.output_ids for r in results]
    assert got == [want[name][i] for i, name in enumerate(adapters)]
    assert engine.is_memory_free()
    del engine
    torch.cuda.empty_cache()


def test_long_mixed_prefill_matches_merged_weights_fp32(setup):
    """A prefill past MASKED_ROWS rows in several segments takes the segmented Triton
    kernels in eager mode (B read through its transposed storage); each request still
    equals transformers with its adapter merged."""
    from kvflow.runtime.lora.batch import MASKED_ROWS

    root, hf, merged = setup
    g = torch.Generator().manual_seed(4)
    batch = [
        torch.randint(0, 1000, (n,), generator=g).tolist() for n in (300, 41, 700, 5, 600, 500)
    ]
    assert sum(map(len, batch)) > MASKED_ROWS
    adapters = ["d", "a", None, "c", "b", "d"]
    want = _merged_greedy(hf, merged, batch, adapters)
    engine = _lora_engine(root)
    results = engine.generate(input_ids=batch, sampling_params=GREEDY, lora_path=adapters)
    assert [r.output_ids for r in results] == [want[name][i] for i, name in enumerate(adapters)]
    assert engine.is_memory_free()
    del engine
    torch.cuda.empty_cache()


@pytest.mark.parametrize("max_loras_per_batch", [4, 2])
def test_grouped_graph_rows_with_mixed_ranks_fp32(setup, max_loras_per_batch):
    """Decode graphs with the rows grouped by adapter: 7 requests (the graph of 8 runs one
    padding row) interleaving ranks 64, 16, 8 and 4 and the base model, each equal to
    transformers with its adapter merged. With 2 slots the scheduler runs at most two
    adapters at once, so slots change adapters (and ranks) between graph replays."""
    root, hf, merged = setup
    batch = _prompts()[:7]
    adapters = ["d", "a", None, "d", "c", "b", "d"]
    want = _merged_greedy(hf, merged, batch, adapters)
    engine = _lora_engine(root, max_loras_per_batch=max_loras_per_batch)
    assert engine.runner.graph_runner is not None
    assert engine.runner.lora.limits.max_rank == 64
    results = engine.generate(input_ids=batch, sampling_params=GREEDY, lora_path=adapters)
    got = [r.output_ids for r in results]
    assert got == [want[name][i] for i, name in enumerate(adapters)]
    if max_loras_per_batch == 4:  # every adapter in a slot, each at its own rank
        assert sorted(engine.runner.lora.slot_ranks.tolist()) == [4, 8, 16, 64]
    assert engine.is_memory_free()
    del engine
    torch.cuda.empty_cache()


def test_bf16_adapters_run_and_differ(setup):
    """bf16 end to end: every adapter's answer differs from the base model's."""
    root, _, _ = setup
    engine = _lora_engine(root, "bfloat16")
    batch = _prompts()[:4] * 4
    adapters = [None] * 4 + ["a"] * 4 + ["b"] * 4 + ["c"] * 4
    got = [
        r.output_ids
        for r in engine.generate(input_ids=batch, sampling_params=GREEDY, lora_path=adapters)
    ]
    for i in range(4, 16):
        assert got[i] != got[i % 4]
    del engine
    torch.cuda.empty_cache()
