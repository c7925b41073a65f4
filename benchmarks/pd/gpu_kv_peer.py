"""A decode's KV pool in its own process on a GPU, reachable through a KV transport, for the
same-host transfer test and benchmark (tests/gpu/test_gpu_kv_transfer.py,
benchmarks/bench_kv_transfer_gpu.py).

Prints one JSON line ``{"session_id", "layout", "peer_info"}``, then serves stdin:
``check SEED SRC_SLOTS DST_SLOTS`` (slots comma-separated) rebuilds the writer's pool from
``SEED`` (:func:`filled_pool`) and answers ``ok`` when every layer's K and V at
``DST_SLOTS`` equal the source at ``SRC_SLOTS``, else ``bad <why>``; EOF exits.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from kvflow.runtime.config import ModelConfig
from kvflow.runtime.disagg import layout_of
from kvflow.runtime.disagg.transport import KVTransferOptions
from kvflow.runtime.mem import KVPool

# Llama-3.1-8B's KV shape: 32 layers x 8 KV heads x 128 (bf16: 128 KiB per token)
LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
}


def model_config(layers: int = 32) -> ModelConfig:
    return ModelConfig.from_dict({**LLAMA_8B, "num_hidden_layers": layers})


def filled_pool(config: ModelConfig, num_slots: int, seed: int | None) -> KVPool:
    """A bf16 pool on the current GPU: zeros, or every buffer random from ``seed``."""
    pool = KVPool(
        num_slots, config.num_layers, config.num_kv_heads, config.head_dim, torch.bfloat16, "cuda"
    )
    if seed is not None:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        for buf in (*pool.k_buffer, *pool.v_buffer):
            buf.copy_(torch.randn(buf.shape, generator=gen, device="cuda"))
    return pool


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="cuda_ipc")
    parser.add_argument("--protocol", default="tcp")
    parser.add_argument("--num-slots", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=32)
    args = parser.parse_args()
    config = model_config(args.layers)
    pool = filled_pool(config, args.num_slots, seed=None)
    options = KVTransferOptions(backend=args.backend, protocol=args.protocol)
    options.require_env()
    transport = options.transport()
    layout = layout_of(pool, config, page_size=1)
    for buffer in (*pool.k_buffer, *pool.v_buffer):
        transport.register_buffer(buffer)
    info = {
        "session_id": transport.session_id,
        "layout": layout.to_dict(),
        "peer_info": transport.peer_info(),
    }
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        words = line.split()
        if len(words) != 4 or words[0] != "check":
            print(f"bad command {line.strip()!r}", flush=True)
            continue
        seed = int(words[1])
        src = torch.tensor([int(s) for s in words[2].split(",")], device="cuda")
        dst = torch.tensor([int(s) for s in words[3].split(",")], device="cuda")
        want = filled_pool(config, args.num_slots, seed)
        pairs = zip((*want.k_buffer, *want.v_buffer), (*pool.k_buffer, *pool.v_buffer), strict=True)
        bad = [i for i, (w, got) in enumerate(pairs) if not torch.equal(w[src], got[dst])]
        del want
        print("ok" if not bad else f"bad buffers {bad[:8]}", flush=True)
    transport.close()


if __name__ == "__main__":
    main()
