"""Every request field SGLang 0.5.23 defines (read from the installed package) is known to
kvflow: declared by its request model (honoured) or listed as ignored or refused-unless-
default; so SGLang's own clients never get kvflow's 'unknown field' 400."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kvflow.runtime.server.openai.fields import (
    ENDPOINT_FIELDS,
    IGNORED,
    REFUSED_UNLESS_DEFAULT,
    SAMPLING_ALIASES,
)
from kvflow.runtime.server.openai.message_fields import (
    CONTENT_PART_REFUSED,
    MESSAGE_FIELDS,
    MESSAGE_REFUSED_UNLESS_DEFAULT,
)
from kvflow.runtime.server.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    GenerateRequestBody,
    StreamOptions,
    ToolCall,
    ToolCallFunction,
)
from kvflow.runtime.wire.sampling import SAMPLING_KEYS

# SamplingParams fields SGLang fills in itself ("Internal fields ... not API-facing")
SGLANG_INTERNAL = {
    "stop_strs",
    "stop_regex_strs",
    "stop_str_max_len",
    "stop_regex_max_len",
    "is_normalized",
    "ebnf_full_assistant",
}
DECLARED = {
    "chat": set(ChatCompletionRequest.model_fields),
    "completions": set(CompletionRequest.model_fields),
    "generate": set(GenerateRequestBody.model_fields),
    "sampling_params": set(SAMPLING_KEYS) | set(SAMPLING_ALIASES),
}


@pytest.fixture(scope="module")
def sglang_fields(sglang_python) -> dict[str, list[str]]:
    done = subprocess.run(
        [str(sglang_python), str(Path(__file__).with_name("sglang_fields.py"))],
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/",
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("endpoint", ["chat", "completions", "generate", "sampling_params"])
def test_every_sglang_field_is_known(sglang_fields, endpoint):
    unknown = [
        name
        for name in sglang_fields[endpoint]
        if name not in DECLARED[endpoint]
        and name not in ENDPOINT_FIELDS[endpoint]
        and name not in SGLANG_INTERNAL
    ]
    assert unknown == [], f"{endpoint}: SGLang fields kvflow does not know: {unknown}"
    for name in ENDPOINT_FIELDS[endpoint]:
        assert name in IGNORED or name in REFUSED_UNLESS_DEFAULT, name


def test_every_sglang_message_field_and_part_type_is_known(sglang_fields):
    known = MESSAGE_FIELDS | set(MESSAGE_REFUSED_UNLESS_DEFAULT)
    assert [f for f in sglang_fields["message"] if f not in known] == []
    assert set(ChatMessage.model_fields) == MESSAGE_FIELDS
    assert sglang_fields["text_part"] == ["type", "text"]
    unknown_types = [
        t for t in sglang_fields["part_types"] if t != "text" and t not in CONTENT_PART_REFUSED
    ]
    assert unknown_types == []
    assert set(sglang_fields["tool_call"]) <= set(ToolCall.model_fields)
    assert set(sglang_fields["tool_call_function"]) <= set(ToolCallFunction.model_fields)
    assert set(sglang_fields["stream_options"]) <= set(StreamOptions.model_fields)
