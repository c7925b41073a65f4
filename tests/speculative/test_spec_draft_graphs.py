"""Draft steps in CUDA graphs, the parts that run without CUDA: a draft step's forwards
after its first are decode batches (one token per request, or per frontier node of an
EAGLE tree; an EAGLE head's carry its own outputs as features), the graph runner's static
buffers (rows, padding, an EAGLE head's features) feed the drafters what an eager forward
would, trees included (a frontier larger than the graphs runs eagerly), and graphs stay
off on CPU.
The captures themselves run in tests/gpu/test_gpu_spec.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_spec_eagle import _record_drafts

from kvflow.runtime.cuda_graph import CudaGraphRunner, FeatureInput
from kvflow.runtime.forward_batch import ForwardBatch, ForwardMode
from kvflow.runtime.speculative.batch import build_decode_batch
from kvflow.runtime.speculative.draft_graphs import capture_draft_graphs

PROMPTS = [[(5 * i + j % (3 + i)) % 90 for j in range(3 + 9 * i)] for i in range(3)]
PARAMS = {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True}


class _NoMetadata:
    """A graph attention without buffers (the stand-in builds its metadata per batch)."""

    def init_capture(self, max_bs: int) -> None:
        return None

    def fill_replay(self, fb: ForwardBatch, padded_bs: int) -> None:
        return None


class _EagerReplay(CudaGraphRunner):
    """The graph runner's buffers without CUDA: a replay stages the batch as on CUDA, then
    runs the captured step eagerly on the static batch of the padded size (padding rows
    included) into an output that the next replay of that size overwrites, as a graph's."""

    def __init__(self, step, runner, max_bs: int, features: FeatureInput | None = None):
        super().__init__(step, _NoMetadata(), runner.device, max_bs, features=features)
        self.runner = runner

    def capture(self) -> None:
        raise AssertionError("nothing is captured on CPU")

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        self.stage(fb)
        padded = self._padded(fb.batch_size)
        static = self._static_batch(padded)
        static.seq_lens_cpu = static.seq_lens.tolist()  # (CPU backends read them)
        self.runner.attn.init_forward_metadata(static)
        out = self.run_model(static)
        kept = self.outputs.setdefault(padded, torch.empty_like(out))
        kept.copy_(out)
        self.replays += 1
        return kept[: fb.batch_size]


def _spec(tiny_models, eagle_heads, name: str) -> dict:
    path = {
        "standalone": tiny_models["target"],
        "eagle": eagle_heads["random"],
        "eagle3": eagle_heads["eagle3"],
    }[name]
    algorithm = {"standalone": "STANDALONE", "eagle": "EAGLE", "eagle3": "EAGLE3"}[name]
    return dict(
        speculative_algorithm=algorithm,
        speculative_draft_model_path=path,
        speculative_num_steps=4,
    )


def _record_forwards(drafter) -> list[list[ForwardBatch]]:
    """The draft runner's batches, one list per propose call."""
    runner = drafter.runner
    name = "forward" if type(drafter).__name__ == "StandaloneDrafter" else "forward_hidden"
    forward, propose = getattr(runner, name), drafter.propose
    calls: list[list[ForwardBatch]] = []

    def spy_forward(fb):
        calls[-1].append(fb)
        return forward(fb)

    def spy_propose(reqs, max_drafts):
        calls.append([])
        return propose(reqs, max_drafts)

    setattr(runner, name, spy_forward)
    drafter.propose = spy_propose
    return calls


@pytest.mark.parametrize("name", ["standalone", "eagle", "eagle3"])
def test_draft_steps_after_the_first_are_decode_batches(
    tiny_models, tiny_engine, eagle_heads, name
):
    engine = tiny_engine(tiny_models["target"], **_spec(tiny_models, eagle_heads, name))
    drafter = engine.scheduler.spec.drafter
    assert drafter.graphs is None  # CPU: eager
    calls = _record_forwards(drafter)
    engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)
    decode = [fb for call in calls for fb in call[1:]]
    assert len(decode) > 10
    for fb in decode:
        assert fb.is_decode and len(fb.input_ids) == fb.batch_size
        assert fb.seq_lens_cpu == [p + 1 for p in fb.positions.tolist()]
        if name != "standalone":  # the head's own outputs: its hidden width
            assert fb.input_hidden is not None and fb.input_hidden.shape == (fb.batch_size, 64)
    assert engine.is_memory_free()


@pytest.mark.parametrize("name", ["standalone", "eagle", "eagle3"])
def test_graph_buffers_draft_what_eager_drafts(tiny_models, tiny_engine, eagle_heads, name):
    # the same engine drafts eagerly, then through the stand-in's static buffers (padded to
    # 4 or 8 rows: 3 requests, max_bs 8): the same drafts, the same greedy tokens
    engine = tiny_engine(tiny_models["target"], **_spec(tiny_models, eagle_heads, name))
    drafter = engine.scheduler.spec.drafter
    proposed = _record_drafts(engine)
    want = engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)
    eager_drafts = proposed[:]
    proposed.clear()
    if name == "standalone":
        graphs = _EagerReplay(drafter._greedy_ids, drafter.runner, 8)
    else:
        own = FeatureInput(64, drafter.runner.dtype)
        graphs = _EagerReplay(drafter.runner.run_hidden, drafter.runner, 8, own)
    drafter.graphs = graphs
    assert engine.flush_cache()
    got = engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert graphs.replays > 0
    assert proposed == eager_drafts
    if name == "standalone":  # the target's own weights: every draft is right
        worker = engine.scheduler.spec
        assert worker.accepted_tokens == worker.drafted_tokens > 0
    assert engine.is_memory_free()


def _tree_spec(eagle_heads, head: str, topk: int) -> dict:
    algorithm = "EAGLE3" if head.startswith("eagle3") else "EAGLE"
    return dict(
        speculative_algorithm=algorithm,
        speculative_draft_model_path=eagle_heads[head],
        speculative_eagle_topk=topk,
        speculative_num_steps=3,
        speculative_num_draft_tokens=6,
    )


def _record_trees_and_forwards(drafter) -> tuple[list, list[ForwardBatch]]:
    """Every tree the drafter makes, and the head's eager forwards."""
    trees: list = []
    forwards: list[ForwardBatch] = []
    propose_trees, forward = drafter.propose_trees, drafter.runner.forward_hidden

    def spy_trees(reqs, max_depths):
        made = propose_trees(reqs, max_depths)
        trees.extend(made)
        return made

    def spy_forward(fb):
        forwards.append(fb)
        return forward(fb)

    drafter.propose_trees, drafter.runner.forward_hidden = spy_trees, spy_forward
    return trees, forwards


@pytest.mark.parametrize("head,topk", [("random", 2), ("eagle3", 4)])
def test_tree_frontiers_are_decode_batches_and_replay_what_eager_drafts(
    tiny_models, tiny_engine, eagle_heads, head, topk
):
    # a frontier runs one token per node, each in its own spare row (seq_len: position + 1),
    # with the head's own outputs as features; the same engine then drafts through the
    # stand-in's buffers (8 rows: three requests' frontiers of topk 2 fit, of topk 4 not,
    # and those run eagerly until one request is done): the same trees, the same greedy
    # tokens, nothing leaked
    params = [{**PARAMS, "max_new_tokens": n} for n in (20, 14, 8)]
    engine = tiny_engine(tiny_models["target"], **_tree_spec(eagle_heads, head, topk))
    drafter = engine.scheduler.spec.drafter
    assert drafter.graphs is None  # CPU: eager
    trees, forwards = _record_trees_and_forwards(drafter)
    want = engine.generate(input_ids=PROMPTS, sampling_params=params)
    rows = drafter.runner.req_to_token.size  # spare rows come after the requests' rows
    frontiers = [fb for fb in forwards if int(fb.req_pool_indices.min()) >= rows]
    assert len(frontiers) > 10
    for fb in frontiers:
        assert fb.is_decode and len(fb.input_ids) == fb.batch_size
        assert fb.input_hidden is not None and fb.input_hidden.shape == (fb.batch_size, 64)
        assert fb.seq_lens_cpu == [p + 1 for p in fb.positions.tolist()]
    assert any(fb.batch_size > 3 for fb in frontiers)  # several nodes of one request
    eager_trees = trees[:]
    trees.clear()
    graphs = _EagerReplay(
        drafter.runner.run_hidden, drafter.runner, 8, FeatureInput(64, drafter.runner.dtype)
    )
    drafter.graphs = graphs
    forwards.clear()
    assert engine.flush_cache()
    got = engine.generate(input_ids=PROMPTS, sampling_params=params)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert trees == eager_trees
    assert graphs.replays > 0
    if topk == 4:  # frontiers of 12 rows ran eagerly, as decode batches
        assert any(fb.is_decode and fb.batch_size > 8 for fb in forwards)
    assert engine.is_memory_free()


def test_graph_runner_inputs_and_features():
    runner = CudaGraphRunner(
        lambda fb: fb.input_ids, _NoMetadata(), "cpu", 8, features=FeatureInput(4, torch.float32)
    )
    assert runner.sizes == [1, 2, 4, 8]
    loc = torch.tensor([11, 12, 13])
    fb = build_decode_batch([5, 6, 7], [20, 30, 40], [1, 2, 3], loc, "cpu")
    assert not runner.can_run(fb)  # no features
    fb.input_hidden = torch.ones(3, 5)
    assert not runner.can_run(fb)  # another width (EAGLE-3's catch-up: three layers)
    fb.input_hidden = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert runner.can_run(fb)
    runner.stage(fb)
    assert runner.inputs[:, :4].tolist() == [
        [1, 2, 3, 0],  # input_ids
        [20, 30, 40, 0],  # positions
        [11, 12, 13, 0],  # out_cache_loc: the padding row writes slot 0
        [5, 6, 7, 0],  # req_pool_indices
        [21, 31, 41, 1],  # seq_lens
    ]
    assert runner.features is not None and torch.equal(runner.features[:3], fb.input_hidden)
    extend = dataclasses.replace(fb, mode=ForwardMode.EXTEND)
    assert not runner.can_run(extend)
    wide = build_decode_batch(list(range(9)), [1] * 9, [0] * 9, torch.zeros(9), "cpu")
    wide.input_hidden = torch.zeros(9, 4)
    assert not runner.can_run(wide)  # more rows than captured


def test_no_draft_graphs_on_cpu_or_when_disabled(tiny_models, tiny_engine):
    engine = tiny_engine(
        tiny_models["target"],
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=tiny_models["shallow"],
    )
    drafter = engine.scheduler.spec.drafter
    config = engine.scheduler.config
    assert config.disable_cuda_graph  # resolved on CPU
    assert capture_draft_graphs(config, drafter.runner, engine.runner, drafter._greedy_ids) is None
    on_cuda = dataclasses.replace(config, disable_cuda_graph=False)
    # a CPU draft runner: still none, whatever the config says
    assert capture_draft_graphs(on_cuda, drafter.runner, engine.runner, drafter._greedy_ids) is None
