"""EAGLE and EAGLE3 (heads in SGLang's checkpoint formats, chain drafts): greedy output
equals plain greedy output token for token on a tiny random target, the head reads the
target's hidden states at the right positions (cached prefixes too), its incremental KV
matches a head that recomputes everything, EAGLE-3's draft vocabulary maps onto target
ids, and a head that does not fit is refused at start-up (the heads' math against
transformers references: test_spec_eagle_reference.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvflow.runtime.config import EngineConfig, ModelConfig
from kvflow.runtime.models import check_draft_model, resolve_model_path
from kvflow.runtime.sampling import SamplingParams
from kvflow.runtime.scheduler import Req
from kvflow.runtime.wire import GenerateRequest

PROMPTS = [[(5 * i + j % (3 + i)) % 90 for j in range(3 + 9 * i)] for i in range(4)]


def _params(stop_token: int) -> list[dict]:
    return [
        {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True},
        {
            "temperature": 0,
            "max_new_tokens": 25,
            "stop_token_ids": [stop_token],
            "ignore_eos": True,
        },
        {"temperature": 0, "max_new_tokens": 17},  # EOS (95) ends it
        {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True},
    ]


def _eagle(tiny_engine, target, head, algorithm="EAGLE", **kwargs):
    settings = {"speculative_num_steps": 3, **kwargs}
    return tiny_engine(
        target, speculative_algorithm=algorithm, speculative_draft_model_path=head, **settings
    )


# (head fixture name, algorithm, num_steps)
HEADS = [
    ("random", "EAGLE", 3),
    ("identity", "EAGLE", 2),
    ("eagle3", "EAGLE3", 3),
    ("eagle3-full-vocab", "EAGLE3", 4),
]


def _record_drafts(engine) -> list[list[list[int]]]:
    """Every propose call's drafts, in order (the drafter's own results)."""
    drafter = engine.scheduler.spec.drafter
    calls: list[list[list[int]]] = []
    propose = drafter.propose

    def spy(reqs, max_drafts):
        drafts = propose(reqs, max_drafts)
        calls.append([list(d) for d in drafts])
        return drafts

    drafter.propose = spy
    return calls


@pytest.mark.parametrize("page_size", [1, 4])
def test_eagle_equals_plain_greedy(tiny_models, tiny_engine, eagle_heads, page_size):
    target = tiny_models["target"]
    plain = tiny_engine(target, page_size=page_size)
    probe = plain.generate(input_ids=PROMPTS[1], sampling_params=_params(0)[0])
    stop_token = probe.output_ids[6]  # the second prompt stops by its seventh token
    params = _params(stop_token)
    want = plain.generate(input_ids=PROMPTS, sampling_params=params)
    cut = [(len(r.output_ids), r.finish_reason.type, r.finish_reason.matched) for r in want]
    assert cut[1][1:] == ("stop", stop_token) and cut[1][0] <= 7
    assert cut[2][1:] == ("stop", 95) and cut[2][0] < 17  # the random target's EOS
    assert cut[0] == (30, "length", None) and cut[3] == (1, "length", None)
    for name, algorithm, steps in HEADS:
        engine = _eagle(
            tiny_engine, target, eagle_heads[name], algorithm, page_size=page_size,
            speculative_num_steps=steps,
        )  # fmt: skip
        for _ in range(2):  # the second round starts from cached prefixes
            got = engine.generate(input_ids=PROMPTS, sampling_params=params)
            assert [r.output_ids for r in got] == [r.output_ids for r in want], name
            assert [r.finish_reason for r in got] == [r.finish_reason for r in want], name
        worker = engine.scheduler.spec
        assert worker.drafted_tokens > worker.accepted_tokens, name
        assert worker.accept_length >= 1.0, name  # SGLang's spec_accept_length
        assert engine.is_memory_free(), name


def test_identity_head_drafts_the_targets_choice(tiny_models, tiny_engine, eagle_heads):
    # the identity head's output is the target's hidden state at position L-2, whose
    # argmax under greedy decoding is the request's last token: every draft repeats it
    engine = _eagle(tiny_engine, tiny_models["target"], eagle_heads["identity"])
    drafter = engine.scheduler.spec.drafter
    propose = drafter.propose
    checked = 0

    def spy(reqs, max_drafts):
        nonlocal checked
        drafts = propose(reqs, max_drafts)
        for req, draft in zip(reqs, drafts, strict=True):
            assert draft == [req.all_token_ids()[-1]] * len(draft)
            checked += len(draft)
        return drafts

    drafter.propose = spy
    params = {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True}
    for _ in range(2):
        engine.generate(input_ids=PROMPTS, sampling_params=params)
    assert checked > 0
    assert engine.is_memory_free()


@pytest.mark.parametrize(("name", "algorithm"), [("random", "EAGLE"), ("eagle3", "EAGLE3")])
def test_incremental_head_kv_matches_a_fresh_head(
    tiny_models, tiny_engine, eagle_heads, name, algorithm
):
    # one head keeps its KV between steps; the other forgets every request before each
    # step and catches up over the whole sequence from the target's stored hidden states
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    runs = []
    for fresh in (False, True):
        engine = _eagle(tiny_engine, tiny_models["target"], eagle_heads[name], algorithm)
        drafter = engine.scheduler.spec.drafter
        if fresh:
            propose = drafter.propose

            def forgetting(reqs, max_drafts, drafter=drafter, propose=propose):
                for req in reqs:
                    drafter.forget(req)
                return propose(reqs, max_drafts)

            drafter.propose = forgetting
        calls = _record_drafts(engine)
        for _ in range(2):  # the second round's prefixes are cached: stored states
            engine.generate(input_ids=PROMPTS, sampling_params=params)
        runs.append(calls)
        assert engine.is_memory_free()
    assert sum(len(d) for call in runs[0] for d in call) > 0
    assert runs[0] == runs[1]


def test_bad_heads_are_refused_at_start_up(tiny_models, tiny_engine, eagle_heads, tmp_path):
    target = tiny_models["target"]
    cases = [
        ("EAGLE", eagle_heads["wide"], "the head's hidden_size is 32, the target's 64"),
        ("EAGLE", target, "LlamaForCausalLM is not a head for --speculative-algorithm EAGLE"),
        ("EAGLE", eagle_heads["eagle3"], "LlamaForCausalLMEagle3 is not a head for"),
        ("EAGLE3", eagle_heads["random"], "LlamaForCausalLMEagle is not a head for"),
        ("EAGLE", str(tmp_path / "missing"), "does not exist"),
        ("EAGLE3", target, "set its architectures to LlamaForCausalLMEagle3"),
    ]
    model_config = ModelConfig.from_path(resolve_model_path(target, "dummy"))
    for algorithm, head, message in cases:
        config = EngineConfig(
            model_path=target,
            load_format="dummy",
            speculative_algorithm=algorithm,
            speculative_draft_model_path=head,
        )
        with pytest.raises(ValueError, match=message):  # before any process starts
            check_draft_model(config, model_config)
        with pytest.raises(ValueError, match=message):  # and when an engine starts
            _eagle(tiny_engine, target, head, algorithm)
    unconverted = tmp_path / "bin-head"  # a head whose weights are not safetensors
    unconverted.mkdir()
    config_json = (Path(eagle_heads["random"]) / "config.json").read_text()
    (unconverted / "config.json").write_text(config_json)
    config = EngineConfig(
        model_path=target,
        speculative_algorithm="EAGLE",
        speculative_draft_model_path=str(unconverted),
    )
    with pytest.raises(ValueError, match="must be converted to safetensors first"):
        check_draft_model(config, model_config)
    # EAGLE-3 reads the inputs of layers 2, n // 2 and n - 3: a 2-layer target has none
    shallow = tiny_models["two-layer"]
    with pytest.raises(ValueError, match=r"target layers \[2, 1, -1\]"):
        _eagle(tiny_engine, shallow, eagle_heads["eagle3"], "EAGLE3")
    with pytest.raises(ValueError, match="EAGLE needs --speculative-draft-model-path"):
        tiny_engine(target, speculative_algorithm="EAGLE")


@pytest.mark.parametrize("where", ["head", "target"])
def test_a_step_failing_mid_draft_leaks_no_kv(tiny_models, tiny_engine, eagle_heads, where):
    # the head has taken this step's slots (and run its catch-up) when the head's second
    # forward or the target's verify forward raises: the batch ends, its memory comes back
    engine = _eagle(tiny_engine, tiny_models["target"], eagle_heads["random"], page_size=4)
    sched = engine.scheduler
    sched.isolate_failures = True
    runner = sched.spec.drafter.runner if where == "head" else sched.runner
    forward = runner.forward_hidden if where == "head" else runner.forward
    calls = 0

    def failing(fb):
        nonlocal calls
        calls += 1
        if calls == 8:
            raise RuntimeError("injected")
        return forward(fb)

    setattr(runner, "forward_hidden" if where == "head" else "forward", failing)
    params = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
    reqs = [
        Req(GenerateRequest(rid=f"r{i}", input_ids=ids, sampling=params))
        for i, ids in enumerate(PROMPTS)
    ]
    for req in reqs:
        sched.add_request(req)
    while sched.has_work():
        sched.step()
    assert calls == 8  # the whole batch failed at the injected call
    assert all("injected" in r.finished_reason.message for r in reqs)
    assert engine.is_memory_free()


def test_serve_refuses_a_wide_head_before_starting(tiny_models, eagle_heads, caplog):
    from kvflow.runtime.server.args import parse_args
    from kvflow.runtime.server.launch import launch_server

    argv = ["--model-path", tiny_models["target"], "--load-format", "dummy", "--device", "cpu"]
    argv += ["--speculative-algorithm", "EAGLE"]
    argv += ["--speculative-draft-model-path", eagle_heads["wide"], "--skip-tokenizer-init"]
    assert launch_server(parse_args(argv)) == 2  # no process was started
    assert "the head's hidden_size is 32, the target's 64" in caplog.text


def test_eagle3_reads_three_layers_and_drafts_target_ids(tiny_models, tiny_engine, eagle_heads):
    engine = _eagle(tiny_engine, tiny_models["target"], eagle_heads["eagle3"], "EAGLE3")
    runner = engine.runner
    assert runner.features is not None and runner.features.layers == (0, 1, 2)  # 3 layers
    calls = _record_drafts(engine)
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    results = engine.generate(input_ids=PROMPTS, sampling_params=params)
    drafted = [t for call in calls for draft in call for t in draft]
    # the head's 48 tokens are the target's even ids (d2t), never an id past them
    assert drafted and all(t % 2 == 0 and t < 96 for t in drafted)
    # the first block of a stored row is layer 0's input: the token's embedding
    ids = results[0].output_ids
    req_tokens = PROMPTS[0] + ids
    engine2 = _eagle(tiny_engine, tiny_models["target"], eagle_heads["eagle3"], "EAGLE3")
    sched = engine2.scheduler
    req = Req(
        GenerateRequest(rid="r", input_ids=req_tokens, sampling=SamplingParams(max_new_tokens=4))
    )
    sched.add_request(req)
    sched.step()  # the prefill
    target = engine2.runner
    slots = target.req_to_token.read(req.req_pool_idx, len(req_tokens))
    rows = target.hidden_pool[slots]
    hidden = target.model_config.hidden_size
    embeds = target.model.embed_tokens(torch.tensor(req_tokens))
    assert torch.equal(rows[:, :hidden], embeds)
    assert not torch.allclose(rows[:, hidden : 2 * hidden], rows[:, 2 * hidden :])
    while sched.has_work():
        sched.step()
    assert engine.is_memory_free() and engine2.is_memory_free()
