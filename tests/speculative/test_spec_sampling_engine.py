"""End to end, seeded sampling through the verify step follows the target's distribution:
many seeded requests on a tiny random model with a small vocabulary, with and without
speculation, give the same token frequencies (a two-sample chi-square bound) at the
positions the verify step decides. The temperature is low so that the random model's
distributions are peaked: with STANDALONE drafting the target's own argmax, a rule that
keeps drafts twice as often as it should fails here (checked by hand)."""

from __future__ import annotations

import json

import pytest
import torch

DRAWS = 500
VOCAB = 12


def _counts(engine, prompt: list[int]) -> torch.Tensor:
    params = [
        {"temperature": 0.05, "max_new_tokens": 4, "seed": seed, "ignore_eos": True}
        for seed in range(DRAWS)
    ]
    results = engine.generate(input_ids=[prompt] * DRAWS, sampling_params=params)
    counts = torch.zeros(3, VOCAB)
    for result in results:
        for position, token in enumerate(result.output_ids[1:]):  # [0]: the prefill's
            counts[position, token] += 1
    return counts


def _two_sample_chi2(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    stat = float(((a - b) ** 2 / (a + b)).sum())  # equal sample sizes
    return stat, int(keep.sum()) - 1


@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE", "EAGLE", "EAGLE-tree"])
def test_sampled_tokens_follow_the_target_distribution(
    tmp_path, tiny_engine, eagle_head_writer, algorithm
):
    config = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": VOCAB, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
    }  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    prompt = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2]  # NGRAM drafts "3 1 2 ..." every step
    plain = _counts(tiny_engine(str(path), max_running_requests=256), prompt)
    # STANDALONE with the target's own weights drafts its argmax: often kept, so a rule
    # that kept drafts too often would pile up on it
    drafter: dict[str, object] = {"speculative_num_draft_tokens": 4}
    if algorithm == "STANDALONE":
        drafter = {"speculative_draft_model_path": str(path), "speculative_num_steps": 3}
    elif algorithm.startswith("EAGLE"):  # a random head on the small vocabulary: sometimes right
        head = eagle_head_writer(
            tmp_path / "head", num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=64
        )
        drafter = {"speculative_draft_model_path": head, "speculative_num_steps": 3}
        if algorithm == "EAGLE-tree":  # the tree rule: several children of a node tried
            drafter.update(speculative_eagle_topk=3, speculative_num_draft_tokens=8)
    spec_engine = tiny_engine(
        str(path),
        max_running_requests=256,
        speculative_algorithm=algorithm.removesuffix("-tree"),
        **drafter,
    )
    spec = _counts(spec_engine, prompt)
    worker = spec_engine.scheduler.spec
    assert worker.accepted_tokens > 0 and worker.accepted_tokens < worker.drafted_tokens
    for position in range(3):
        stat, dof = _two_sample_chi2(plain[position], spec[position])
        # chi-square 0.999 quantile for up to 11 degrees of freedom is 31.3
        assert stat < 31.3, (position, stat, dof, plain[position], spec[position])
    assert spec_engine.is_memory_free()
