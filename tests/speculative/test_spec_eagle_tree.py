"""EAGLE and EAGLE3 draft trees (``--speculative-eagle-topk`` > 1): greedy output equals
plain greedy output token for token (random heads; a head that is always right, and one
whose right guess is always the second child, so the accepted path leaves the tree's
leading chain), the head's draft rows see their own branch only, and aborts, failures
mid-step and retraction give every KV slot and spare row back."""

from __future__ import annotations

import pytest
import torch

# the chain tests' prompt set: a stop token, EOS and max_tokens cut-offs
from test_spec_eagle import PROMPTS, _params

from kvflow.runtime.sampling import SamplingParams
from kvflow.runtime.scheduler import Req
from kvflow.runtime.speculative.tree import DraftTree
from kvflow.runtime.wire import GenerateRequest


def _tree(tiny_engine, target, head, algorithm="EAGLE", topk=2, steps=3, draft_tokens=6, **kw):
    return tiny_engine(
        target,
        speculative_algorithm=algorithm,
        speculative_draft_model_path=head,
        speculative_eagle_topk=topk,
        speculative_num_steps=steps,
        speculative_num_draft_tokens=draft_tokens,
        **kw,
    )


def _record_trees(engine) -> list[DraftTree]:
    drafter = engine.scheduler.spec.drafter
    trees: list[DraftTree] = []
    propose = drafter.propose_trees

    def spy(reqs, max_depths):
        made = propose(reqs, max_depths)
        for tree, depth in zip(made, max_depths, strict=True):
            assert len(tree) <= engine.scheduler.spec.max_drafts
            assert max(tree.depths(), default=0) <= depth
        trees.extend(made)
        return made

    drafter.propose_trees = spy
    return trees


# (head fixture name, algorithm, topk, num_steps, num_draft_tokens)
HEADS = [
    ("random", "EAGLE", 2, 3, 6),
    ("random", "EAGLE", 4, 3, 8),
    ("eagle3", "EAGLE3", 2, 4, 7),
    ("eagle3-full-vocab", "EAGLE3", 4, 2, 10),
]


def test_tree_drafts_equal_plain_greedy(tiny_models, tiny_engine, eagle_heads):
    target = tiny_models["target"]
    plain = tiny_engine(target)
    probe = plain.generate(input_ids=PROMPTS[1], sampling_params=_params(0)[0])
    stop_token = probe.output_ids[6]
    params = _params(stop_token)
    want = plain.generate(input_ids=PROMPTS, sampling_params=params)
    cut = [(len(r.output_ids), r.finish_reason.type) for r in want]
    assert cut[1] == (7, "stop") or cut[1][0] < 7
    assert cut[2][1] == "stop" and cut[2][0] < 17 and cut[0] == (30, "length")
    for name, algorithm, topk, steps, draft_tokens in HEADS:
        engine = _tree(tiny_engine, target, eagle_heads[name], algorithm, topk, steps, draft_tokens)
        trees = _record_trees(engine)
        for _ in range(2):  # the second round starts from cached prefixes
            got = engine.generate(input_ids=PROMPTS, sampling_params=params)
            assert [r.output_ids for r in got] == [r.output_ids for r in want], name
            assert [r.finish_reason for r in got] == [r.finish_reason for r in want], name
        assert any(t.chain_len() < len(t) for t in trees), name  # branched trees were run
        assert engine.scheduler.spec.drafted_tokens > 0
        assert engine.is_memory_free(), name


def _second_is_right(engine) -> None:
    """Make the head's first choice wrong and its second right (the echo head's own first
    choice), with scores that keep both subtrees in the tree."""
    head = engine.scheduler.spec.drafter.head
    draft_topk = head.draft_topk

    def swapped(hidden, k):
        _, ids = draft_topk(hidden, k)
        ids = ids.clone()
        ids[:, [0, 1]] = ids[:, [1, 0]]
        probs = torch.linspace(0.55, 0.3, k).expand(ids.shape[0], k).clone()
        return probs, ids

    head.draft_topk = swapped


@pytest.mark.parametrize(("topk", "second_right"), [(2, False), (4, False), (2, True), (4, True)])
def test_a_head_that_is_right_keeps_whole_paths(echo_models, tiny_engine, topk, second_right):
    target = echo_models["target"]
    params = _params(-1)[:1] * 2 + [{"temperature": 0, "max_new_tokens": 9, "stop_token_ids": [2]}]
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[3]]
    plain = tiny_engine(target, load_format="auto")
    want = plain.generate(input_ids=prompts, sampling_params=params)
    engine = _tree(
        tiny_engine, target, echo_models["head"], topk=topk, steps=3, draft_tokens=8,
        load_format="auto",
    )  # fmt: skip
    worker = engine.scheduler.spec
    off_chain = 0  # steps whose accepted path left the tree's leading chain
    keep_path = worker._keep_path

    def spy(req, tree, path):
        nonlocal off_chain
        off_chain += 1
        keep_path(req, tree, path)

    worker._keep_path = spy
    if second_right:
        _second_is_right(engine)
    trees = _record_trees(engine)
    got = engine.generate(input_ids=prompts, sampling_params=params)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
    assert any(t.chain_len() < len(t) for t in trees)
    if second_right:  # the right path scores lower: the tree holds less of it
        assert worker.accept_length > 1.5 and off_chain > 5
    else:
        assert worker.accept_length > 3.0 and off_chain == 0  # depth 3: 4 tokens a step
    assert engine.is_memory_free()


def test_head_rows_see_their_own_branch(tiny_models, tiny_engine, eagle_heads):
    # a depth-d node's head row holds the request's head KV, then its parent's path (the
    # row of a node of the step before), then its own slot: nothing of a sibling's
    engine = _tree(tiny_engine, tiny_models["target"], eagle_heads["random"], "EAGLE", 2, 4, 9)
    runner = engine.scheduler.spec.drafter.runner
    forward_hidden = runner.forward_hidden
    steps: list[list[tuple[int, ...]]] = []  # per head forward of spare rows: node paths

    def spy(fb):
        pool_rows = fb.req_pool_indices.tolist()
        if any(r < runner.req_to_token.size for r in pool_rows):
            steps.append([])  # a catch-up: a new draft step begins
        else:
            depth = len(steps[-1][0]) + 1 if steps[-1] else 1
            table = runner.req_to_token.req_to_token
            made = []
            for r, n, own in zip(
                pool_rows, fb.seq_lens_cpu, fb.out_cache_loc.tolist(), strict=True
            ):
                row = tuple(table[r, :n].tolist())
                path = row[n - depth :]
                assert path[-1] == own  # its own slot ends its row
                assert not set(row[: n - depth]) & set(path)  # the head KV, then the path
                made.append(path)
            if steps[-1]:
                assert all(path[:-1] in steps[-1] for path in made)  # a parent's path
            steps[-1] = made
        return forward_hidden(fb)

    runner.forward_hidden = spy
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    engine.generate(input_ids=PROMPTS[1:3], sampling_params=params)
    assert sum(1 for made in steps if made and len(made[0]) == 3) > 2  # depth 3 was run
    assert engine.is_memory_free()


def _specs(tiny_models, eagle_heads) -> dict[str, dict]:
    return {
        "eagle": {
            "speculative_algorithm": "EAGLE",
            "speculative_draft_model_path": eagle_heads["random"],
            "speculative_eagle_topk": 4,
            "speculative_num_steps": 3,
            "speculative_num_draft_tokens": 8,
        },
        "eagle3": {
            "speculative_algorithm": "EAGLE3",
            "speculative_draft_model_path": eagle_heads["eagle3"],
            "speculative_eagle_topk": 2,
            "speculative_num_steps": 3,
            "speculative_num_draft_tokens": 6,
        },
    }


def _reqs(prompts, params) -> list[Req]:
    return [
        Req(GenerateRequest(rid=f"r{i}", input_ids=ids, sampling=params))
        for i, ids in enumerate(prompts)
    ]


@pytest.mark.parametrize("algorithm", ["eagle", "eagle3"])
def test_abort_between_steps_leaks_nothing(tiny_models, tiny_engine, eagle_heads, algorithm):
    engine = tiny_engine(tiny_models["target"], **_specs(tiny_models, eagle_heads)[algorithm])
    sched = engine.scheduler
    reqs = _reqs(PROMPTS, SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True))
    for req in reqs:
        sched.add_request(req)
    steps = 0
    while sched.has_work():
        sched.step()
        steps += 1
        if steps == 3:
            assert sched.abort_request("r1") is not None
        if steps == 5:
            assert sched.abort_request("r3") is not None
    assert [r.finished_reason.type for r in reqs] == ["length", "abort", "length", "abort"]
    assert engine.is_memory_free()


@pytest.mark.parametrize("where", ["head-catch-up", "head-branch", "target"])
def test_a_step_failing_mid_tree_leaks_nothing(tiny_models, tiny_engine, eagle_heads, where):
    engine = tiny_engine(tiny_models["target"], **_specs(tiny_models, eagle_heads)["eagle"])
    sched = engine.scheduler
    sched.isolate_failures = True
    runner = sched.spec.drafter.runner if where.startswith("head") else sched.runner
    name = "forward_hidden" if where.startswith("head") else "forward"
    forward = getattr(runner, name)
    # the head runs 3 forwards a step (catch-up, depth 1, depth 2), the target 2 at first
    fail_at = {"head-catch-up": 7, "head-branch": 8, "target": 4}[where]
    calls = 0

    def failing(fb):
        nonlocal calls
        calls += 1
        if calls == fail_at:
            raise RuntimeError("injected")
        return forward(fb)

    setattr(runner, name, failing)
    reqs = _reqs(PROMPTS, SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True))
    for req in reqs:
        sched.add_request(req)
    while sched.has_work():
        sched.step()
    assert calls == fail_at
    assert all("injected" in r.finished_reason.message for r in reqs)
    assert engine.is_memory_free()


@pytest.mark.parametrize("algorithm", ["eagle", "eagle3"])
def test_retraction_keeps_greedy_tokens(tiny_models, tiny_engine, eagle_heads, algorithm):
    prompts = [[(3 * i + j % (2 + i)) % 90 for j in range(12 + 5 * i)] for i in range(4)]
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    plain = tiny_engine(tiny_models["target"])
    want = [r.output_ids for r in plain.generate(input_ids=prompts, sampling_params=params)]
    small = tiny_engine(
        tiny_models["target"], max_total_tokens=112, **_specs(tiny_models, eagle_heads)[algorithm]
    )
    got = small.generate(input_ids=prompts, sampling_params=params)
    assert [r.output_ids for r in got] == want
    assert small.scheduler.num_retractions > 0
    assert small.is_memory_free()


def test_seeded_sampling_with_trees_is_reproducible(tiny_models, tiny_engine, eagle_heads):
    engine = tiny_engine(tiny_models["target"], **_specs(tiny_models, eagle_heads)["eagle"])
    params = {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 20, "seed": 3, "ignore_eos": True}
    first = [r.output_ids for r in engine.generate(input_ids=PROMPTS, sampling_params=params)]
    again = [r.output_ids for r in engine.generate(input_ids=PROMPTS, sampling_params=params)]
    assert first == again and all(len(ids) == 20 for ids in first)
    assert engine.scheduler.spec.drafted_tokens > 0
    assert engine.is_memory_free()


@pytest.mark.parametrize(("name", "algorithm"), [("random", "EAGLE"), ("eagle3", "EAGLE3")])
def test_tree_branches_draft_what_the_chain_drafts(
    tiny_models, tiny_engine, eagle_heads, name, algorithm
):
    # a tree's branch that follows the chain's drafts sees the same ancestors as the
    # chain's forwards: its best child is the chain's next draft, scored by the product of
    # the chain's own draft probabilities (a wrong ancestor or a sibling in the row would
    # change the head's output, hence the score)
    import kvflow.runtime.speculative.eagle_tree as eagle_tree

    target, head = tiny_models["target"], eagle_heads[name]
    prompts = [PROMPTS[1], PROMPTS[2], PROMPTS[3]]
    chains: list[list[int]] = []
    best_probs: list[list[float]] = []  # per chain forward: each request's argmax probability
    engine = _tree(tiny_engine, target, head, algorithm, topk=1, steps=3, draft_tokens=4)
    drafter = engine.scheduler.spec.drafter
    propose, compute_logits = drafter.propose, drafter.head.compute_logits

    def spy(reqs, max_drafts):
        drafts = propose(reqs, max_drafts)
        if not chains:
            chains.extend(drafts)
        return drafts

    def logits_spy(hidden):
        logits = compute_logits(hidden)
        best_probs.append(torch.softmax(logits.float(), dim=-1).max(dim=-1).values.tolist())
        return logits

    drafter.propose, drafter.head.compute_logits = spy, logits_spy
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}  # 3 drafts at first
    engine.generate(input_ids=prompts, sampling_params=params)
    candidates: list[list] = []
    select = eagle_tree.select_tree

    def keep(cands, num_nodes):
        candidates.append(list(cands))
        return select(cands, num_nodes)

    tree_engine = _tree(tiny_engine, target, head, algorithm, topk=3, steps=3, draft_tokens=9)
    eagle_tree.select_tree = keep
    try:
        tree_engine.generate(input_ids=prompts, sampling_params=params)
    finally:
        eagle_tree.select_tree = select
    checked = 0
    for i, (chain, cands) in enumerate(zip(chains, candidates[: len(prompts)], strict=True)):
        assert len(chain) == 3
        follows, score = -1, 1.0  # the candidate whose path is the chain's prefix so far
        for step, draft in enumerate(chain):
            kids = [c for c, cand in enumerate(cands) if cand.parent == follows]
            if not kids:
                break  # that branch left the frontier: not expanded further
            best = max(kids, key=lambda c: cands[c].score)
            score *= best_probs[step][i]
            assert cands[best].token == draft
            assert cands[best].score == pytest.approx(score, rel=1e-4)
            checked += 1
            follows = best
    assert checked >= 2 * len(prompts)
    assert engine.is_memory_free() and tree_engine.is_memory_free()


def test_engines_refuse_what_trees_do_not_run(tiny_models, tiny_engine, eagle_heads):
    target, head = tiny_models["target"], eagle_heads["random"]
    with pytest.raises(ValueError, match="--speculative-eagle-topk 2 needs --page-size 1"):
        _tree(tiny_engine, target, head, page_size=4)
    with pytest.raises(ValueError, match="has 6 draft tokens to choose from"):
        _tree(tiny_engine, target, head, steps=2, draft_tokens=8)
    with pytest.raises(ValueError, match="only EAGLE and EAGLE3 draft trees"):
        tiny_engine(target, speculative_algorithm="NGRAM", speculative_eagle_topk=2)
