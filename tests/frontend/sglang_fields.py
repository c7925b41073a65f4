"""Run by the sglang venv's python: prints the request fields SGLang defines, as JSON."""

from __future__ import annotations

import ast
import json
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


io_struct = Path(protocol.__file__).parents[2] / "managers" / "io_struct.py"
print(
    json.dumps(
        {
            "chat": list(protocol.ChatCompletionRequest.model_fields),
            "completions": list(protocol.CompletionRequest.model_fields),
            "generate": dataclass_fields(io_struct, "GenerateReqInput"),
            "sampling_params": [f.name for f in msgspec.structs.fields(SamplingParams)],
        }
    )
)
