"""Run by the sglang venv's python: prints the request fields SGLang defines, as JSON."""

from __future__ import annotations

import ast
import json
import typing
from pathlib import Path

import msgspec
from sglang.srt.entrypoints.openai import protocol
from sglang.srt.sampling.sampling_params import SamplingParams


def dataclass_fields(path: Path, name: str) -> list[str]:
    """Field names of a dataclass read from source (importing io_struct needs torchvision)."""
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    return [
        s.target.id
        for s in cls.body
        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
    ]


def part_types() -> list[str]:
    """The ``type`` literals of SGLang's chat content parts."""
    types = []
    for part in typing.get_args(protocol.ChatCompletionMessageContentPart):
        for model in typing.get_args(part) or (part,):  # the audio part is an Annotated Union
            for inner in typing.get_args(model) or (model,):
                if hasattr(inner, "model_fields"):
                    types += list(typing.get_args(inner.model_fields["type"].annotation))
    return types


io_struct = Path(protocol.__file__).parents[2] / "managers" / "io_struct.py"
print(
    json.dumps(
        {
            "chat": list(protocol.ChatCompletionRequest.model_fields),
            "completions": list(protocol.CompletionRequest.model_fields),
            "generate": dataclass_fields(io_struct, "GenerateReqInput"),
            "sampling_params": [f.name for f in msgspec.structs.fields(SamplingParams)],
            "message": sorted(
                set(protocol.ChatCompletionMessageGenericParam.model_fields)
                | set(protocol.ChatCompletionMessageUserParam.model_fields)
            ),
            "text_part": list(protocol.ChatCompletionMessageContentTextPart.model_fields),
            "part_types": part_types(),
            "tool_call": list(protocol.ToolCall.model_fields),
            "tool_call_function": list(protocol.FunctionResponse.model_fields),
            "stream_options": list(protocol.StreamOptions.model_fields),
        }
    )
)
