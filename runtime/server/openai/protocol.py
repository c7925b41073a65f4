"""Request schemas of the OpenAI-compatible API (responses are built as plain dicts).

Fields beyond OpenAI's (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``min_tokens``, ``stop_token_ids``, ``skip_special_tokens``) follow SGLang and vLLM.
Unknown fields are ignored, as OpenAI clients add their own; wrongly typed ones are 400.
Types are strict, as OpenAI's are: numbers given as strings, floats where integers go,
booleans where numbers go and non-finite floats (``NaN``, ``Infinity``) are refused.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from kvflow.runtime.server.openai.structured import ResponseFormat, grammar_sampling

__all__ = ["ChatCompletionRequest", "CompletionRequest", "GenerateRequestBody", "StreamOptions"]


_STRICT = ConfigDict(strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: StrictBool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore", **_STRICT)

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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", **_STRICT)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    json_schema: str | None = None  # SGLang: a JSON schema as a string
    echo: StrictBool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)


_SGLANG_OUTPUT_SWITCHES = (
    "return_text_in_logprobs",
    "return_hidden_states",
    "return_entropy",
    "return_bytes",
    "background",
)


class GenerateRequestBody(BaseModel):
    """SGLang's native ``/generate`` body."""

    model_config = ConfigDict(extra="forbid", **_STRICT)

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: StrictBool = False
    return_logprob: StrictBool = False
    top_logprobs_num: int = Field(default=0, ge=0, le=20)
    extra_key: str | None = None
    rid: str | None = None
    # prefill/decode disaggregation, SGLang's names: one value, or one per prompt of a batch
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int] | None = None
    bootstrap_room: int | list[int] | None = None
    # SGLang's own fields that its router (sglang-router 0.3.2) always sends: ``model`` and
    # the logging switches are ignored; the others ask for outputs kvflow does not produce, so
    # only their default (false) is accepted (``prepare_native`` refuses true).
    model: str | None = None
    log_metrics: StrictBool = True
    no_logs: StrictBool = False
    return_text_in_logprobs: StrictBool = False
    return_hidden_states: StrictBool = False
    return_entropy: StrictBool = False
    return_bytes: StrictBool = False
    background: StrictBool = False

    def unsupported_flags(self) -> list[str]:
        """The SGLang output switches set to true, which kvflow does not implement."""
        return [f for f in _SGLANG_OUTPUT_SWITCHES if getattr(self, f)]
