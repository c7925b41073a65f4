"""HiCache's host tier under tensor parallelism: each rank keeps its KV heads' pages in its
own host pool and takes the same tier decisions, so greedy output at TP=2 equals TP=1 and
transformers while prompts are evicted to host and loaded back."""

from __future__ import annotations

from test_tp_engine import MAX_NEW, _build
from tiny_llama import hf_greedy
from tp_ranks import run_ranks


def _greedy(hf, prompts: list[list[int]]) -> list[list[int]]:
    return [hf_greedy(hf, ids, MAX_NEW) for ids in prompts]


def _prompt_sets() -> tuple[list[list[int]], list[list[int]]]:
    import torch

    g = torch.Generator().manual_seed(7)
    first = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (60, 45, 52)]
    second = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (58, 40, 50)]
    return first, second


def test_host_tier_tp2_equals_tp1_and_transformers(tmp_path):
    hf = _build(tmp_path, "llama")
    first, second = _prompt_sets()
    greedy = {"temperature": 0, "max_new_tokens": MAX_NEW}
    # first set, a second set that pushes it off the device, the first set again (host hits)
    calls = [{"input_ids": ids, "sampling_params": greedy} for ids in (first, second, first)]
    engine = {
        "max_total_tokens": 300,
        "hicache_host_memory_gb": 0.002,
        "dtype": "float32",
        "skip_tokenizer_init": True,
    }
    expected = [_greedy(hf, first), _greedy(hf, second), _greedy(hf, first)]
    one = run_ranks(1, str(tmp_path), calls, **engine)[0]
    two = run_ranks(2, str(tmp_path), calls, **engine)
    assert one["outputs"] == expected
    for report in two:
        assert report["outputs"] == expected
        assert report["memory_free"]
    assert two[0]["host_hit_tokens"] > 0, "the third round must load prompts back from host"
    assert two[0]["host_hit_tokens"] == two[1]["host_hit_tokens"]


def test_storage_tier_tp2_equals_tp1_and_transformers(tmp_path):
    """HiCache's file store under TP=2: each rank writes its heads' pages under its own
    keys, and a second engine per rank finds them: its prompts come from the store (equal
    hits on both ranks: a prefetch brings what every rank has) and its greedy tokens equal
    transformers' and TP=1's."""
    import torch

    hf = _build(tmp_path / "model", "llama")
    g = torch.Generator().manual_seed(11)  # past MIN_PREFETCH_TOKENS (64) uncached each
    first = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (130, 100, 121)]
    greedy = {"temperature": 0, "max_new_tokens": MAX_NEW}
    expected = _greedy(hf, first)

    def engine(store: str) -> dict:
        return {
            "max_total_tokens": 600,
            "page_size": 4,
            "hicache_host_memory_gb": 0.002,
            "hicache_storage": "file",
            "hicache_storage_path": str(tmp_path / store),
            "hicache_prefetch_timeout": 30.0,
            "dtype": "float32",
            "skip_tokenizer_init": True,
        }

    calls = [{"input_ids": first, "sampling_params": greedy}]
    for size in (1, 2):
        store = f"l3-tp{size}"
        writers = run_ranks(size, str(tmp_path / "model"), calls, **engine(store))
        readers = run_ranks(size, str(tmp_path / "model"), calls, **engine(store))
        for report in writers + readers:
            assert report["outputs"] == [expected]
            assert report["memory_free"]
        hits = [r["storage_hit_tokens"] for r in readers]
        assert hits[0] > 0, "the second engine must find the first one's pages in the store"
        assert hits == [hits[0]] * size
    assert len(list((tmp_path / "l3-tp2").rglob("*"))) > len(list((tmp_path / "l3-tp1").rglob("*")))
