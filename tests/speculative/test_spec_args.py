"""``kvflow serve``'s --speculative-* flags: SGLang's names, and every combination kvflow
does not run refused at parse time with one line (exit 2)."""

from __future__ import annotations

import pytest
import torch

from kvflow.runtime.server.args import parse_args

EAGLE_HEAD = ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "/head"]
STANDALONE = ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "/m"]


def test_ngram_and_standalone_parse() -> None:
    args = parse_args(["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "6"])
    assert args.engine.speculative_algorithm == "NGRAM"
    assert args.engine.resolved().speculative_num_draft_tokens == 6
    args = parse_args(
        [
            "--speculative-algorithm",
            "STANDALONE",
            "--speculative-draft-model-path",
            "/m",
            "--speculative-num-steps",
            "2",
            "--speculative-eagle-topk",
            "1",
        ]
    )
    resolved = args.engine.resolved()
    assert (resolved.speculative_num_steps, resolved.speculative_num_draft_tokens) == (2, 3)


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_eagle_parses_with_sglangs_flags(algorithm) -> None:
    args = parse_args(
        [
            "--speculative-algorithm",
            algorithm,
            "--speculative-draft-model-path",
            "/head",
            "--speculative-num-steps",
            "5",
            "--speculative-eagle-topk",
            "1",
            "--speculative-num-draft-tokens",
            "6",
        ]
    )
    resolved = args.engine.resolved()
    assert resolved.speculative_algorithm == algorithm
    assert (resolved.speculative_num_steps, resolved.speculative_num_draft_tokens) == (5, 6)


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_eagle_trees_parse_with_sglangs_flags(algorithm) -> None:
    argv = ["--speculative-algorithm", algorithm, "--speculative-draft-model-path", "/head"]
    argv += ["--speculative-num-steps", "5", "--speculative-eagle-topk", "4"]
    args = parse_args([*argv, "--speculative-num-draft-tokens", "8", "--device", "cuda"])
    resolved = args.engine.resolved()
    assert resolved.speculative_eagle_topk == 4 and resolved.speculative_num_draft_tokens == 8
    assert resolved.page_size == 1  # auto: pages of one token under trees (16 on CUDA else)
    assert resolved.spec_tree_rows == resolved.max_running_requests * 7
    resolved = parse_args([*argv, "--page-size", "1"]).engine.resolved()
    assert resolved.speculative_num_draft_tokens == 6  # auto: num_steps + 1


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_eagle_parses_on_both_pd_roles(algorithm) -> None:
    """The decode drafts; the prefill, given the same flags, keeps the target's features for
    it and drafts nothing (no head, no draft memory, no spare rows for trees)."""
    from kvflow.runtime.disagg.prefill import PrefillRole
    from kvflow.runtime.models.draft_footprint import draft_footprint

    head = ["--speculative-algorithm", algorithm, "--speculative-draft-model-path", "/head"]
    tree = ["--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "4"]
    trusted = ["--disaggregation-trusted-prefills", "127.0.0.1:8998"]
    decode = parse_args([*head, *tree, "--role", "decode", *trusted]).engine.resolved()
    assert decode.speculative_algorithm == algorithm and decode.spec_tree_rows > 0
    prefill = parse_args([*head, *tree, "--role", "prefill"]).engine
    assert not prefill.speculative_features_only
    kept = PrefillRole.engine_config(prefill).resolved()
    assert kept.speculative_features_only and kept.speculative_algorithm == algorithm
    assert kept.spec_tree_rows == 0 and kept.page_size == decode.page_size == 1
    assert draft_footprint(kept, torch.float32, torch.float32) is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--speculative-algorithm", "EAGLE3"], "EAGLE3 needs --speculative-draft-model-path"),
        (["--speculative-algorithm", "EAGLE4"], "kvflow drafts with EAGLE, EAGLE3, NGRAM"),
        (["--speculative-algorithm", "EAGLE"], "EAGLE needs --speculative-draft-model-path"),
        (
            [
                "--speculative-algorithm",
                "EAGLE",
                "--speculative-draft-model-path",
                "/head",
                "--speculative-eagle-topk",
                "2",
                "--page-size",
                "4",
            ],
            "--speculative-eagle-topk 2 needs --page-size 1",
        ),
        (
            [
                *EAGLE_HEAD,
                "--speculative-eagle-topk",
                "2",
                "--speculative-num-steps",
                "2",
                "--speculative-num-draft-tokens",
                "8",
            ],
            "a tree of 2 steps of top-2 has 6 draft tokens to choose from (at most 7)",
        ),
        ([*EAGLE_HEAD, "--speculative-eagle-topk", "-1"], "--speculative-eagle-topk must be >= 1"),
        (
            [
                "--speculative-algorithm",
                "EAGLE",
                "--speculative-draft-model-path",
                "/head",
                "--speculative-num-steps",
                "3",
                "--speculative-num-draft-tokens",
                "8",
            ],
            "EAGLE drafts a chain",
        ),
        (
            [*EAGLE_HEAD, "--hicache-host-memory-gb", "4"],
            "EAGLE and --hicache-host-memory-gb",
        ),
        (["--speculative-algorithm", "NGRAM", "--tp-size", "2"], "not built with --tp-size > 1"),
        (["--speculative-algorithm", "NGRAM", "--dp-size", "2"], "not built with --dp-size > 1"),
        (
            [
                "--speculative-algorithm",
                "NGRAM",
                "--enable-lora",
                "--max-lora-rank",
                "8",
                "--lora-target-modules",
                "q_proj",
            ],
            "not built with --enable-lora",
        ),
        (["--speculative-algorithm", "NGRAM", "--role", "prefill"], "NGRAM and --role prefill"),
        (
            [*STANDALONE, "--role", "prefill"],
            "STANDALONE and --role prefill (the decode side speculates",
        ),
        (
            [*EAGLE_HEAD, "--role", "prefill", "--hicache-host-memory-gb", "4"],
            "EAGLE and --hicache-host-memory-gb",
        ),
        (["--speculative-algorithm", "STANDALONE"], "needs --speculative-draft-model-path"),
        (
            ["--speculative-algorithm", "NGRAM", "--speculative-eagle-topk", "4"],
            "only EAGLE and EAGLE3 draft trees (NGRAM drafts chains: 1)",
        ),
        (
            [
                "--speculative-algorithm",
                "STANDALONE",
                "--speculative-draft-model-path",
                "/m",
                "--speculative-eagle-topk",
                "2",
            ],
            "only EAGLE and EAGLE3 draft trees",
        ),
        (
            ["--speculative-algorithm", "NGRAM", "--speculative-draft-model-path", "/m"],
            "NGRAM uses no draft model",
        ),
        (["--speculative-num-steps", "3"], "add --speculative-algorithm"),
        (
            [
                "--speculative-algorithm",
                "STANDALONE",
                "--speculative-draft-model-path",
                "/m",
                "--speculative-num-steps",
                "3",
                "--speculative-num-draft-tokens",
                "8",
            ],
            "must be --speculative-num-steps + 1",
        ),
    ],
)
def test_refused_combinations_exit_2(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
