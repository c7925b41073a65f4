"""Speculative decoding (SGLang's ``--speculative-*`` flags): drafters from a registry and
the verify step the scheduler runs in place of a decode step.

NGRAM drafts from the request's own tokens; STANDALONE from a smaller model of the same
tokenizer; EAGLE and EAGLE3 from a draft head over the target's hidden states. All draft
chains; EAGLE and EAGLE3 draft trees with ``--speculative-eagle-topk`` > 1
(:mod:`kvflow.runtime.speculative.eagle_tree`, page size 1 only). The verify step that
scores the drafts is the scheduler's (``kvflow.runtime.scheduler.verify``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvflow.runtime.speculative.base import Drafter, TreeDrafter
from kvflow.runtime.utils import Registry

if TYPE_CHECKING:
    from kvflow.runtime.config import EngineConfig

__all__ = ["DRAFTERS", "Drafter", "TreeDrafter", "check_speculative"]

# Each factory takes (config, target runner) and returns a Drafter.
DRAFTERS: Registry[Drafter] = Registry("speculative algorithm")
DRAFTERS.register("NGRAM", "kvflow.runtime.speculative.ngram:make_ngram_drafter")
DRAFTERS.register("STANDALONE", "kvflow.runtime.speculative.standalone:StandaloneDrafter")
DRAFTERS.register("EAGLE", "kvflow.runtime.speculative.eagle_tree:make_eagle_drafter")
DRAFTERS.register("EAGLE3", "kvflow.runtime.speculative.eagle_tree:make_eagle_drafter")

# algorithms that draft with a model of their own (--speculative-draft-model-path)
WITH_DRAFT_MODEL = ("EAGLE", "EAGLE3", "STANDALONE")


def check_speculative(config: EngineConfig, role: str = "unified") -> None:
    """Raise ValueError (one line) for a speculative setting kvflow does not run."""
    algorithm = config.speculative_algorithm
    if algorithm is None:
        given = [
            flag
            for flag, value in (
                ("--speculative-draft-model-path", config.speculative_draft_model_path),
                ("--speculative-num-steps", config.speculative_num_steps),
                ("--speculative-eagle-topk", config.speculative_eagle_topk),
                ("--speculative-num-draft-tokens", config.speculative_num_draft_tokens),
            )
            if value
        ]
        if given:
            raise ValueError(
                f"{', '.join(given)}: add --speculative-algorithm EAGLE|EAGLE3|NGRAM|STANDALONE"
            )
        return
    if algorithm not in DRAFTERS.choices():
        raise ValueError(
            f"--speculative-algorithm {algorithm}: choose from {', '.join(DRAFTERS.choices())}"
        )
    eagle = algorithm.startswith("EAGLE")
    refusals = [
        (config.tp_size > 1, "--tp-size > 1"),
        (config.dp_size > 1, "--dp-size > 1"),
        (config.enable_lora, "--enable-lora"),
        (config.is_embedding, "--is-embedding"),
        # NOTE: an EAGLE prefill drafts nothing either: it keeps the target's features and
        # sends them with the KV to its decode, whose head reads them (disagg/prefill.py)
        (
            role == "prefill" and not eagle,
            f"{algorithm} and --role prefill (the decode side speculates; a prefill takes "
            "the flags of EAGLE and EAGLE3 only, to send the features their heads read)",
        ),
    ]
    if eagle:  # the head reads the target's states of every position
        refusals.append(
            (
                config.hicache_host_memory_gb > 0,
                f"{algorithm} and --hicache-host-memory-gb (the host tier keeps no hidden states)",
            )
        )
    for refused, what in refusals:
        if refused:
            raise ValueError(f"speculative decoding is not built with {what}")
    steps = config.speculative_num_steps
    draft_tokens = config.speculative_num_draft_tokens
    if steps < 0 or draft_tokens < 0 or draft_tokens == 1:
        raise ValueError(
            "--speculative-num-steps must be >= 1 and --speculative-num-draft-tokens >= 2"
        )
    if algorithm in WITH_DRAFT_MODEL and not config.speculative_draft_model_path:
        raise ValueError(
            f"--speculative-algorithm {algorithm} needs --speculative-draft-model-path"
        )
    if algorithm not in WITH_DRAFT_MODEL and config.speculative_draft_model_path:
        raise ValueError(f"--speculative-draft-model-path: {algorithm} uses no draft model")
    topk = config.speculative_eagle_topk
    if topk > 1:
        _check_tree(config, algorithm, topk)
    elif topk < 0:
        raise ValueError("--speculative-eagle-topk must be >= 1")
    elif algorithm in WITH_DRAFT_MODEL and steps and draft_tokens and draft_tokens != steps + 1:
        raise ValueError(
            f"{algorithm} drafts a chain: --speculative-num-draft-tokens must be "
            "--speculative-num-steps + 1 (or draft a tree: --speculative-eagle-topk > 1)"
        )


def _check_tree(config: EngineConfig, algorithm: str, topk: int) -> None:
    """Refusals of draft trees (``--speculative-eagle-topk`` > 1)."""
    if not algorithm.startswith("EAGLE"):
        raise ValueError(
            f"--speculative-eagle-topk {topk}: only EAGLE and EAGLE3 draft trees ({algorithm} "
            "drafts chains: 1)"
        )
    if config.page_size > 1:
        raise ValueError(
            f"--speculative-eagle-topk {topk} needs --page-size 1 (a tree's rejected "
            "branches give back single KV slots)"
        )
    steps = config.speculative_num_steps or 3
    draft_tokens = config.speculative_num_draft_tokens or steps + 1
    candidates = topk + (steps - 1) * topk * topk
    if draft_tokens - 1 > candidates:
        raise ValueError(
            f"--speculative-num-draft-tokens {draft_tokens}: a tree of {steps} steps of "
            f"top-{topk} has {candidates} draft tokens to choose from (at most {candidates + 1})"
        )
