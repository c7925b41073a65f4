"""Page keys: chained over token ids, inside the model's namespace, the same in any process."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import pytest
from l3_helpers import run_python

from kvflow.runtime.cache.storage import StoreNamespace, page_keys

NS = StoreNamespace(
    model="HuggingFaceTB/SmolLM2-135M-Instruct",
    dtype="bfloat16",
    page_size=4,
    num_layers=30,
    num_kv_heads=3,
    head_dim=64,
)
TOKENS = list(range(100, 123))  # 5 full pages and 3 tokens


def test_full_pages_only_and_format():
    keys = page_keys(NS, TOKENS)
    assert len(keys) == 5
    assert len(set(keys)) == 5
    for key in keys:
        prefix, _, chain = key.partition("-")
        assert prefix == NS.digest and len(prefix) == 16 and len(chain) == 32
        assert len(key.encode()) <= 106
    assert page_keys(NS, TOKENS[:3]) == []


def test_same_prefix_same_keys_and_divergence():
    keys = page_keys(NS, TOKENS)
    other = [*TOKENS[:10], 7, 7, 7, *TOKENS[13:]]  # differs inside page 2 (tokens 8..11)
    other_keys = page_keys(NS, other)
    assert other_keys[:2] == keys[:2]
    assert not set(other_keys[2:]) & set(keys)  # chained: every later page differs


def test_prior_key_continues_the_chain():
    keys = page_keys(NS, TOKENS)
    assert page_keys(NS, TOKENS[8:], prior_key=keys[1]) == keys[2:]
    with pytest.raises(ValueError):
        page_keys(replace(NS, model="other"), TOKENS[8:], prior_key=keys[1])


def test_namespace_separates_models_layouts_and_ranks():
    keys = page_keys(NS, TOKENS)
    variants = [
        replace(NS, model="Qwen/Qwen2.5-0.5B"),
        replace(NS, dtype="float16"),
        replace(NS, num_layers=31),
        replace(NS, layout="layer_first"),
        replace(NS, tp_size=2),
        replace(NS, tp_size=2, tp_rank=1),
    ]
    digests = {NS.digest} | {variant.digest for variant in variants}
    assert len(digests) == len(variants) + 1
    for variant in variants:
        assert not set(page_keys(variant, TOKENS)) & set(keys)
    assert not set(page_keys(NS, TOKENS, extra_key="lora-a")) & set(keys)
    assert page_keys(replace(NS), TOKENS) == keys  # equal namespaces, equal keys


def test_invalid_namespace_and_page_size():
    with pytest.raises(ValueError):
        replace(NS, tp_size=2, tp_rank=2)
    with pytest.raises(ValueError):
        page_keys(NS, TOKENS, page_size=8)


def test_deterministic_across_processes():
    code = (
        "import json, sys\n"
        "from kvflow.runtime.cache.storage import StoreNamespace, page_keys\n"
        "ns = StoreNamespace(**json.loads(sys.argv[1]))\n"
        "print(json.dumps(page_keys(ns, json.loads(sys.argv[2]), extra_key='salt')))\n"
    )
    # A different hash seed in the child: keys must not depend on Python's str hashing.
    result = run_python(code, json.dumps(asdict(NS)), json.dumps(TOKENS))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == page_keys(NS, TOKENS, extra_key="salt")
