"""LoRA adapters under tensor parallelism: every rank applies its part of each adapter
(B's rows of the column-parallel q/k/v and gate/up, A's columns of the row-parallel o and
down, whose delta joins the partial product before the all-reduce), and greedy output at
TP=2 equals transformers + PEFT token for token, with two adapters and the base model in
one batch; through HTTP, an adapter loaded while serving reaches both ranks, and one the
server cannot apply is refused on both."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
from tp_ranks import run_ranks

sys.path.insert(0, str(Path(__file__).parents[1] / "lora"))
sys.path.insert(0, str(Path(__file__).parents[1] / "server"))

from lora_adapters import ALL_MODULES, GREEDY, build_adapter, build_base, peft_greedy, prompts
from server_process import ServerProcess

LENGTHS = (7, 23, 4, 15, 31, 9)
ADAPTERS = ["a", None, "b", "a", "b", None]


def test_tp2_lora_equals_peft(tmp_path):
    base, a, b = tmp_path / "base", tmp_path / "adapter-a", tmp_path / "adapter-b"
    build_base(base)  # 4 heads and 2 KV heads: two and one per rank at tp 2
    build_adapter(base, a, seed=1, r=8, lora_alpha=16, target_modules=ALL_MODULES)
    build_adapter(
        base, b, seed=2, r=4, lora_alpha=6, target_modules=["q_proj", "v_proj", "down_proj"],
        use_rslora=True,
    )  # fmt: skip
    batch = prompts(LENGTHS)
    by_adapter = {
        name: peft_greedy(base, {"a": a, "b": b}.get(name) if name else None, batch)
        for name in ("a", "b", None)
    }
    expected = [by_adapter[name][i] for i, name in enumerate(ADAPTERS)]
    engine = {
        "dtype": "float32",
        "skip_tokenizer_init": True,
        "enable_lora": True,
        "lora_paths": (f"a={a}", f"b={b}"),
        "chunked_prefill_size": 16,
    }
    calls = [{"input_ids": batch, "sampling_params": GREEDY, "lora_path": ADAPTERS}]
    reports = run_ranks(2, str(base), calls, **engine)
    for report in reports:
        assert report["outputs"] == [expected]
        assert report["memory_free"]


def test_tp2_server_loads_an_adapter_on_every_rank(tmp_path):
    base, a, big = tmp_path / "base", tmp_path / "adapter-a", tmp_path / "big"
    build_base(base)
    build_adapter(base, a, seed=1, r=8, lora_alpha=16, target_modules=ALL_MODULES)
    build_adapter(base, big, seed=3, r=16, lora_alpha=16, target_modules=["q_proj"])
    server = ServerProcess(
        "--model-path", str(base), "--skip-tokenizer-init", "--dtype", "float32",
        "--tp-size", "2", "--enable-lora", "--max-lora-rank", "8",
        "--lora-target-modules", "all", log=tmp_path / "server.log",
    )  # fmt: skip
    try:
        body = {"lora_name": "a", "lora_path": str(a)}
        loaded = httpx.post(f"{server.url}/load_lora_adapter", json=body, timeout=120)
        assert loaded.status_code == 200, loaded.text
        batch = prompts((9, 21))
        body = {"input_ids": batch, "sampling_params": GREEDY, "lora_path": ["a", None]}
        response = httpx.post(f"{server.url}/generate", json=body, timeout=120)
        assert response.status_code == 200, response.text
        got = [item["output_ids"] for item in response.json()]
        assert got == [peft_greedy(base, a, batch)[0], peft_greedy(base, None, batch)[1]]
        body = {"lora_name": "big", "lora_path": str(big)}  # rank 16 > --max-lora-rank 8
        refused = httpx.post(f"{server.url}/load_lora_adapter", json=body, timeout=60)
        assert refused.status_code == 400 and "--max-lora-rank" in refused.text
        server.wait_idle_and_free()
    finally:
        server.stop()
