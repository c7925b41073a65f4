"""Tree verification on the embedded model, with text: stop strings, EOS and max_tokens
cut-offs inside accepted paths, logprobs of every kept token. The EAGLE head (random, of
the model's shapes) drafts as usual; its trees are then replaced by trees that hold the
plain run's continuation on a second branch (a wrong first child), so that whole paths
off the tree's leading chain are accepted and cut where plain decoding stopped."""

from __future__ import annotations

import pytest

from kvflow.runtime.speculative.tree import DraftTree

CODE = "def area(width, height):\n    return width * height\n\nprint(area(3, 4))\n"
PROMPTS = [
    f"<|im_start|>user\nRepeat this code, renaming width to w:\n{CODE}<|im_end|>\n"
    "<|im_start|>assistant\n",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nCount from one to ten.<|im_end|>\n<|im_start|>assistant\n",
]
PARAMS = [
    {"temperature": 0, "max_new_tokens": 13},  # cut by max_tokens
    {"temperature": 0, "max_new_tokens": 24},  # ends on EOS
    {"temperature": 0, "max_new_tokens": 40, "stop": ["5. 5"]},  # a stop string
]


def _oracle_tree(continuation: list[int], max_depth: int, vocab: int) -> DraftTree:
    """Seven nodes: a wrong first child of the root (with a child of its own), then the
    right one, under it a wrong and the right child, and the right path on to depth 4::

        root ── w ── c1          tokens past the continuation are arbitrary (0, 1, ...)
            └── c0 ── x
                  └── c1 ── c2 ── c3
    """
    c = [*continuation, *range(5)][:4]
    tokens = [(c[0] + 1) % vocab, c[1], c[0], (c[1] + 1) % vocab, c[1], c[2], c[3]]
    parents = [-1, 0, -1, 2, 2, 4, 5]
    depths = DraftTree(tuple(tokens), tuple(parents)).depths()
    keep = [j for j, d in enumerate(depths) if d <= max_depth]  # preorder: a prefix per branch
    index = {j: n for n, j in enumerate(keep)}
    return DraftTree(
        tuple(tokens[j] for j in keep),
        tuple(-1 if parents[j] == -1 else index[parents[j]] for j in keep),
    )


@pytest.fixture(scope="module")
def tree_engine(model_path, tmp_path_factory, eagle_head_writer):
    import json

    from kvflow.runtime.engine import Engine

    raw = json.loads((model_path / "config.json").read_text())
    shapes = {
        k: raw[k]
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "max_position_embeddings",
            "rms_norm_eps",
        )
    }
    head = eagle_head_writer(tmp_path_factory.mktemp("smol-head"), **shapes)
    engine = Engine(
        str(model_path),
        dtype="float32",
        speculative_algorithm="EAGLE",
        speculative_draft_model_path=head,
        speculative_eagle_topk=2,
        speculative_num_steps=3,
        speculative_num_draft_tokens=8,
    )
    yield engine
    assert engine.is_memory_free()


def _plain_generate(engine, *args, **kwargs):
    sched = engine.scheduler
    spec, sched.spec = sched.spec, None
    try:
        return engine.generate(*args, **kwargs)
    finally:
        sched.spec = spec


def test_accepted_tree_paths_stop_where_plain_greedy_stops(tree_engine):
    engine = tree_engine
    want = _plain_generate(engine, PROMPTS, PARAMS, return_logprob=True, top_logprobs_num=2)
    assert engine.flush_cache()
    expected = {
        tuple(engine.encode(prompt)): result.output_ids
        for prompt, result in zip(PROMPTS, want, strict=True)
    }
    drafter = engine.scheduler.spec.drafter
    propose_trees = drafter.propose_trees
    vocab = engine.runner.vocab_size

    def oracle(reqs, max_depths):
        propose_trees(reqs, max_depths)  # the head drafts (and keeps its KV) as usual
        trees = []
        for req, depth in zip(reqs, max_depths, strict=True):
            made = expected[tuple(req.origin_input_ids)][len(req.output_ids) :]
            trees.append(_oracle_tree(made, depth, vocab) if depth else DraftTree())
        return trees

    drafter.propose_trees = oracle
    got = engine.generate(PROMPTS, PARAMS, return_logprob=True, top_logprobs_num=2)
    for have, plain in zip(got, want, strict=True):
        assert have.output_ids == plain.output_ids
        assert have.finish_reason == plain.finish_reason
        assert have.text == plain.text
        assert have.logprobs == pytest.approx(plain.logprobs, abs=1e-3)
        assert [[t for t, _ in top] for top in have.top_logprobs] == [
            [t for t, _ in top] for top in plain.top_logprobs
        ]
    assert [(r.finish_reason.type, r.finish_reason.matched) for r in got] == [
        ("length", None),
        ("stop", 2),  # EOS
        ("stop", "5. 5"),
    ]
    worker = engine.scheduler.spec
    assert worker.accept_length > 3.0  # whole paths of the second branch were kept
