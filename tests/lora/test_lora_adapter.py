"""What an adapter may be (PEFT's format, checked on load), the LRU slots, the segment
layout, and SGLang's LoRA flags at start-up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lora_adapters import TINY, build_adapter, build_base

from kvflow.runtime.lora import (
    LoraBatch,
    LoraLimits,
    LoraSlots,
    load_adapter,
    parse_lora_paths,
    resolve_target_modules,
)
from kvflow.runtime.lora.weights import SlotWeights
from kvflow.runtime.server.args import parse_args

HIDDEN, INTER = TINY["hidden_size"], TINY["intermediate_size"]
KV = HIDDEN // TINY["num_attention_heads"] * TINY["num_key_value_heads"]
IN = {"q_proj": HIDDEN, "k_proj": HIDDEN, "v_proj": HIDDEN, "o_proj": HIDDEN, "gate_proj": HIDDEN,
      "up_proj": HIDDEN, "down_proj": INTER}  # fmt: skip
OUT = {"q_proj": HIDDEN, "k_proj": KV, "v_proj": KV, "o_proj": HIDDEN, "gate_proj": INTER,
       "up_proj": INTER, "down_proj": HIDDEN}  # fmt: skip


def _limits(max_rank=8, targets=tuple(IN)) -> LoraLimits:
    return LoraLimits(max_rank, frozenset(targets), TINY["num_hidden_layers"], IN, OUT)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("base")
    build_base(folder)
    return folder


@pytest.fixture(scope="module")
def adapter(base, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("adapter") / "a"
    build_adapter(base, folder, seed=1, r=8, lora_alpha=4, target_modules=["q_proj", "up_proj"])
    return folder


def test_loads_peft_format(adapter):
    loaded = load_adapter("a", str(adapter), _limits())
    assert loaded.rank == 8 and loaded.scaling == 0.5
    assert loaded.target_modules == {"q_proj", "up_proj"}
    a, b = loaded.weights[(1, "up_proj")]
    assert a.shape == (8, HIDDEN) and b.shape == (INTER, 8) and b.abs().sum() > 0
    assert load_adapter("b", str(adapter), _limits()).key == loaded.key  # content, not name


def test_refuses_what_it_cannot_apply(adapter, tmp_path):
    with pytest.raises(
        ValueError, match=r"rank 8; this server takes ranks up to 4 \(--max-lora-rank\)"
    ):
        load_adapter("a", str(adapter), _limits(max_rank=4))
    with pytest.raises(ValueError, match=r"targets 'up_proj'.*--lora-target-modules"):
        load_adapter("a", str(adapter), _limits(targets=("q_proj",)))
    with pytest.raises(ValueError, match="is not a folder"):
        load_adapter("a", str(tmp_path / "missing"), _limits())
    config = json.loads((adapter / "adapter_config.json").read_text())
    for key, value, message in [
        ("use_dora", True, "DoRA"),
        ("modules_to_save", ["lm_head"], "modules_to_save"),
        ("bias", "all", "bias 'all'"),
        ("rank_pattern", {"q_proj": 4}, "rank_pattern"),
    ]:
        folder = tmp_path / key
        folder.mkdir()
        (folder / "adapter_model.safetensors").write_bytes(
            (adapter / "adapter_model.safetensors").read_bytes()
        )
        (folder / "adapter_config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(ValueError, match=message):
            load_adapter("x", str(folder), _limits())


def test_refuses_an_adapter_of_another_model(base, tmp_path):
    build_adapter(base, tmp_path / "a", seed=1, r=2, target_modules=["q_proj"])
    wrong = LoraLimits(8, frozenset(IN), 2, {**IN, "q_proj": 32}, OUT)
    with pytest.raises(ValueError, match="another base model"):
        load_adapter("a", str(tmp_path / "a"), wrong)


def test_slots_evict_the_least_recently_used():
    slots = LoraSlots(2)
    first = slots.plan(["a", "b"])
    assert sorted(first.loads) == [("a", 0), ("b", 1)]
    assert slots.plan(["a"]).loads == []  # resident; "a" now most recent
    third = slots.plan(["c", "a"])
    assert third.loads == [("c", 1)] and third.slots == {"a": 0, "c": 1}  # "b" evicted
    with pytest.raises(ValueError, match="3 adapters in one batch"):
        slots.plan(["a", "b", "c"])
    slots.drop("c")
    assert slots.plan(["b"]).loads == [("b", 1)]


def test_segments_merge_neighbours_on_one_slot():
    batch = LoraBatch.of([0, 0, -1, 1, 1, 0], [3, 1, 5, 1, 1, 2], "cpu")
    assert batch is not None
    assert batch.seg_indptr.tolist() == [0, 4, 9, 11, 13]
    assert batch.seg_slots.tolist() == [0, -1, 1, 0] and batch.max_seg_len == 5
    assert batch.segments == ((0, 4, 0), (9, 11, 1), (11, 13, 0))  # the host's, with a slot
    assert LoraBatch.of([-1, -1], [3, 1], "cpu") is None


def test_slot_views_follow_writes_in_place():
    """Each slot's A.T and B.T and every slot stacked are views made once: a slot written
    later (through ``a`` and ``b``, as LoraLinear writes) shows in them."""
    weights = SlotWeights.zeros(2, 4, 8, (3, 5), torch.float32, "cpu")
    assert weights.a.shape == (2, 8, 8) and weights.b.shape == (2, 8, 8)
    weights.a[1, 6, 2] = 7.0
    weights.b[0, 4, 5] = 3.0
    assert weights.a_t[1][2, 6] == 7.0 and weights.b_t[0][5, 4] == 3.0
    assert weights.a_cat[8 + 6, 2] == 7.0 and weights.b_cat[5, 4] == 3.0
    assert weights.a_t[0].abs().sum() == 0 and weights.b_t[1].abs().sum() == 0
    with pytest.raises(ValueError, match="do not fit"):
        SlotWeights.of(torch.zeros(2, 4, 8), torch.zeros(2, 4, 5), (3,))
    with pytest.raises(ValueError, match="A \\[slots, R, K\\]"):
        SlotWeights.of(torch.zeros(2, 4, 8), torch.zeros(2, 3, 5), (5,))


def test_names_and_targets():
    assert parse_lora_paths(["a=/x", "/y"]) == [("a", "/x"), ("/y", "/y")]
    entry = '{"lora_name": "j", "lora_path": "/p=q", "pinned": true}'  # SGLang's JSON form
    assert parse_lora_paths([entry]) == [("j", "/p=q")]
    with pytest.raises(ValueError, match="twice"):
        parse_lora_paths(["a=/x", "a=/y"])
    assert resolve_target_modules(("qkv_proj", "down_proj")) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "down_proj",
    }
    with pytest.raises(ValueError, match="'embed_tokens' is not supported"):
        resolve_target_modules(("embed_tokens",))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lora-paths", "a=/x"], "need --enable-lora"),
        (["--enable-lora"], "needs --max-lora-rank and --lora-target-modules"),
        (["--enable-lora", "--lora-paths", "=x"], "expected NAME=PATH"),
        (
            ["--enable-lora", "--lora-paths", "a=/x", "--lora-target-modules", "lm_head"],
            "not supported",
        ),
        (["--enable-lora", "--lora-paths", "a=/x", "--max-loras-per-batch", "0"], ">= 1"),
        (["--enable-lora", "--lora-paths", "a=/x", "--lora-backend", "csgmv"], "segmented Triton"),
    ],
)
def test_flags_are_checked_at_start(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_flags_reach_the_engine_config():
    args = parse_args(
        ["--enable-lora", "--lora-paths", "a=/x", "b=/y", "--max-loras-per-batch", "2",
         "--max-lora-rank", "16", "--lora-target-modules", "q_proj", "v_proj", "--lora-backend", "triton"]
    )  # fmt: skip
    engine = args.engine
    assert engine.enable_lora and engine.lora_paths == ("a=/x", "b=/y")
    assert engine.max_loras_per_batch == 2 and engine.max_lora_rank == 16
    assert engine.lora_target_modules == ("q_proj", "v_proj")
    assert engine.resolved().disable_cuda_graph  # no CUDA graphs with adapters
