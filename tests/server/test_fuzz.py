"""Property-based fuzzing of the request surface (``hypothesis``): whatever a client sends
to ``/v1/chat/completions``, ``/v1/completions`` or ``/generate`` (wrong types, huge and
tiny numbers, NaN/Infinity, unicode, nesting, lists where scalars go), the answer is never
a 5xx, every 4xx has OpenAI's error body, and the server stays healthy. Examples are
derandomized (the same in every run) and bounded in count; the server's context is short
so valid examples generate few tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_process import ServerProcess

pytestmark = pytest.mark.slow

FUZZ = settings(
    max_examples=45,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

huge_ints = st.integers(min_value=-(2**80), max_value=2**80)
junk = st.one_of(
    st.none(),
    st.booleans(),
    huge_ints,
    st.sampled_from([2**63, 2**64, -(2**63) - 1, 2**31]),
    # subnormals come from the list below: hypothesis refuses to draw them in a process
    # where another library switched on flush-to-zero (the server is another process)
    st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=False),
    st.sampled_from([1e-300, 5e-324, 2.2e-308, 1e300, -0.0]),
    st.text(max_size=12),
    st.lists(st.integers(-3, 5), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


def field(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly plausible values, often anything at all."""
    return st.one_of(valid, valid, junk)


SAMPLING = {
    "temperature": field(st.floats(0, 2, allow_subnormal=False)),
    "top_p": field(st.floats(0, 1, allow_subnormal=False)),
    "top_k": field(st.integers(-1, 50)),
    "min_p": field(st.floats(0, 1, allow_subnormal=False)),
    "presence_penalty": field(st.floats(-2, 2, allow_subnormal=False)),
    "frequency_penalty": field(st.floats(-2, 2, allow_subnormal=False)),
    "repetition_penalty": field(st.floats(0, 2, allow_subnormal=False)),
    "seed": field(huge_ints),
    "n": field(st.integers(0, 3)),
    "stop": field(st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3))),
    "stop_token_ids": field(st.lists(st.integers(-2, 60000), max_size=3)),
    "ignore_eos": field(st.booleans()),
    "min_tokens": field(st.integers(0, 4)),
    "skip_special_tokens": field(st.booleans()),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({"include_usage": field(st.booleans())})),
}
message = st.fixed_dictionaries(
    {
        "role": field(st.sampled_from(["system", "user", "assistant", "tool", "developer"])),
        "content": field(
            st.one_of(
                st.text(max_size=40),
                st.lists(
                    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=9)}),
                    max_size=2,
                ),
            )
        ),
    }
)
chat_bodies = st.fixed_dictionaries(
    {"messages": field(st.lists(message, min_size=1, max_size=3))},
    optional={
        **SAMPLING,
        "max_tokens": field(st.integers(0, 6)),
        "max_completion_tokens": field(st.integers(0, 6)),
        "logprobs": field(st.booleans()),
        "top_logprobs": field(st.integers(0, 21)),
        "model": field(st.text(max_size=10)),
    },
)
token_ids = st.lists(st.integers(-1, 49200), min_size=0, max_size=8)
completion_bodies = st.fixed_dictionaries(
    {
        "prompt": field(
            st.one_of(
                st.text(max_size=40),
                st.lists(st.text(max_size=10), max_size=2),
                token_ids,
                st.lists(token_ids, max_size=2),
            )
        )
    },
    optional={
        **SAMPLING,
        "max_tokens": field(st.integers(0, 6)),
        "echo": field(st.booleans()),
        "logprobs": field(st.integers(0, 21)),
    },
)
native_params = st.fixed_dictionaries(
    {},
    optional={
        "max_new_tokens": field(st.integers(0, 6)),
        "min_new_tokens": field(st.integers(0, 3)),
        **{
            k: v for k, v in SAMPLING.items() if k not in ("stream", "stream_options", "min_tokens")
        },
    },
)
generate_bodies = st.fixed_dictionaries(
    {},
    optional={
        "text": field(st.one_of(st.text(max_size=40), st.lists(st.text(max_size=10), max_size=2))),
        "input_ids": field(st.one_of(token_ids, st.lists(token_ids, max_size=2))),
        "sampling_params": field(st.one_of(native_params, st.lists(native_params, max_size=2))),
        "stream": field(st.booleans()),
        "return_logprob": field(st.booleans()),
        "top_logprobs_num": field(st.integers(0, 21)),
        "rid": field(st.text(max_size=8)),
        "extra_key": field(st.text(max_size=8)),
    },
)


@pytest.fixture(scope="module")
def fuzz_server(embedded_ready, tmp_path_factory) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        "--context-length",
        "96",
        "--max-total-tokens",
        "4000",
        log=tmp_path_factory.mktemp("fuzz") / "server.log",
    )
    yield proc
    proc.wait_idle_and_free()
    proc.stop()


def _check(server: ServerProcess, path: str, body: object) -> None:
    raw = json.dumps(body, allow_nan=True)  # NaN/Infinity literals reach the server
    with httpx.stream(
        "POST",
        server.url + path,
        content=raw,
        headers={"content-type": "application/json"},
        timeout=120,
    ) as response:
        content = response.read()
    assert response.status_code < 500, (response.status_code, content[:300], raw)
    if response.status_code >= 400:
        error = json.loads(content)["error"]
        assert isinstance(error["message"], str) and error["message"], raw
        assert error["code"] == response.status_code and isinstance(error["type"], str), raw
    elif b"data:" in content[:6]:
        assert content.rstrip().endswith(b"data: [DONE]"), (content[-200:], raw)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


@FUZZ
@given(body=chat_bodies)
def test_fuzz_chat_completions(fuzz_server, body):
    _check(fuzz_server, "/v1/chat/completions", body)


@FUZZ
@given(body=completion_bodies)
def test_fuzz_completions(fuzz_server, body):
    _check(fuzz_server, "/v1/completions", body)


@FUZZ
@given(body=generate_bodies)
def test_fuzz_generate(fuzz_server, body):
    _check(fuzz_server, "/generate", body)


@FUZZ
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/generate"]), body=junk)
def test_fuzz_bodies_that_are_not_objects(fuzz_server, path, body):
    _check(fuzz_server, path, body)
