"""Request schemas of the OpenAI-compatible API (responses are built as plain dicts).

Fields beyond OpenAI's (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``min_tokens``, ``stop_token_ids``, ``skip_special_tokens``...) follow SGLang. Every body is
checked against the fields OpenAI and SGLang define (:mod:`.fields`): an unknown field is a
400 naming it, a known one the model does not declare is ignored on purpose or refused
unless at its default; wrongly typed ones are 400.
Types are strict, as OpenAI's are: numbers given as strings, floats where integers go,
booleans where numbers go and non-finite floats (``NaN``, ``Infinity``) are refused.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

from kvflow.runtime.server.openai.fields import check_fields
from kvflow.runtime.server.openai.message_fields import check_messages
from kvflow.runtime.server.openai.structured import ResponseFormat, grammar_sampling

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "EmbeddingRequest",
    "EncodeRequestBody",
    "GenerateRequestBody",
    "NamedToolChoice",
    "StreamOptions",
    "Tool",
    "ToolCall",
]


_STRICT = ConfigDict(strict=True, allow_inf_nan=False)


def _namespace(extra_key: str | None, cache_salt: str | None) -> str | None:
    """SGLang's ``extra_key`` and ``cache_salt`` both keep a request's cached prefixes apart
    from those of requests with other values: together they are one prefix-cache key."""
    parts = [p for p in (extra_key, cache_salt) if p is not None]
    return "\x00".join(parts) if parts else None


class StreamOptions(BaseModel):
    """``include_usage``: a last chunk with the usage of the whole answer (OpenAI's);
    ``continuous_usage_stats``: every chunk carries the usage of its sample so far (SGLang's)."""

    model_config = ConfigDict(extra="forbid", **_STRICT)

    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False


class _CheckedFields(BaseModel):
    """A request body whose fields are checked against OpenAI's and SGLang's (see
    :mod:`.fields`) before validation: ``endpoint`` names the table."""

    model_config = ConfigDict(extra="forbid", **_STRICT)
    endpoint: ClassVar[str]

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, raw: Any) -> Any:
        return check_fields(raw, cls.model_fields, cls.endpoint)


class _SamplingFields(_CheckedFields):
    model: str | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: StrictBool = False
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: StrictBool = True
    # structured output (OpenAI's response_format; SGLang's regex and ebnf) and logit_bias
    response_format: ResponseFormat | None = None
    regex: str | None = None
    ebnf: str | None = None
    logit_bias: dict[str, float] | None = None
    # prefill/decode disaggregation, SGLang's names (set by a PD router)
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    bootstrap_token: str | None = None  # the router's signature of the pair (kvflow)
    # SGLang: a client-chosen request id (for /abort_request), prefix-cache namespaces
    rid: str | None = None
    extra_key: str | None = None
    cache_salt: str | None = None
    # SGLang: a LoRA adapter's name (else ``model`` as "base:adapter" or the adapter's name)
    lora_path: str | None = None

    @property
    def cache_namespace(self) -> str | None:
        return _namespace(self.extra_key, self.cache_salt)

    def sampling_dict(self, max_new_tokens: int) -> dict[str, Any]:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        values = {
            "max_new_tokens": max_new_tokens,
            "min_new_tokens": self.min_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "stop": stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "seed": self.seed,
            "n": self.n,
            **grammar_sampling(
                self.response_format,
                self.regex,
                self.ebnf,
                getattr(self, "json_schema", None),
                self.logit_bias,
            ),
        }
        return {k: v for k, v in values.items() if v is not None}


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", **_STRICT)

    name: str
    # JSON text, as OpenAI sends it; SGLang also takes the object itself
    arguments: str | dict[str, Any] = "{}"

    @property
    def arguments_text(self) -> str:
        if isinstance(self.arguments, str):
            return self.arguments
        return json.dumps(self.arguments, ensure_ascii=False)


class ToolCall(BaseModel):
    """A call the assistant made earlier in the conversation (``index`` as a streamed
    delta has it, which clients echo back)."""

    model_config = ConfigDict(extra="forbid", **_STRICT)

    id: str | None = None
    index: int | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """One message; fields beyond these are checked by :mod:`.message_fields` first."""

    model_config = ConfigDict(extra="forbid", **_STRICT)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    reasoning_content: str | None = None  # assistant (SGLang)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", **_STRICT)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: StrictBool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", **_STRICT)

    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceName(BaseModel):
    model_config = ConfigDict(extra="forbid", **_STRICT)

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", **_STRICT)

    type: Literal["function"] = "function"
    function: ToolChoiceName


class ChatCompletionRequest(_SamplingFields):
    endpoint: ClassVar[str] = "chat"

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # tools (OpenAI); ``tool_choice`` defaults to "auto" with tools, "none" without
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    # chat template and reasoning (SGLang)
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    separate_reasoning: StrictBool = True
    stream_reasoning: StrictBool = True
    # SGLang/vLLM: the last message is the assistant's, to be continued (not answered);
    # vLLM's add_generation_prompt (default: true unless continuing) cannot be true with it
    continue_final_message: StrictBool = False
    add_generation_prompt: StrictBool | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_message_fields(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and "messages" in raw:
            return {**raw, "messages": check_messages(raw["messages"])}
        return raw


class CompletionRequest(_SamplingFields):
    endpoint: ClassVar[str] = "completions"

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    json_schema: str | None = None  # SGLang: a JSON schema as a string
    echo: StrictBool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)


class GenerateRequestBody(_CheckedFields):
    """SGLang's native ``/generate`` body (``GenerateReqInput``); the SGLang fields it does
    not declare are ignored or refused by :mod:`.fields`."""

    endpoint: ClassVar[str] = "generate"

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: StrictBool = False
    return_logprob: StrictBool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = Field(default=0, ge=0, le=20)
    return_text_in_logprobs: StrictBool = False
    extra_key: str | None = None
    cache_salt: str | None = None
    rid: str | None = None
    # prefill/decode disaggregation, SGLang's names: one value, or one per prompt of a batch
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int] | None = None
    bootstrap_room: int | list[int] | None = None
    bootstrap_token: str | list[str] | None = None  # the router's signature of each pair
    # not SGLang's, but its router adds it to every body; ignored (one model per server)
    model: str | None = None
    # SGLang's: a LoRA adapter's name for every prompt, or one per prompt (None: the base)
    lora_path: str | list[str | None] | None = None

    @property
    def cache_namespace(self) -> str | None:
        return _namespace(self.extra_key, self.cache_salt)


class EmbeddingRequest(BaseModel):
    """OpenAI's ``/v1/embeddings`` body (``dimensions`` is refused unless null: no
    Matryoshka truncation)."""

    model_config = ConfigDict(extra="forbid", **_STRICT)

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # an end-user id for the caller's own records


class EncodeRequestBody(BaseModel):
    """SGLang's native ``/encode`` body (``EmbeddingReqInput``): ``text`` or ``input_ids``,
    one prompt or a batch."""

    model_config = ConfigDict(extra="forbid", **_STRICT)

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    rid: str | None = None  # names a single prompt
    model: str | None = None  # added by SGLang's router; ignored (one model per server)
