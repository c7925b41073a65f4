"""End to end on a GPU: kvflow vs transformers on the same random weights (CUDA graphs on and off).

Skipped without CUDA; run on the accelerator machine with ``pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

import gc
import json

import pytest
import torch
from prefill_logits import (
    assert_as_close_as_transformers,
    bf16_runner,
    last_logits,
    transformers_logits,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SMALL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "eos_token_id": 1023,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("small-llama")
    hf = LlamaForCausalLM(LlamaConfig(**SMALL)).to(torch.float32)
    for param in hf.parameters():  # larger weights than the default init: peaked logits
        param.data.normal_(0, 0.08) if param.dim() > 1 else None
    hf.save_pretrained(folder)
    (folder / "config.json").write_text(
        json.dumps({**json.loads((folder / "config.json").read_text())})
    )
    return folder, hf.cuda().eval()


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [
        torch.randint(0, 1000, (n,), generator=g).tolist() for n in (3, 17, 64, 5, 129, 33, 250, 8)
    ]


@pytest.mark.parametrize("cuda_graph", [True, False])
def test_greedy_parity_small_llama_fp32(small_model, cuda_graph):
    """Token for token, except where transformers' own top two logits tie within fp32 noise
    (then the first divergence must be such a tie: a real bug would show a clear margin)."""
    from kvflow.runtime.engine import Engine

    folder, hf = small_model
    engine = Engine(
        str(folder),
        skip_tokenizer_init=True,
        dtype="float32",
        device="cuda",
        disable_cuda_graph=not cuda_graph,
        max_running_requests=16,
        cuda_graph_max_bs=16,
        max_total_tokens=8192,
    )
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    ours = [r.output_ids for r in engine.generate(input_ids=_prompts(), sampling_params=params)]
    assert engine.is_memory_free()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    exact = 0
    with torch.no_grad():
        for ids, our_ids in zip(_prompts(), ours, strict=True):
            out = hf.generate(
                torch.tensor([ids], device="cuda"),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device="cuda"),
                max_new_tokens=24,
                do_sample=False,
                min_new_tokens=24,
                pad_token_id=0,
            )
            theirs = out[0, len(ids) :].tolist()
            if theirs == our_ids:
                exact += 1
                continue
            j = next(i for i, (a, b) in enumerate(zip(theirs, our_ids, strict=True)) if a != b)
            logits = hf(torch.tensor([ids + theirs[:j]], device="cuda")).logits[0, -1]
            margin = float(logits[theirs[j]] - logits[our_ids[j]])
            assert margin < 1e-4 * float(logits.abs().max()), (
                f"diverged at {j} with margin {margin}"
            )
    assert exact >= len(ours) - 1, f"only {exact} of {len(ours)} prompts matched exactly"


def test_llama_8b_shapes_logits_close_in_bf16():
    """Against an fp32 reference, kvflow's bf16 logits are as close as transformers' own bf16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvflow.runtime.config import DUMMY_CONFIGS

    raw = json.loads(DUMMY_CONFIGS["llama-3.1-8b"].read_text())
    torch.manual_seed(0)
    ids = torch.randint(0, raw["vocab_size"], (48,), device="cuda")
    with torch.device("cuda"):
        hf = LlamaForCausalLM(LlamaConfig(**raw)).to(torch.float32).eval()
    reference, hf_bf16 = transformers_logits(hf, ids)
    runner = bf16_runner("llama-3.1-8b", load_format="dummy")
    runner.model.load_weights((name, tensor) for name, tensor in hf.state_dict().items())
    del hf
    gc.collect()
    ours = last_logits(runner, ids)
    assert_as_close_as_transformers("llama-3.1-8b", ours, hf_bf16, reference)


def test_mixed_chunk_with_staggered_arrivals_matches_plain(small_model):
    """Mixed chunked prefill on CUDA (graphs on for the decode steps between): requests that
    arrive while others decode give the same greedy tokens as plain scheduling."""
    from kvflow.runtime.engine import Engine
    from kvflow.runtime.scheduler import Req
    from kvflow.runtime.wire import GenerateRequest, SamplingParams

    folder, _ = small_model
    params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)

    def run(**kwargs) -> dict[str, list[int]]:
        engine = Engine(
            str(folder),
            skip_tokenizer_init=True,
            dtype="float32",
            device="cuda",
            max_running_requests=16,
            cuda_graph_max_bs=16,
            max_total_tokens=8192,
            **kwargs,
        )
        sched = engine.scheduler
        prompts = _prompts()
        reqs = [
            Req(GenerateRequest(rid=f"r{i}", input_ids=ids, sampling=params))
            for i, ids in enumerate(prompts)
        ]
        for req in reqs[:3]:
            sched.add_request(req)
        for step in range(40):
            if step in (3, 6, 9, 12, 15):
                sched.add_request(reqs[3 + (step - 3) // 3])
            if sched.has_work():
                sched.step()
        while sched.has_work():
            sched.step()
        assert engine.is_memory_free()
        out = {r.rid: list(r.output_ids) for r in reqs}
        del engine
        gc.collect()
        torch.cuda.empty_cache()
        return out

    plain = run()
    mixed = run(enable_mixed_chunk=True, mixed_chunk_size=64)
    same = sum(plain[k] == mixed[k] for k in plain)
    assert same >= len(plain) - 1, (same, plain, mixed)
