"""kvflow's greedy tokens with LoRA adapters equal transformers + PEFT's, token for token:
two adapters (different ranks, targets and scalings) and the base model in one batch,
with fewer device slots than adapters, and with the prefix cache keyed per adapter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lora_adapters import ALL_MODULES, GREEDY, build_adapter, build_base, peft_greedy, prompts

from kvflow.runtime.engine import Engine
from kvflow.runtime.lora import LoraBatch
from kvflow.runtime.lora.batch import MASKED_ROWS

LENGTHS = (7, 23, 4, 15, 31, 9)
# per prompt: adapter "a", the base model, adapter "b", ...
ADAPTERS = ["a", None, "b", "a", "b", None]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    base, a, b = root / "base", root / "adapter-a", root / "adapter-b"
    build_base(base)
    build_adapter(base, a, seed=1, r=8, lora_alpha=16, target_modules=ALL_MODULES)
    # rank 4 on three modules, rsLoRA's scaling (alpha / sqrt(r))
    build_adapter(
        base, b, seed=2, r=4, lora_alpha=6, target_modules=["q_proj", "v_proj", "down_proj"],
        use_rslora=True,
    )  # fmt: skip
    return {"base": base, "a": a, "b": b}


@pytest.fixture(scope="module")
def expected(checkpoints: dict[str, Path]) -> list[list[int]]:
    batch = prompts(LENGTHS)
    by_adapter = {
        name: peft_greedy(checkpoints["base"], checkpoints.get(name) if name else None, batch)
        for name in ("a", "b", None)
    }
    return [by_adapter[name][i] for i, name in enumerate(ADAPTERS)]


def _engine(checkpoints: dict[str, Path], **kwargs) -> Engine:
    paths = (f"a={checkpoints['a']}", f"b={checkpoints['b']}")
    options = {"skip_tokenizer_init": True, "dtype": "float32", "enable_lora": True}
    return Engine(str(checkpoints["base"]), lora_paths=paths, **options, **kwargs)


def _greedy(engine: Engine, adapters=ADAPTERS) -> list[list[int]]:
    results = engine.generate(
        input_ids=prompts(LENGTHS), sampling_params=GREEDY, lora_path=adapters
    )
    assert engine.is_memory_free()
    return [r.output_ids for r in results]


def test_adapters_change_the_answer(checkpoints):
    """The references differ per adapter on the same prompt (else parity proves nothing)."""
    batch = prompts(LENGTHS)[:2]
    answers = [
        peft_greedy(checkpoints["base"], checkpoints.get(name) if name else None, batch)
        for name in ("a", "b", None)
    ]
    for i in range(len(batch)):
        assert len({tuple(answer[i]) for answer in answers}) == 3


@pytest.mark.parametrize("mixed_chunk", [False, True])
def test_mixed_batch_matches_peft(checkpoints, expected, mixed_chunk):
    engine = _engine(checkpoints, enable_mixed_chunk=mixed_chunk, chunked_prefill_size=16)
    assert _greedy(engine) == expected


def test_one_slot_for_two_adapters(checkpoints, expected):
    """With one device slot, requests on "a" and "b" never share a batch (LRU swaps them)."""
    engine = _engine(checkpoints, max_loras_per_batch=1)
    assert _greedy(engine) == expected
    assert sorted(engine.runner.lora.slots.resident) in (["a"], ["b"])


def test_kernel_warm_up_reaches_every_eager_layout_and_changes_nothing(
    checkpoints, expected, monkeypatch
):
    """:meth:`LoraManager.warm_kernels` (run at start-up on CUDA, so Triton compiles there):
    every wrapped projection shape once per layout, the segmented kernels' segments of 16,
    32 and more rows past MASKED_ROWS, on scratch tensors: the slots' weights and ranks are
    as before, and the engine still answers as PEFT does."""
    engine = _engine(checkpoints)
    manager = engine.runner.lora
    weights = {key: (lora.a_slots.clone(), lora.b_slots.clone())
               for key, lora in manager.wrapped.items()}  # fmt: skip
    ranks = manager.slot_ranks.clone()
    seen: list[tuple[int, int, int]] = []
    add_delta = LoraBatch.add_delta

    def record(batch, x, out, weights):
        seen.append((x.shape[0], batch.max_seg_len, weights.b.shape[1]))
        return add_delta(batch, x, out, weights)

    monkeypatch.setattr(LoraBatch, "add_delta", record)
    manager.warm_kernels()
    monkeypatch.undo()
    shapes = {lora.b_slots.shape[1] for lora in manager.wrapped.values()}
    for out_rows in shapes:
        split = {seg for rows, seg, n in seen if n == out_rows and rows > MASKED_ROWS}
        assert {16, 32} < split and max(split) > 64
    assert all(rows > MASKED_ROWS for rows, _, _ in seen)
    assert len(seen) == 3 * len({path for _, path in manager.wrapped})
    assert torch.equal(manager.slot_ranks, ranks)
    for key, lora in manager.wrapped.items():
        assert torch.equal(lora.a_slots, weights[key][0]) and torch.equal(
            lora.b_slots, weights[key][1]
        )
    assert _greedy(engine) == expected


def test_prefix_cache_is_per_adapter(checkpoints, expected):
    """The same prompt under another adapter hits nothing cached; under the same one it does."""
    engine = _engine(checkpoints)
    ids = prompts(LENGTHS)[1]
    first = engine.generate(input_ids=ids, sampling_params=GREEDY, lora_path="a")
    other = engine.generate(input_ids=ids, sampling_params=GREEDY, lora_path="b")
    base = engine.generate(input_ids=ids, sampling_params=GREEDY)
    again = engine.generate(input_ids=ids, sampling_params=GREEDY, lora_path="a")
    assert first.cached_tokens == 0 and other.cached_tokens == 0 and base.cached_tokens == 0
    assert again.cached_tokens > 0 and again.output_ids == first.output_ids
    reference = peft_greedy(checkpoints["base"], checkpoints["b"], [ids])[0]
    assert other.output_ids == reference


def test_load_and_unload_while_serving(checkpoints, expected):
    engine = Engine(
        str(checkpoints["base"]), skip_tokenizer_init=True, dtype="float32", enable_lora=True,
        max_lora_rank=8, lora_target_modules=("all",),
    )  # fmt: skip
    with pytest.raises(ValueError, match="no LoRA adapter named 'a'"):
        engine.generate(input_ids=prompts(LENGTHS)[0], sampling_params=GREEDY, lora_path="a")
    engine.load_lora_adapter("a", str(checkpoints["a"]))
    engine.load_lora_adapter("b", str(checkpoints["b"]))
    assert _greedy(engine) == expected
    engine.unload_lora_adapter("b")
    with pytest.raises(ValueError, match="no LoRA adapter named 'b'"):
        engine.generate(input_ids=prompts(LENGTHS)[0], sampling_params=GREEDY, lora_path="b")
    # the same name again, new weights: the cache never serves the old adapter's KV
    engine.load_lora_adapter("b", str(checkpoints["a"]))
    out = engine.generate(input_ids=prompts(LENGTHS)[2], sampling_params=GREEDY, lora_path="b")
    assert (
        out.output_ids
        == peft_greedy(checkpoints["base"], checkpoints["a"], prompts(LENGTHS)[2:3])[0]
    )


def test_hicache_storage_keys_carry_the_adapter(checkpoints, tmp_path):
    """HiCache's file store: pages one engine wrote under adapter "a" are found by a fresh
    engine for "a", never for "b" (the page keys are salted with the adapter's key)."""
    ids = prompts((130,))[0]  # past the storage tier's shortest prefetch
    options = {
        "page_size": 16,
        "hicache_host_memory_gb": 0.01,
        "hicache_storage": "file",
        "hicache_storage_path": str(tmp_path / "l3"),
        "hicache_prefetch_timeout": 5.0,
    }
    first = _engine(checkpoints, **options)
    first.generate(input_ids=ids, sampling_params=GREEDY, lora_path="a")
    storage = first.scheduler.cache.storage
    assert storage is not None and storage.io.drain(30.0)
    first.scheduler.cache.poll()
    assert storage.io.stats().write_pages > 0
    second = _engine(checkpoints, **options)
    other = second.generate(input_ids=ids, sampling_params=GREEDY, lora_path="b")
    assert second.scheduler.kv.hit_tokens.storage == 0
    assert other.output_ids == peft_greedy(checkpoints["base"], checkpoints["b"], [ids])[0]
    same = second.generate(input_ids=ids, sampling_params=GREEDY, lora_path="a")
    assert second.scheduler.kv.hit_tokens.storage > 0
    assert same.output_ids == peft_greedy(checkpoints["base"], checkpoints["a"], [ids])[0]
    assert first.is_memory_free() and second.is_memory_free()
