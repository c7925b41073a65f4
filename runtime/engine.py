"""The offline Python API: ``kvflow.Engine(...).generate(...)`` with the scheduler in-process."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvflow.runtime.config import EngineConfig
from kvflow.runtime.detokenizer import TextStream
from kvflow.runtime.distributed import TPGroup
from kvflow.runtime.distributed.lockstep import TPLockstep
from kvflow.runtime.model_runner import ModelRunner
from kvflow.runtime.scheduler import Req, ReqFactory, Scheduler
from kvflow.runtime.tokenizer import load_tokenizer, tokenizer_folder
from kvflow.runtime.wire import FinishReason, GenerateRequest, SamplingParams, TokenOutput

__all__ = ["Engine", "GenerateResult", "Usage"]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class GenerateResult:
    """One generated sequence (``n`` of them per prompt when ``n > 1``)."""

    text: str
    output_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)

    @property
    def cached_tokens(self) -> int:
        return self.usage.cached_tokens


class Engine:
    """An engine instance: model, KV memory and scheduler in this process.

    ``Engine()`` serves the embedded SmolLM2-135M-Instruct; keyword arguments are
    :class:`~kvflow.runtime.config.EngineConfig` fields. With ``tp`` (this process's
    :class:`~kvflow.runtime.distributed.TPGroup`, ``tp_size`` its size) the engine is one
    rank: every rank's process makes the same calls in the same order, and each gets the
    same results. Its scheduler's clock then stands still (lpm does not age requests).
    """

    def __init__(
        self, model_path: str | None = None, tp: TPGroup | None = None, **kwargs: Any
    ) -> None:
        self.config = EngineConfig(model_path=model_path, **kwargs).resolved()
        self.runner = ModelRunner(self.config, tp)
        lockstep = None if tp is None else TPLockstep(tp)
        self.scheduler = Scheduler(self.config, self.runner, lockstep=lockstep)
        folder = tokenizer_folder(
            self.config.tokenizer_path, self.config.skip_tokenizer_init, self.runner.model_path
        )
        self.tokenizer = None if folder is None else load_tokenizer(folder)
        self.reqs = ReqFactory(
            self.config,
            self.runner.model_config,
            self.tokenizer,
            self.runner.device,
            self.runner.pooling,
            self.runner.lora,
        )
        self._rids = itertools.count()

    # -- public API ------------------------------------------------------------------------
    def generate(
        self,
        prompt: str | Sequence[str] | None = None,
        sampling_params: Mapping[str, Any]
        | SamplingParams
        | Sequence[Mapping[str, Any]]
        | None = None,
        input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        extra_key: str | None = None,
        lora_path: str | Sequence[str | None] | None = None,
    ) -> GenerateResult | list[GenerateResult]:
        """Generate for one prompt (returns a result, or ``n`` results) or a list of prompts
        (returns a flat list, ``n`` per prompt, in order). All prompts run together:
        continuous batching in one scheduler. ``lora_path``: a loaded LoRA adapter's name
        for every prompt, or one per prompt (None: the base model).
        """
        single, prompts = self._normalize_inputs(prompt, input_ids)
        params_list = self._normalize_params(sampling_params, len(prompts))
        adapters = (
            [lora_path] * len(prompts)
            if lora_path is None or isinstance(lora_path, str)
            else list(lora_path)
        )
        if len(adapters) != len(prompts):
            raise ValueError("give one lora_path per prompt, or a single one")
        groups: list[list[Req]] = []
        for ids, params, adapter in zip(prompts, params_list, adapters, strict=True):
            message = GenerateRequest(
                input_ids=ids,
                sampling=params,
                return_logprob=return_logprob,
                top_logprobs_num=top_logprobs_num,
                extra_key=extra_key,
                lora_path=adapter,
            )
            groups.append(self._make_reqs(message))
        results = self._run([req for group in groups for req in group])
        flat = [results[req.rid] for group in groups for req in group]
        if single and params_list[0].n == 1:
            return flat[0]
        return flat

    def embed(self, input_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        """The embedding of each prompt, batched (an engine built with ``is_embedding``):
        its pooled, L2-normalised final hidden state (:mod:`kvflow.runtime.pooling`)."""
        reqs = [
            self._req(
                GenerateRequest(
                    input_ids=list(ids), sampling=SamplingParams().prefill_only(), embed=True
                )
            )
            for ids in input_ids
        ]
        for req in reqs:
            self.scheduler.add_request(req)
        embeddings: dict[str, list[float]] = {}
        while len(embeddings) < len(reqs):
            for out in self.scheduler.step():
                if out.finish_reason is not None:
                    if out.embedding is None:
                        raise RuntimeError(f"embedding failed: {out.finish_reason.message}")
                    embeddings[out.rid] = out.embedding
        return [embeddings[req.rid] for req in reqs]

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("the tokenizer was skipped (skip_tokenizer_init)")
        return list(self.tokenizer.encode(text))

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Read a LoRA adapter (PEFT's format) into host memory (needs ``enable_lora``)."""
        if self.runner.lora is None:
            raise ValueError("LoRA adapters need enable_lora=True")
        self.runner.lora.load(lora_name, lora_path)

    def unload_lora_adapter(self, lora_name: str) -> None:
        """Forget an adapter; refused while requests on it are queued or running."""
        if self.runner.lora is None:
            raise ValueError("LoRA adapters need enable_lora=True")
        if self.scheduler.requests_on_adapter(lora_name):
            raise ValueError(f"LoRA adapter {lora_name!r} has requests in flight")
        self.runner.lora.unload(lora_name)

    def flush_cache(self) -> bool:
        return self.scheduler.flush_cache()

    def is_memory_free(self) -> bool:
        """True when no request holds KV memory or a request row (the leak check)."""
        spec = self.scheduler.spec
        return (
            not self.scheduler.has_work()
            and self.scheduler.kv.is_fully_free()
            and (spec is None or spec.is_memory_free())
        )

    # -- internals -------------------------------------------------------------------------
    def _normalize_inputs(self, prompt, input_ids) -> tuple[bool, list[list[int]]]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt and input_ids")
        if prompt is not None:
            if isinstance(prompt, str):
                return True, [self.encode(prompt)]
            return False, [self.encode(p) for p in prompt]
        assert input_ids is not None
        if input_ids and isinstance(input_ids[0], int):
            return True, [list(input_ids)]  # type: ignore[arg-type]
        return False, [list(ids) for ids in input_ids]  # type: ignore[union-attr]

    @staticmethod
    def _normalize_params(params, count: int) -> list[SamplingParams]:
        if isinstance(params, SamplingParams):
            return [params] * count
        if params is None or isinstance(params, Mapping):
            return [SamplingParams.from_dict(params)] * count
        if len(params) != count:
            raise ValueError("give one sampling_params per prompt, or a single one")
        return [p if isinstance(p, SamplingParams) else SamplingParams.from_dict(p) for p in params]

    def _make_reqs(self, message: GenerateRequest) -> list[Req]:
        vocab, params = self.runner.vocab_size, message.sampling
        if any(not 0 <= t < vocab for t in message.input_ids):
            raise ValueError(f"input token ids must be in [0, {vocab})")
        params.validate(vocab)
        samples = params.expand_n()
        if len(samples) > 1:
            # Prefill the shared prompt once; the n samples then hit the prefix cache.
            warm = replace(message, sampling=params.prefill_only(), return_logprob=False)
            self._run([self._req(warm)])
        return [self._req(replace(message, sampling=s)) for s in samples]

    def _req(self, message: GenerateRequest) -> Req:
        return self.reqs.make(replace(message, rid=f"req-{next(self._rids)}"))

    def _run(self, reqs: list[Req]) -> dict[str, GenerateResult]:
        for req in reqs:
            self.scheduler.add_request(req)
        by_rid = {req.rid: req for req in reqs}
        streams = {req.rid: self._text_stream(req) for req in reqs}
        results: dict[str, GenerateResult] = {}
        while len(results) < len(reqs):
            for out in self.scheduler.step():
                if out.rid in by_rid and out.finish_reason is not None:
                    results[out.rid] = self._result(by_rid[out.rid], out, streams[out.rid])
        return results

    def _text_stream(self, req: Req) -> TextStream | None:
        if self.tokenizer is None:
            return None
        return TextStream(
            self.tokenizer,
            req.origin_input_ids,
            req.sampling.stop,
            req.sampling.skip_special_tokens,
        )

    @staticmethod
    def _result(req: Req, out: TokenOutput, stream: TextStream | None) -> GenerateResult:
        assert out.finish_reason is not None
        text = ""
        if stream is not None:
            stream.finish(req.output_ids, out.finish_reason.matched)
            text = stream.text
        usage = Usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens)
        return GenerateResult(
            text,
            list(req.output_ids),
            out.finish_reason,
            usage,
            list(req.output_logprobs),
            list(req.output_top_logprobs),
        )
