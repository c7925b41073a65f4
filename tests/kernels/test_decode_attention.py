"""decode_attention_fwd against decode_attention_ref: GQA, ragged lengths, paged slots."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import ATTENTION_TOLERANCE, device_for, indptr, paged_slots

from kvflow.kernels import decode_attention_fwd, decode_attention_ref


def _run_case(device, dtype, num_kv_heads, group, head_dim, lengths, page_size, splits):
    gen = torch.Generator().manual_seed(sum(lengths) * 31 + group * 7 + head_dim)
    num_q_heads = num_kv_heads * group
    num_slots = (sum(-(-n // page_size) for n in lengths) + 8) * page_size
    k_buffer = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_buffer = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(len(lengths), num_q_heads, head_dim, generator=gen).to(dtype)
    kv_indptr = indptr(lengths)
    kv_indices = paged_slots(lengths, page_size, num_slots, gen)
    scale = head_dim**-0.5
    expected = decode_attention_ref(q, k_buffer, v_buffer, kv_indptr, kv_indices, scale)

    args = [t.to(device) for t in (q, k_buffer, v_buffer)]
    out = torch.full_like(args[0], float("nan"))
    decode_attention_fwd(
        *args, out, kv_indptr.to(device), kv_indices.to(device), scale, num_kv_splits=splits
    )
    torch.testing.assert_close(out.cpu(), expected, **ATTENTION_TOLERANCE[dtype])


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# (dtype, num_kv_heads, group, head_dim, lengths, page_size, num_kv_splits); interpreted
# kernels use 16-token tiles and splits of at least 16 tokens, so these cross both.
INTERPRET_CASES = [
    (BF16, 2, 1, 64, [1, 37, 150], 1, None),
    (FP32, 2, 1, 64, [1, 37, 150], 1, None),
    (BF16, 2, 4, 64, [70, 3, 129], 16, 4),
    (FP16, 2, 4, 64, [70, 3, 129], 16, 4),
    (BF16, 1, 8, 32, [200], 8, 16),
    (FP32, 1, 8, 32, [200], 8, 16),
    (BF16, 2, 4, 80, [5, 40], 4, 1),  # head_dim not a power of two
    (FP16, 1, 32, 16, [33, 0, 18], 1, 2),  # group wider than one 16-row tile; empty request
]


@pytest.mark.interpret
@pytest.mark.parametrize("case", INTERPRET_CASES)
def test_decode_attention_interpret(case):
    _run_case(device_for("interpret"), *case)


GPU_CASES = [
    (8, 4, 128, [1024] * 4, 16, None),
    (8, 4, 128, [1, 17, 64, 65, 1000, 3000, 7], 1, None),
    (4, 1, 128, [300, 2048, 5], 64, None),
    (2, 8, 64, [4096, 1, 513], 16, 16),
    (8, 1, 64, [129, 257], 1, 1),
    (1, 8, 128, [777] * 9, 32, 3),
    (2, 4, 96, [100, 900], 8, None),
    (1, 32, 64, [321, 0, 12], 1, 8),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", GPU_CASES)
def test_decode_attention_gpu(dtype, case):
    _run_case(device_for("gpu"), dtype, *case)


@pytest.mark.gpu
def test_decode_attention_cuda_graph_replay():
    """Captured once, replayed after the KV indices and lengths change in place."""
    gen = torch.Generator().manual_seed(0)
    batch, kv_heads, group, head_dim, num_slots, max_tokens = 4, 8, 4, 128, 8192, 4096
    k_buffer = torch.randn(num_slots, kv_heads, head_dim, generator=gen).bfloat16().cuda()
    v_buffer = torch.randn(num_slots, kv_heads, head_dim, generator=gen).bfloat16().cuda()
    q = torch.randn(batch, kv_heads * group, head_dim, generator=gen).bfloat16().cuda()
    out = torch.empty_like(q)
    kv_indptr = torch.zeros(batch + 1, dtype=torch.int32, device="cuda")
    kv_indices = torch.zeros(max_tokens, dtype=torch.int32, device="cuda")

    def load(lengths):
        kv_indptr.copy_(indptr(lengths))
        slots = paged_slots(lengths, 16, num_slots, gen)
        kv_indices[: slots.numel()].copy_(slots)

    def call():
        decode_attention_fwd(q, k_buffer, v_buffer, out, kv_indptr, kv_indices, 0.125)

    load([10, 20, 30, 40])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # warm-up compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for lengths in ([1, 1000, 5, 2000], [999, 998, 1, 1]):
        load(lengths)
        graph.replay()
        expected = decode_attention_ref(q, k_buffer, v_buffer, kv_indptr, kv_indices, 0.125)
        torch.testing.assert_close(out, expected, **ATTENTION_TOLERANCE[torch.bfloat16])


def test_decode_attention_ref_matches_sdpa():
    """The reference itself against torch's SDPA on gathered, contiguous KV (CPU)."""
    gen = torch.Generator().manual_seed(1)
    lengths, kv_heads, group, head_dim = [5, 33], 2, 4, 32
    k_buffer = torch.randn(128, kv_heads, head_dim, generator=gen)
    v_buffer = torch.randn(128, kv_heads, head_dim, generator=gen)
    q = torch.randn(len(lengths), kv_heads * group, head_dim, generator=gen)
    kv_indptr, kv_indices = indptr(lengths), paged_slots(lengths, 4, 128, gen)
    out = decode_attention_ref(q, k_buffer, v_buffer, kv_indptr, kv_indices, 0.3)
    bounds = kv_indptr.tolist()
    for req in range(len(lengths)):
        slots = kv_indices[bounds[req] : bounds[req + 1]].long()
        keys = k_buffer[slots].transpose(0, 1)  # [kv_heads, len, d]
        values = v_buffer[slots].transpose(0, 1)
        expected = F.scaled_dot_product_attention(
            q[req][:, None], keys, values, scale=0.3, enable_gqa=True
        )
        torch.testing.assert_close(out[req], expected[:, 0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "marker",
    [
        pytest.param("interpret", marks=pytest.mark.interpret),
        pytest.param("gpu", marks=pytest.mark.gpu),
    ],
)
def test_decode_attention_preallocated_scratch(marker):
    """Oversized caller-owned scratch (as a CUDA-graph runner keeps) gives the same result."""
    device, gen = device_for(marker), torch.Generator().manual_seed(5)
    lengths, kv_heads, group, head_dim = [40, 7], 2, 4, 64
    k_buffer = torch.randn(64, kv_heads, head_dim, generator=gen).to(device)
    v_buffer = torch.randn(64, kv_heads, head_dim, generator=gen).to(device)
    q = torch.randn(2, kv_heads * group, head_dim, generator=gen).to(device)
    kv_indptr, kv_indices = indptr(lengths).to(device), paged_slots(lengths, 1, 64, gen).to(device)
    partial_o = torch.empty(8, kv_heads * group, 16, head_dim, device=device)
    partial_lse = torch.empty(8, kv_heads * group, 16, device=device)
    out = torch.empty_like(q)
    decode_attention_fwd(
        q, k_buffer, v_buffer, out, kv_indptr, kv_indices, 0.1, 3,
        partial_o=partial_o, partial_lse=partial_lse,
    )  # fmt: skip
    expected = decode_attention_ref(q, k_buffer, v_buffer, kv_indptr, kv_indices, 0.1)
    torch.testing.assert_close(out, expected, **ATTENTION_TOLERANCE[torch.float32])
    with pytest.raises(ValueError, match="fewer than 4 splits"):
        decode_attention_fwd(
            q, k_buffer, v_buffer, out, kv_indptr, kv_indices, 0.1, 4,
            partial_o=partial_o[:, :, :3], partial_lse=partial_lse,
        )  # fmt: skip
