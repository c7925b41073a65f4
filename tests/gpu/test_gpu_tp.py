"""Tensor parallelism's GPU path on one GPU: an NCCL group of world size 1, whose
all-reduces and all-gathers run for real (inside the captured CUDA graphs too), gives the
same greedy tokens as the engine with no group. Several GPUs belong to the several-GPU run.

Skipped without CUDA; run on the accelerator machine with ``pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

import gc
import json
import socket

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "eos_token_id": 999,
    "tie_word_embeddings": False,
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _greedy(engine) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 999, (n,), generator=g).tolist() for n in (5, 40, 130, 9, 77)]
    params = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
    return [r.output_ids for r in engine.generate(input_ids=prompts, sampling_params=params)]


def test_nccl_group_of_one_with_cuda_graphs(tmp_path):
    import torch.distributed as dist

    from kvflow.runtime.distributed import init_tp_group
    from kvflow.runtime.engine import Engine

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    settings = dict(
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        device="cuda",
        max_running_requests=16,
        cuda_graph_max_bs=16,
        max_total_tokens=8192,
    )
    plain = Engine(str(tmp_path / "config.json"), **settings)
    expected = _greedy(plain)
    del plain
    gc.collect()
    torch.cuda.empty_cache()
    group = init_tp_group(0, 1, f"127.0.0.1:{_free_port()}", "cuda:0")
    try:
        assert dist.get_backend(group.device_group) == "nccl"
        engine = Engine(str(tmp_path / "config.json"), tp=group, **settings)
        assert engine.runner.graph_runner is not None, "the decode step must run as a graph"
        assert _greedy(engine) == expected
        assert engine.is_memory_free()
    finally:
        dist.destroy_process_group()
