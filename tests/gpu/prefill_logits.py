"""One prompt's prefill through a bare :class:`ModelRunner` (no scheduler), and the bf16
comparison the real-shape GPU tests make: kvflow's last-position logits against a float32
transformers reference, as close as transformers' own bf16 logits are."""

from __future__ import annotations

import torch


def transformers_logits(hf, ids: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``hf``'s last-position logits in float32 (the reference), then in bf16 (``hf`` is
    left cast to bf16); ``kwargs`` go to its forward."""
    with torch.no_grad():
        reference = hf(ids[None], **kwargs).logits[0, -1].float()
        hf.to(torch.bfloat16)
        return reference, hf(ids[None], **kwargs).logits[0, -1].float()


def bf16_runner(model_path: str, load_format: str = "auto", max_total_tokens: int = 4096):
    """A bare bf16 :class:`ModelRunner` on CUDA, without CUDA graphs."""
    from kvflow.runtime.config import EngineConfig
    from kvflow.runtime.model_runner import ModelRunner

    config = EngineConfig(
        model_path=model_path,
        load_format=load_format,
        dtype="bfloat16",
        device="cuda",
        max_total_tokens=max_total_tokens,
        max_running_requests=4,
        disable_cuda_graph=True,
        skip_tokenizer_init=True,
    )
    return ModelRunner(config.resolved())


def last_logits(runner, ids: torch.Tensor) -> torch.Tensor:
    """The float32 logits of the last position of ``ids`` (one request, no cached prefix)."""
    from kvflow.runtime.forward_batch import ForwardBatch, ForwardMode

    length, device = ids.numel(), ids.device
    row = runner.req_to_token.alloc()
    slots = torch.tensor(runner.allocator.alloc_for_request(0, 0, length), device=device)
    runner.req_to_token.write(row, 0, slots)
    fb = ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=ids,
        positions=torch.arange(length, device=device),
        out_cache_loc=slots,
        req_pool_indices=torch.tensor([row], device=device),
        seq_lens=torch.tensor([length], device=device),
        seq_lens_cpu=[length],
        extend_prefix_lens_cpu=[0],
        extend_seq_lens_cpu=[length],
    )
    return runner.forward(fb)[0].float()


def assert_as_close_as_transformers(
    name: str, ours: torch.Tensor, hf_bf16: torch.Tensor, reference: torch.Tensor
) -> None:
    """kvflow's error against the float32 ``reference`` is at most 1.5x transformers' bf16
    error, in its maximum and its mean."""
    hf_err, our_err = (hf_bf16 - reference).abs(), (ours - reference).abs()
    print(
        f"{name}: max |err| kvflow {our_err.max():.4f} transformers-bf16 {hf_err.max():.4f}; "
        f"mean {our_err.mean():.5f} vs {hf_err.mean():.5f}"
    )
    assert our_err.max() <= 1.5 * hf_err.max() and our_err.mean() <= 1.5 * hf_err.mean()
