"""Structured output through a real ``kvflow serve`` on the embedded model: OpenAI's
response_format, SGLang's json_schema/regex/ebnf, logit_bias, 400s for invalid grammars,
mixed batches and compiles that do not stall other requests."""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
from schemas import SCHEMAS
from server_process import ServerProcess

MAX_TOKENS = 96


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        "--max-total-tokens",
        "12000",
        "--context-length",
        "2048",
        log=tmp_path_factory.mktemp("grammar") / "server.log",
    )
    yield proc
    proc.stop()


def chat(server: ServerProcess, content: str, **fields) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "temperature": 0, **fields}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)


def generate(server: ServerProcess, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/generate", json=body, timeout=300)


def test_json_schemas_validate(server):
    """Every schema at once (one batch): each answer parses and validates, and ends because
    the grammar ended (stop), not by length."""

    def ask(name: str) -> tuple[str, dict]:
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}
        resp = chat(server, f"Give an example as JSON ({name}).", response_format=fmt,
                    max_tokens=MAX_TOKENS)  # fmt: skip
        assert resp.status_code == 200, resp.text
        return name, resp.json()["choices"][0]

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        answers = dict(pool.map(ask, SCHEMAS))
    assert len(answers) >= 20
    for name, choice in answers.items():
        value = json.loads(choice["message"]["content"])
        jsonschema.validate(value, SCHEMAS[name])
        assert choice["finish_reason"] == "stop", (name, choice)
    server.wait_idle_and_free()


def test_json_object_and_strict_schema(server):
    resp = chat(server, "Reply with a tiny JSON object: a name and an age.",
                response_format={"type": "json_object"},
                max_tokens=MAX_TOKENS)  # fmt: skip
    assert resp.status_code == 200, resp.text
    content = resp.json()["choices"][0]["message"]["content"]
    assert isinstance(json.loads(content), dict)
    schema = SCHEMAS["no_extra_properties"]
    fmt = {"type": "json_schema", "json_schema": {"name": "ab", "schema": schema, "strict": True}}
    resp = chat(server, "JSON please", response_format=fmt, max_tokens=MAX_TOKENS, stream=True)
    text = "".join(
        json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
        for line in resp.text.splitlines()
        if line.startswith("data: {")
    )
    jsonschema.validate(json.loads(text), schema)


def test_text_response_format_is_unconstrained(server):
    plain = chat(server, "Say hello.", max_tokens=12).json()
    text = chat(server, "Say hello.", max_tokens=12, response_format={"type": "text"}).json()
    assert text["choices"][0]["message"] == plain["choices"][0]["message"]


REGEXES = [
    r"[0-9]{3}-[0-9]{4}",
    r"(cat|dog|bird)s?",
    r"[A-Z][a-z]{2,6} is [0-9]{1,2} years old\.",
    r"(true|false)",
    r"\d+(\.\d{1,2})?",
]
EBNF = {
    'root ::= "The answer is " answer "."\nanswer ::= "yes" | "no"': r"The answer is (yes|no)\.",
    'root ::= item (", " item)? (", " item)?\nitem ::= [a-z] [a-z]? [a-z]? [a-z]? [a-z]?': (
        r"[a-z]{1,5}(, [a-z]{1,5}){0,2}"
    ),
    'root ::= "(" num " + " num ")"\nnum ::= [1-9] [0-9]?': r"\([1-9][0-9]? \+ [1-9][0-9]?\)",
}


def test_native_regex_and_ebnf_match(server):
    """SGLang's /generate with one sampling_params per prompt: regex and EBNF constraints in
    one batch; each text matches and the request stopped because its grammar ended."""
    params = [{"regex": r, "max_new_tokens": 24, "temperature": 0} for r in REGEXES]
    params += [{"ebnf": g, "max_new_tokens": 24, "temperature": 0} for g in EBNF]
    patterns = [*REGEXES, *EBNF.values()]
    texts = [f"Question {i}: answer briefly." for i in range(len(params))]
    resp = generate(server, text=texts, sampling_params=params)
    assert resp.status_code == 200, resp.text
    for pattern, out in zip(patterns, resp.json(), strict=True):
        assert re.fullmatch(pattern, out["text"]), (pattern, out["text"])
        finish = out["meta_info"]["finish_reason"]
        assert finish["type"] == "stop", (pattern, out)


def test_native_json_schema_string(server):
    schema = SCHEMAS["ref_defs"]
    resp = generate(
        server,
        text="A line segment as JSON:",
        sampling_params={"json_schema": json.dumps(schema), "max_new_tokens": MAX_TOKENS,
                         "temperature": 0},
    )  # fmt: skip
    assert resp.status_code == 200, resp.text
    jsonschema.validate(json.loads(resp.json()["text"]), schema)


def test_openai_regex_ebnf_and_completions_json_schema(server):
    resp = chat(server, "Pick one.", regex="(red|green|blue)", max_tokens=8)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] in ("red", "green", "blue")
    resp = chat(server, "Yes or no?", ebnf='root ::= "Y" | "N"', max_tokens=8)
    assert resp.json()["choices"][0]["message"]["content"] in ("Y", "N")
    schema = SCHEMAS["enum_string"]
    resp = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "Color:", "json_schema": json.dumps(schema), "max_tokens": 32,
              "temperature": 0},
        timeout=300,
    )  # fmt: skip
    assert resp.status_code == 200, resp.text
    jsonschema.validate(json.loads(resp.json()["choices"][0]["text"]), schema)


@pytest.mark.parametrize(
    ("where", "body", "message"),
    [
        ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objecct"}}}}, 'Unsupported type "objecct"'),
        ("chat", {"regex": "a(b"}, "parenthesis is not closed"),
        ("chat", {"ebnf": "root ::= nothing"}, 'Rule "nothing" is not defined'),
        ("chat", {"regex": "a", "response_format": {"type": "json_object"}}, "at most one"),
        ("chat", {"response_format": {"type": "json_schema"}}, "needs its json_schema"),
        ("chat", {"logit_bias": {"5": 250}}, "logit_bias"),
        ("chat", {"logit_bias": {"99999999": 1}}, "outside the vocabulary"),
        ("generate", {"json_schema": "{not json"}, "not JSON"),
        ("generate", {"json_schema": '{"$ref": "#/$defs/nope"}'}, "$defs"),
        ("generate", {"regex": "[z-a]"}, "invalid regex"),
        ("generate", {"ebnf": 'root := "a"'}, "EBNF lexer error"),
        ("generate", {"regex": "a", "ebnf": 'root ::= "a"'}, "at most one"),
        ("completions", {"json_schema": '{"type": 5}'}, "Type should be a string"),
        ("completions", {"json_schema": "{}", "response_format": {"type": "json_object"}}, "not both"),
    ],
)  # fmt: skip
def test_invalid_grammar_is_400_with_message(server, where, body, message):
    if where == "chat":
        resp = chat(server, "hi", max_tokens=4, **body)
    elif where == "completions":
        resp = httpx.post(f"{server.url}/v1/completions",
                          json={"prompt": "hi", "max_tokens": 4, **body}, timeout=60)  # fmt: skip
    else:
        resp = generate(server, text="hi", sampling_params={"max_new_tokens": 4, **body})
    assert resp.status_code == 400, resp.text
    assert message in resp.json()["error"]["message"], resp.text


def test_free_requests_unchanged_by_constrained_neighbours(server):
    """Greedy free requests give the same tokens alone and batched with constrained ones."""
    free_texts = ["Tell me about the sea.", "What is a prime number?", "List three fruits."]
    free = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    alone = [
        generate(server, text=t, sampling_params=free).json()["output_ids"] for t in free_texts
    ]
    constrained = [
        {"regex": r"[0-9]{2,8}", "max_new_tokens": 24, "temperature": 0},
        {"json_schema": json.dumps(SCHEMAS["nested_object"]), "max_new_tokens": 24,
         "temperature": 0},
        {"ebnf": 'root ::= ("ab" | "cd")+', "max_new_tokens": 24, "temperature": 0},
    ]  # fmt: skip
    texts = [free_texts[0], "Number:", free_texts[1], "JSON:", free_texts[2], "Letters:"]
    params = [free, constrained[0], free, constrained[1], free, constrained[2]]
    outs = generate(server, text=texts, sampling_params=params).json()
    assert [outs[0]["output_ids"], outs[2]["output_ids"], outs[4]["output_ids"]] == alone
    assert re.fullmatch(r"[0-9]{2,8}", outs[1]["text"])
    assert re.fullmatch(r"(ab|cd)+", outs[5]["text"])


def test_logit_bias_changes_the_answer(server, tokenizer):
    prompt = "The capital of France is"
    plain = generate(server, text=prompt, sampling_params={"max_new_tokens": 1, "temperature": 0})
    first = plain.json()["output_ids"][0]
    target = first + 1
    biased = generate(
        server,
        text=prompt,
        sampling_params={"max_new_tokens": 1, "temperature": 0, "logit_bias": {str(target): 100}},
    )
    assert biased.status_code == 200, biased.text
    assert biased.json()["output_ids"] == [target]
    # OpenAI's chat: banning the greedy first token gives the second best one
    resp = chat(server, "Say hello.", max_tokens=1, logprobs=True, top_logprobs=2)
    top = resp.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    ids = [tokenizer.encode(t["token"]) for t in top]
    assert all(len(i) == 1 for i in ids), ids
    resp = chat(server, "Say hello.", max_tokens=1, logit_bias={str(ids[0][0]): -100})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == top[1]["token"]


def _big_schema(fields: int) -> dict:
    """A schema xgrammar takes seconds to compile for this tokenizer."""
    props = {
        f"field_{i}": {
            "type": "object",
            "properties": {
                "x": {"type": "string", "pattern": "[a-z]{2,8}[0-9]+"},
                "y": {"type": "array", "items": {"type": "number", "minimum": -5, "maximum": i}},
                "z": {"enum": [f"v{j}" for j in range(10)]},
            },
            "required": ["x", "y"],
        }
        for i in range(fields)
    }
    return {"type": "object", "properties": props, "required": list(props)[: fields // 2]}


def test_compile_does_not_stall_other_requests(server):
    """A schema that takes seconds to compile, then a free streamed request: the free one
    streams without a long gap and finishes while the compile is still running."""
    done: dict[str, float] = {}

    def slow() -> None:
        schema = json.dumps(_big_schema(400))  # compiles for seconds even on an idle machine
        resp = generate(server, text="{", sampling_params={"json_schema": schema,
                                                           "max_new_tokens": 1})  # fmt: skip
        assert resp.status_code == 200, resp.text
        done["constrained"] = time.monotonic()

    thread = threading.Thread(target=slow)
    start = time.monotonic()
    thread.start()
    time.sleep(0.5)  # the schema is checked and its compile started
    stamps = []
    with httpx.stream(
        "POST",
        f"{server.url}/generate",
        json={"text": "Count slowly:", "stream": True,
              "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}},
        timeout=300,
    ) as resp:  # fmt: skip
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.monotonic())
    done["free"] = time.monotonic()
    thread.join(300)
    assert len(stamps) >= 2
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    assert "constrained" in done
    assert done["free"] < done["constrained"], (
        f"free done at {done['free'] - start:.2f} s, compile at {done['constrained'] - start:.2f} s"
    )
    assert max(gaps) < 1.0, gaps
    server.wait_idle_and_free()


def _grammar_queue_gauge(server: ServerProcess) -> float:
    for line in httpx.get(f"{server.url}/metrics", timeout=30).text.splitlines():
        if line.startswith("sglang:num_grammar_queue_reqs{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("sglang:num_grammar_queue_reqs is not exported")


def test_grammar_queue_gauge_counts_compiling_requests(server):
    """``sglang:num_grammar_queue_reqs`` reads 1 while a request waits for its grammar's
    compile and 0 once it ran (stats are published every 0.25 s: polled)."""
    assert _grammar_queue_gauge(server) == 0
    schema = json.dumps(_big_schema(420))  # not the stall test's: not in the compile cache
    body = {"text": "{", "sampling_params": {"json_schema": schema, "max_new_tokens": 1}}
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(generate, server, **body)
        seen = []
        while not reply.done():
            seen.append(_grammar_queue_gauge(server))
            time.sleep(0.05)
        assert reply.result().status_code == 200, reply.result().text
    assert 1 in seen, seen
    deadline = time.monotonic() + 10
    while _grammar_queue_gauge(server) != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _grammar_queue_gauge(server) == 0


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"]}  # fmt: skip


def test_structural_tags(server, tokenizer):
    """SGLang's response_format structural_tag (free text until a trigger, then the tag's
    schema), and xgrammar's own structural tag format through /generate (a forced tag)."""
    legacy = {
        "type": "structural_tag",
        "structures": [{"begin": "The answer: ", "schema": CITY, "end": "."}],
        "triggers": ["The"],
    }
    resp = chat(server, "Where is the Eiffel tower?", response_format=legacy, max_tokens=16)
    assert resp.status_code == 200, resp.text
    text = resp.json()["choices"][0]["message"]["content"]
    match = re.match(r"The answer: (\{.*?\})\.", text)
    assert match, text  # unconstrained, the model says "The Eiffel Tower is ..."
    jsonschema.validate(json.loads(match.group(1)), CITY)
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "<answer>",
            "content": {"type": "json_schema", "json_schema": CITY},
            "end": "</answer>",
        },
    }
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Where is the Eiffel tower?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    resp = generate(server, text=prompt, sampling_params={"structural_tag": json.dumps(tag),
                                                          "max_new_tokens": 32,
                                                          "temperature": 0})  # fmt: skip
    assert resp.status_code == 200, resp.text
    out = resp.json()
    match = re.fullmatch(r"<answer>(.*)</answer>", out["text"], re.S)
    assert match, out["text"]
    jsonschema.validate(json.loads(match.group(1)), CITY)
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
