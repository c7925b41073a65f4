"""KV memory in its own process, reachable through the Mooncake transport (for the tests).

Default: real ``KVPool``s (float32, bfloat16, FP8) in SmolLM2's shape. ``--bare``: the
float32 pool's layout over plain ``ctypes`` buffers, without importing torch (which takes
seconds on a busy machine), for peers that only need to be reachable or dead.

Prints one JSON line ``{"session_id", "layouts": {dtype: layout}}``, then serves stdin:
``dump DTYPE PATH`` saves that pool's K and V buffers (``torch.save``) and answers ``ok``;
EOF exits.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys

from kv_helpers import model_config

from kvflow.runtime.disagg import KV_TRANSPORTS, KVLayout, model_fingerprint

DTYPES = ("float32", "bfloat16", "float8_e4m3fn")  # the last: an FP8 KV cache


def bare_layout(num_slots: int, keep: list) -> KVLayout:
    config = model_config()
    slot_bytes = config.num_kv_heads * config.head_dim * 4
    buffers = [
        ctypes.create_string_buffer(num_slots * slot_bytes) for _ in range(2 * config.num_layers)
    ]
    keep.extend(buffers)
    addrs = [ctypes.addressof(b) for b in buffers]
    return KVLayout(
        model=model_fingerprint(config),
        dtype="float32",
        page_size=1,
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        slot_bytes=slot_bytes,
        k_addrs=tuple(addrs[0::2]),
        v_addrs=tuple(addrs[1::2]),
        num_slots=num_slots,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-slots", type=int, default=64)
    parser.add_argument("--bare", action="store_true")
    args = parser.parse_args()

    keep: list = []
    pools = {}
    if args.bare:
        layouts = {"float32": bare_layout(args.num_slots, keep)}
    else:
        import torch
        from kv_helpers import kv_pool

        from kvflow.runtime.disagg import layout_of

        config = model_config()
        pools = {d: kv_pool(config, args.num_slots, getattr(torch, d)) for d in DTYPES}
        layouts = {d: layout_of(pool, config, page_size=1) for d, pool in pools.items()}
    transport = KV_TRANSPORTS.get("mooncake")()
    for layout in layouts.values():
        for region in layout.regions():
            transport.register(region.ptr, region.nbytes)
    info = {
        "session_id": transport.session_id,
        "layouts": {dtype: layout.to_dict() for dtype, layout in layouts.items()},
    }
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        command, dtype, path = [*line.split(), "", ""][:3]
        if command == "dump":
            import torch

            torch.save({"k": pools[dtype].k_buffer, "v": pools[dtype].v_buffer}, path)
            print("ok", flush=True)
    transport.close()


if __name__ == "__main__":
    main()
