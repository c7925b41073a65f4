"""OpenAI's ``response_format`` and the structured-output fields SGLang adds to its OpenAI
endpoints (``regex``, ``ebnf``, ``json_schema``), as sampling parameters."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

from kvflow.runtime.wire.errors import RequestError

__all__ = ["JsonSchemaFormat", "ResponseFormat", "grammar_sampling"]

# OpenAI's json_object: any JSON object (kvflow.runtime.grammar.JSON_OBJECT_SCHEMA; not
# imported, so the protocol does not load xgrammar).
_JSON_OBJECT_SCHEMA = '{"type": "object", "additionalProperties": true}'


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's ``{name, description, schema, strict}``.

    The output always follows the schema exactly (xgrammar's strict mode), so ``strict``
    only documents the client's wish.
    """

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """``text`` (no constraint), ``json_object``, ``json_schema``, or SGLang's
    ``structural_tag`` (``structures`` of ``{begin, schema, end}`` and ``triggers``)."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _complete(self) -> ResponseFormat:
        self.grammar()  # a format missing its parts is refused while the body is parsed
        return self

    def grammar(self) -> tuple[str, str] | None:
        """``(sampling parameter, value)`` of this format, or None for ``text``."""
        extra = set(self.model_extra or {})
        if self.type != "structural_tag" and extra:
            raise ValueError(
                f"response_format of type {self.type} has unknown fields: {sorted(extra)}"
            )
        if self.type == "text":
            return None
        if self.type == "json_object":
            return "json_schema", _JSON_OBJECT_SCHEMA
        if self.type == "json_schema":
            if self.json_schema is None:
                raise ValueError("response_format json_schema needs its json_schema field")
            schema = self.json_schema.schema_
            # OpenAI allows the schema to be left out: any JSON then
            return "json_schema", json.dumps(schema if schema is not None else {})
        tag = {"type": "structural_tag", **(self.model_extra or {})}
        if "structures" not in tag and "format" not in tag:
            raise ValueError("response_format structural_tag needs structures and triggers")
        return "structural_tag", json.dumps(tag)


def grammar_sampling(
    response_format: ResponseFormat | None,
    regex: str | None,
    ebnf: str | None,
    json_schema: str | None,
    logit_bias: dict[str, float] | None,
) -> dict[str, Any]:
    """The sampling parameters these fields set (``SamplingParams.from_dict`` checks that
    at most one constraint is given and the bias range; the grammar is checked at entry)."""
    values: dict[str, Any] = {"regex": regex, "ebnf": ebnf, "json_schema": json_schema}
    found = response_format.grammar() if response_format is not None else None
    if found is not None:
        kind, text = found
        if values.get(kind) is not None:
            raise RequestError(400, f"give {kind} or response_format, not both")
        values[kind] = text
    if logit_bias:
        values["logit_bias"] = logit_bias
    return {k: v for k, v in values.items() if v is not None}
