"""HiCache on CUDA: device <-> host copies on the side stream (pinned host pool) are
bit-exact, and greedy outputs with a device pool too small for the working set (prefixes
spill to host and come back, after a shared prefix that stays) equal those without
HiCache, CUDA graphs, decode-ahead and chunked prefill on.

Skipped without CUDA; run on the accelerator machine with ``pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_tier_copies_on_cuda_are_bit_exact():
    from kvflow.runtime.cache.tier_copy import TierCopy
    from kvflow.runtime.mem import KVPool
    from kvflow.runtime.mem.host_pool import HostKVPool

    page, pages = 16, 32
    pool = KVPool((pages + 1) * page, 4, 2, 64, torch.bfloat16, "cuda")
    for buf in pool.k_buffer + pool.v_buffer:
        buf.normal_()
    host = HostKVPool(pool, page, 16)
    assert host.data.is_pinned()
    copier = TierCopy(pool, host)
    dev = torch.arange(5 * page, 9 * page)  # device pages 5..8
    hst = torch.arange(2 * page, 6 * page)  # host pages 2..5
    expected = [b[dev.cuda()].clone() for b in pool.k_buffer + pool.v_buffer]
    copier.to_host(dev, hst).wait()
    back = torch.arange(20 * page, 24 * page)  # other device pages
    copier.to_device(hst, back)
    torch.cuda.current_stream().synchronize()
    got = [b[back.cuda()] for b in pool.k_buffer + pool.v_buffer]
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)


def test_greedy_outputs_with_hicache_equal_plain_on_cuda(tmp_path):
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    from kvflow.runtime.engine import Engine

    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "eos_token_id": 1023,
        "tie_word_embeddings": False,
    }  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config)).to(torch.float32)
    for param in model.parameters():
        param.data.normal_(0, 0.08) if param.dim() > 1 else None
    model.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps(json.loads((tmp_path / "config.json").read_text()))
    )
    g = torch.Generator().manual_seed(3)
    # a shared system prompt stays on the device while the documents after it spill: a
    # match then joins device slots with slots loaded back from the host (both must live
    # on the GPU), and chunked prefill caches those paths mid-request
    system = torch.randint(0, 1000, (64,), generator=g).tolist()
    docs = [system + torch.randint(0, 1000, (300,), generator=g).tolist() for _ in range(6)]
    rounds = [[[*d, 1000 + q] for d in docs] for q in range(3)]
    common = dict(
        skip_tokenizer_init=True, dtype="float32", device="cuda", page_size=16,
        chunked_prefill_size=128,
    )  # fmt: skip
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}

    def run(**kwargs):
        engine = Engine(str(tmp_path), **common, **kwargs)
        out = [
            [engine.generate(input_ids=p, sampling_params=params).output_ids for p in r]
            for r in rounds
        ]
        return engine, out

    plain, expected = run(max_total_tokens=8192)
    del plain
    for policy in ("write_through", "write_back"):
        engine, got = run(
            max_total_tokens=768, hicache_host_memory_gb=0.05, hicache_write_policy=policy
        )
        assert got == expected, policy
        assert engine.scheduler.kv.hit_tokens.host > 0
        assert engine.is_memory_free()
        del engine
