"""SGLang's frontend language (sglang 0.5.23, ``RuntimeEndpoint``) runs unchanged against
``kvflow serve``: gen with roles, batches and streaming, regex / int / JSON-schema constrained
gen, select (scored by kvflow's prompt logprobs), fork/join sharing the prefix in kvflow's
radix cache. The programs are in programs.py,
run by the sglang venv's python; their results are checked against kvflow's own API."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import httpx
import jsonschema
import pytest

PROGRAMS = Path(__file__).with_name("programs.py")


def _run(python: Path, server, program: str) -> dict:
    done = subprocess.run(
        [str(python), str(PROGRAMS), server.url, program],
        capture_output=True,
        text=True,
        timeout=600,
        cwd="/",  # the repo root's operator/ folder would shadow Python's operator
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _generate(server, text: str, **params) -> dict:
    body = {"text": text, "sampling_params": {"temperature": 0, **params}}
    response = httpx.post(f"{server.url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_gen_with_roles_batch_and_stream(sglang_python, frontend_server):
    out = _run(sglang_python, frontend_server, "qa")
    assert [m["role"] for m in out["messages"]] == ["system", "user", "assistant"]
    answer = out["answer"]
    assert answer and out["text"].endswith(f"{answer}<|im_end|>\n")
    # what kvflow answers for the prompt the frontend built (its chatml template)
    prompt = out["text"][: -len(f"{answer}<|im_end|>\n")]
    assert prompt.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    direct = _generate(frontend_server, prompt, max_new_tokens=16)
    assert direct["text"] == answer
    assert out["meta"]["prompt_tokens"] == direct["meta_info"]["prompt_tokens"]
    assert out["streamed"] == answer
    assert len(out["batch"]) == 2 and all(out["batch"])


def test_constrained_gen(sglang_python, frontend_server):
    from programs_schema import SCHEMA  # the program's schema, without importing sglang

    out = _run(sglang_python, frontend_server, "constrained")
    assert re.fullmatch(r"1[0-9]{3}", out["year"]), out
    assert re.fullmatch(r"-?\d+", out["digit"].strip()), out  # gen_int: SGLang's REGEX_INT
    jsonschema.validate(json.loads(out["city"]), SCHEMA)


def test_fork_branches_share_the_prefix(sglang_python, frontend_server):
    from programs_schema import SHARED

    out = _run(sglang_python, frontend_server, "fork_join")
    (metas,) = out["facts"]
    shared_tokens = _generate(frontend_server, SHARED, max_new_tokens=0)["meta_info"]
    assert len(metas) == 2
    assert all(m["prompt_tokens"] > shared_tokens["prompt_tokens"] for m in metas)
    # whichever branch ran second (or both, after the fork's commit) reused the shared prefix
    assert max(m["cached_tokens"] for m in metas) >= shared_tokens["prompt_tokens"] - 1
    assert "First:" in out["text"] and "Second:" in out["text"] and out["summary"]


def test_select_picks_the_choice_kvflow_scores_highest(sglang_python, frontend_server):
    from programs_schema import CITIES, CITY_QUESTION

    out = _run(sglang_python, frontend_server, "select")
    meta = out["city_meta"]
    scores = meta["normalized_prompt_logprobs"]
    assert out["city"] == CITIES[scores.index(max(scores))] == " Paris."
    assert out["answer"] in (" Yes", " No")
    # the scores are kvflow's own prompt logprobs of each choice (token length normalized)
    prompt_len = _generate(frontend_server, CITY_QUESTION, max_new_tokens=0)["meta_info"][
        "prompt_tokens"
    ]
    for choice, reported, score in zip(CITIES, meta["input_token_logprobs"], scores, strict=True):
        body = {
            "text": CITY_QUESTION + choice,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "return_text_in_logprobs": True,
            "logprob_start_len": prompt_len - 2,
        }
        ours = httpx.post(f"{frontend_server.url}/generate", json=body, timeout=60).json()
        entries = ours["meta_info"]["input_token_logprobs"]
        assert entries[-len(reported) :] == reported  # the frontend drops a healed token
        assert score == pytest.approx(sum(e[0] for e in reported) / len(reported), abs=1e-6)


@pytest.mark.parametrize(
    ("name", "value"),
    [("stop_regex", "\\d"), ("lora_path", "adapter")],
)
def test_frontend_fields_that_kvflow_cannot_honour_are_refused(frontend_server, name, value):
    """What RuntimeEndpoint sends at its defaults passes (above); set, they are a 400."""
    body = {"text": "x", "sampling_params": {"max_new_tokens": 1}}
    if name == "stop_regex":
        body["sampling_params"][name] = value
    else:
        body[name] = value
    response = httpx.post(f"{frontend_server.url}/generate", json=body, timeout=60)
    assert response.status_code == 400 and name in response.json()["error"]["message"]
