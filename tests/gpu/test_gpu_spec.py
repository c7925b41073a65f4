"""Speculative decoding on CUDA (the triton attention backend, the verify step in the
decode CUDA graphs): greedy tokens equal the plain engine's (CUDA graphs on there) with
NGRAM, STANDALONE and EAGLE / EAGLE3 (random heads; chains and trees, top-k 4 and 2) on a
small random config in float32, the drafters' decode steps (a tree's frontiers too)
replaying their own CUDA graphs (and with --disable-cuda-graph running eagerly, the same
tokens again), and a STANDALONE draft of Llama-3.1-8B's shapes with fewer layers runs to
the end, in its graphs, and frees its memory.

Skipped without CUDA; run on the accelerator machine with
``pytest -m gpu tests/gpu/test_gpu_spec.py``.
"""

from __future__ import annotations

import gc
import json

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "eos_token_id": 999,
    "tie_word_embeddings": False,
}
SETTINGS = dict(
    load_format="dummy",
    skip_tokenizer_init=True,
    device="cuda",
    max_running_requests=16,
    max_total_tokens=8192,
)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 999, (n,), generator=g).tolist() for n in (5, 40, 130, 9)]
    return [*prompts, [7, 8, 9, 10] * 10]  # repeats: NGRAM drafts


def _greedy(engine) -> list[list[int]]:
    params = [
        {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True},
        {"temperature": 0, "max_new_tokens": 17, "ignore_eos": True},
        {"temperature": 0, "max_new_tokens": 32, "stop_token_ids": [5, 6, 7]},
        {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True},
        {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True},
    ]
    return [r.output_ids for r in engine.generate(input_ids=_prompts(), sampling_params=params)]


def _free(engine) -> None:
    assert engine.is_memory_free()
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def test_speculation_equals_plain_greedy_on_cuda(tmp_path):
    from kvflow.runtime.engine import Engine

    target = tmp_path / "target.json"
    target.write_text(json.dumps(CONFIG))
    shallow = tmp_path / "shallow.json"
    shallow.write_text(json.dumps({**CONFIG, "num_hidden_layers": 1}))
    head = tmp_path / "eagle-head.json"  # an EAGLE head of the target's shapes, random
    head.write_text(
        json.dumps({**CONFIG, "num_hidden_layers": 1, "architectures": ["LlamaForCausalLMEagle"]})
    )
    head3 = tmp_path / "eagle3-head.json"  # reads the inputs of target layers 1, 2 and 3
    head3.write_text(
        json.dumps(
            {
                **CONFIG,
                "num_hidden_layers": 1,
                "architectures": ["LlamaForCausalLMEagle3"],
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]},
            }
        )
    )
    plain = Engine(str(target), dtype="float32", **SETTINGS)
    assert plain.runner.graph_runner is not None
    expected = _greedy(plain)
    _free(plain)
    variants = {
        "ngram": dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=5),
        "standalone-shallow": dict(
            speculative_algorithm="STANDALONE",
            speculative_draft_model_path=str(shallow),
            speculative_num_steps=3,
        ),
        "standalone-same": dict(
            speculative_algorithm="STANDALONE",
            speculative_draft_model_path=str(target),
            speculative_num_steps=3,
        ),
        "eagle": dict(
            speculative_algorithm="EAGLE",
            speculative_draft_model_path=str(head),
            speculative_num_steps=3,
        ),
        "eagle3": dict(
            speculative_algorithm="EAGLE3",
            speculative_draft_model_path=str(head3),
            speculative_num_steps=3,
        ),
        "eagle-tree": dict(  # page size auto: 1 under trees
            speculative_algorithm="EAGLE",
            speculative_draft_model_path=str(head),
            speculative_num_steps=3,
            speculative_eagle_topk=4,
            speculative_num_draft_tokens=8,
        ),
        "eagle3-tree": dict(
            speculative_algorithm="EAGLE3",
            speculative_draft_model_path=str(head3),
            speculative_num_steps=3,
            speculative_eagle_topk=2,
            speculative_num_draft_tokens=6,
        ),
    }
    for name, spec in variants.items():
        engine = Engine(str(target), dtype="float32", **SETTINGS, **spec)
        assert engine.runner.graph_runner is not None  # the verify step replays decode graphs
        assert _greedy(engine) == expected, name
        worker = engine.scheduler.spec
        assert worker is not None and worker.verified_reqs > 0, name
        if name == "standalone-same":
            assert worker.accepted_tokens > 0.9 * worker.drafted_tokens
        graphs = getattr(worker.drafter, "graphs", None)
        if name.startswith(("standalone", "eagle")):
            # the draft's steps after the first (a tree's frontiers) replayed its own graphs,
            # captured for a tree's topk rows per request
            assert graphs is not None and graphs.replays > 0, name
            rows = spec.get("speculative_eagle_topk", 1) * SETTINGS["max_running_requests"]
            assert graphs.max_bs == rows, name
        else:
            assert graphs is None, name  # NGRAM has no model
        _free(engine)


def test_draft_graphs_off_with_disable_cuda_graph(tmp_path):
    # the switch holds for the draft too: no graphs anywhere, the same greedy tokens
    from kvflow.runtime.engine import Engine

    target = tmp_path / "target.json"
    target.write_text(json.dumps(CONFIG))
    shallow = tmp_path / "shallow.json"
    shallow.write_text(json.dumps({**CONFIG, "num_hidden_layers": 1}))
    head = tmp_path / "eagle-head.json"
    head.write_text(
        json.dumps({**CONFIG, "num_hidden_layers": 1, "architectures": ["LlamaForCausalLMEagle"]})
    )
    plain = Engine(str(target), dtype="float32", **SETTINGS)
    expected = _greedy(plain)
    _free(plain)
    for algorithm, path in (("STANDALONE", shallow), ("EAGLE", head)):
        engine = Engine(
            str(target),
            dtype="float32",
            disable_cuda_graph=True,
            speculative_algorithm=algorithm,
            speculative_draft_model_path=str(path),
            speculative_num_steps=3,
            **SETTINGS,
        )
        assert engine.runner.graph_runner is None
        worker = engine.scheduler.spec
        assert worker is not None and worker.drafter.graphs is None, algorithm
        assert _greedy(engine) == expected, algorithm
        _free(engine)


def test_standalone_draft_of_llama_8b_shapes(tmp_path):
    from kvflow.runtime.config import DUMMY_CONFIGS
    from kvflow.runtime.engine import Engine

    raw = json.loads(DUMMY_CONFIGS["llama-3.1-8b"].read_text())
    draft = tmp_path / "draft.json"
    draft.write_text(json.dumps({**raw, "num_hidden_layers": 2}))
    engine = Engine(
        "llama-3.1-8b",
        dtype="bfloat16",
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=str(draft),
        speculative_num_steps=3,
        **{**SETTINGS, "max_total_tokens": 16384},
    )
    prompts = [[(13 * i + j) % 128000 for j in range(200)] for i in range(3)]
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    results = engine.generate(input_ids=prompts, sampling_params=params)
    assert [len(r.output_ids) for r in results] == [24, 24, 24]
    worker = engine.scheduler.spec
    assert worker.verified_reqs > 0
    assert worker.drafter.graphs is not None and worker.drafter.graphs.replays > 0
    _free(engine)
