"""One MoE layer's experts in a model's real shapes on the GPU (random bf16 weights), for
``bench_models.py``: the fused kernel's two paths (``kernels.fused_moe`` with
``small_batch`` True: a GEMV per (token, expert) pair, no sort; False: pairs sorted and
grouped GEMMs) and the per-expert loop (``fused_experts_ref``, the CPU path).

Each path is timed eagerly (Python launches included, as before) and inside a CUDA graph
(as the decode step runs it): the graph holds ``ROUTINGS`` calls, each on its own random
routing, so successive calls mostly read other experts (as a step's layers do) and the
active experts (75 MB a call for Qwen3-30B-A3B at batch 1) do not stay in L2. The HBM
fraction counts the distinct experts a call routes to, read once, over the graph time.
At batch 1 a few tile configurations of the small path are timed too (not yet swept).
"""

from __future__ import annotations

from functools import partial

import torch
from bench_gpu import peak_bw, time_cuda

ROUTINGS = 8
PATHS = {"small": True, "grouped": False}
SMALL_CONFIGS = (  # SmallBatchConfig fields: gate_up_n, gate_up_k, down_n, down_k, num_warps
    (2, 512, 2, 256, 4),
    (1, 1024, 1, 256, 4),
    (4, 256, 4, 128, 4),
    (2, 512, 1, 512, 4),
    (4, 512, 4, 256, 8),
    (1, 1024, 1, 512, 4),
    (1, 2048, 1, 256, 4),
    (1, 1024, 1, 256, 2),
    (1, 1024, 2, 256, 4),
    (1, 2048, 1, 512, 8),
    (2, 1024, 1, 256, 8),
    (1, 512, 1, 256, 4),
    (1, 1024, 1, 128, 4),
)


def _fp8_experts(w: torch.Tensor, block: tuple[int, int] | None):
    """``w`` ``[E, N, K]`` bf16 -> FP8 and the fused kernel's scales (per row, or per
    ``block``; N and K whole blocks)."""
    from kvflow.kernels import FP8_DTYPE, ExpertScales

    experts, n, k = w.shape
    if block is None:
        scale = w.float().abs().amax(-1).clamp(min=1e-12) / 448
        full = scale[..., None]
    else:
        tiles = w.float().view(experts, n // block[0], block[0], k // block[1], block[1])
        scale = tiles.abs().amax((2, 4)).clamp(min=1e-12) / 448
        full = scale.repeat_interleave(block[0], 1).repeat_interleave(block[1], 2)
    q = (w.float() / full).clamp(-448, 448).to(FP8_DTYPE)
    return q, ExpertScales(scale.contiguous(), block)


def time_in_graph(calls: list, iters: int = 50) -> float:
    """Seconds per call of the zero-argument ``calls``, captured in order in one CUDA graph
    and replayed ``iters`` times."""
    for call in calls:  # compile and warm outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters / len(calls)


def _paths(row: dict, prefix: str, routings: list, x, w13, w2, scales, active_bytes: float):
    """Eager and graph times of both paths into ``row``, HBM fraction of the graph time."""
    from kvflow import kernels

    for path, small in PATHS.items():
        calls = [
            partial(kernels.fused_moe, x, w13, w2, *topk, *scales, small_batch=small)
            for topk in routings
        ]
        graph_s = time_in_graph(calls)
        row[f"{prefix}{path}_eager_us"] = time_cuda(calls[0], 100, warmup=3) * 1e6
        row[f"{prefix}{path}_graph_us"] = graph_s * 1e6
        row[f"{prefix}{path}_hbm_fraction"] = active_bytes / graph_s / peak_bw()
    row[f"{prefix}small_speedup_in_graph"] = (
        row[f"{prefix}grouped_graph_us"] / row[f"{prefix}small_graph_us"]
    )


def _small_configs(routings: list, x, w13, w2) -> dict:
    """Graph time (us) of the small path per tile configuration of ``SMALL_CONFIGS``."""
    from kvflow.kernels import SmallBatchConfig, fused_moe_small_batch

    times: dict = {}
    for fields in SMALL_CONFIGS:
        config = SmallBatchConfig(*fields)
        calls = [partial(fused_moe_small_batch, x, w13, w2, *t, config=config) for t in routings]
        try:  # NOTE: one configuration that fails to compile must not cost the whole run
            times[str(fields)] = time_in_graph(calls) * 1e6
        except Exception as error:
            times[str(fields)] = f"failed: {type(error).__name__}: {str(error)[:200]}"
    return times


def bench_experts(
    model: str, batch_sizes=(1, 4, 8, 16, 32), iters: int = 200, fp8: bool = False
) -> list[dict]:
    """Rows per batch size: both fused paths (eager and in a graph, with ``fp8`` also on
    FP8 weights with per-row and 128x128 block scales), the loop, and at each batch the small path serves,
    its tile configurations in a graph."""
    from kvflow import kernels
    from kvflow.kernels import MOE_SMALL_BATCH_MAX_PAIRS
    from kvflow.runtime.config import DUMMY_CONFIGS, ModelConfig
    from kvflow.runtime.layers import fused_experts_ref, select_experts

    mc = ModelConfig.from_path(DUMMY_CONFIGS[model])
    experts, top_k = mc.num_experts, mc.num_experts_per_tok
    hidden, inter = mc.hidden_size, mc.moe_intermediate_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    w13 = torch.randn(experts, 2 * inter, hidden, device=dev, dtype=dt, generator=gen) * 0.02
    w2 = torch.randn(experts, hidden, inter, device=dev, dtype=dt, generator=gen) * 0.02
    expert_params = w13[0].numel() + w2[0].numel()
    fp8_weights = {}
    for name, block in (("fp8_row", None), ("fp8_block", (128, 128))) if fp8 else ():
        fp8_weights[name] = (*_fp8_experts(w13, block), *_fp8_experts(w2, block))
    rows = []
    for bs in batch_sizes:
        x = torch.randn(bs, hidden, device=dev, dtype=dt, generator=gen)
        routings = [
            select_experts(
                torch.randn(bs, experts, device=dev, generator=gen), top_k, bool(mc.norm_topk_prob)
            )
            for _ in range(ROUTINGS)
        ]
        distinct = sum(int(t.ids.unique().numel()) for t in routings) / ROUTINGS
        topk = routings[0]
        row: dict = {
            "batch": bs,
            "pairs": bs * top_k,
            "auto_path": "small" if bs * top_k <= MOE_SMALL_BATCH_MAX_PAIRS else "grouped",
            "experts_routed": distinct,
        }
        row["fused_us"] = time_cuda(
            partial(kernels.fused_moe, x, w13, w2, *topk), iters, warmup=3
        ) * 1e6  # fmt: skip
        loop_s = time_cuda(partial(fused_experts_ref, x, w13, w2, topk), 10, warmup=2)
        row["per_expert_loop_us"] = loop_s * 1e6
        _paths(row, "", routings, x, w13, w2, (), distinct * expert_params * 2)
        want = fused_experts_ref(x, w13, w2, topk).float()
        for path, small in PATHS.items():
            got = kernels.fused_moe(x, w13, w2, *topk, small_batch=small).float()
            row[f"{path}_max_abs_diff_vs_loop"] = float((got - want).abs().max())
        for name, (q13, s13, q2, s2) in fp8_weights.items():
            _paths(row, f"{name}_", routings, x, q13, q2, (s13, s2), distinct * expert_params)
            got = kernels.fused_moe(x, q13, q2, *topk, s13, s2, small_batch=True).float()
            row[f"{name}_small_max_abs_diff_vs_bf16_loop"] = float((got - want).abs().max())
        if bs * top_k <= MOE_SMALL_BATCH_MAX_PAIRS:
            times = _small_configs(routings, x, w13, w2)
            row["small_configs_graph_us"] = times
            row["small_configs_hbm_fraction"] = {
                fields: distinct * expert_params * 2 / (t * 1e-6) / peak_bw()
                for fields, t in times.items()
                if isinstance(t, float)
            }
        rows.append(row)
        print(f"experts batch {bs}:", {k: v for k, v in row.items() if "graph_us" in k})
    return rows
