"""Turning an accepted request into :class:`Req` objects: one factory for the in-process
engine and the server's scheduler process, so a request behaves the same on both paths."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from kvflow.runtime.config import EngineConfig, ModelConfig
from kvflow.runtime.core import Req
from kvflow.runtime.grammar import GrammarBackend, grammar_spec
from kvflow.runtime.lora import LoraManager
from kvflow.runtime.pooling import Pool, PoolingType
from kvflow.runtime.scheduler.input_logprobs import InputLogprobs
from kvflow.runtime.wire import GenerateRequest

__all__ = ["ReqFactory", "default_seed"]


def default_seed(engine_seed: int, rid: str) -> int:
    """The seed of a sampled request that names none: stable across processes and runs
    (Python's ``hash`` of a string is not), distinct per request id, 63 bits."""
    digest = hashlib.blake2b(f"{engine_seed}:{rid}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class ReqFactory:
    """Builds the scheduler's requests with the model's stop tokens, the tokenizer used for
    stop strings (only its ``decode`` is used), the seed rule of :func:`default_seed`, and
    ``pooling`` for embedding requests (the model's, on an embedding server).

    ``grammar_tokenizer`` loads the transformers tokenizer grammars compile against, on the
    grammar pool at the first constrained request (default: ``tokenizer`` itself); the
    server's scheduler decodes with the lighter ``tokenizers`` one and loads transformers'
    only then."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        tokenizer: Any,
        device: str,
        pooling: PoolingType | None = None,
        lora: LoraManager | None = None,
        grammar_tokenizer: Callable[[], Any] | None = None,
    ) -> None:
        self.config = config
        self.lora = lora  # the runner's adapters (--enable-lora)
        self.pooling = pooling
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.grammar_tokenizer = grammar_tokenizer or (lambda: tokenizer)
        self.device = device
        self._grammars: GrammarBackend | None = None  # built for the first constrained request

    @property
    def grammars(self) -> GrammarBackend:
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("structured output needs the tokenizer (skip_tokenizer_init)")
            self._grammars = GrammarBackend(
                self.grammar_tokenizer,
                self.model_config.vocab_size,
                self.model_config.eos_token_ids,
            )
        return self._grammars

    def make(self, message: GenerateRequest) -> Req:
        """The scheduler's request for a named message (prompt logprobs and the grammar
        set up as it asks)."""
        req = Req(
            message,
            eos_token_ids=self.model_config.eos_token_ids,
            tokenizer=self.tokenizer,
            device=self.device,
            seed=default_seed(self.config.seed, message.request_id),
        )
        if message.lora_path is not None:
            if self.lora is None:
                raise ValueError("LoRA adapters are not enabled on this server (--enable-lora)")
            # the same tokens under two adapters are different KV: one namespace each
            namespace = (message.extra_key, self.lora.key_of(message.lora_path))
            req.extra_key = "\x00".join(part for part in namespace if part is not None)
        start = message.logprob_start_len
        if message.return_logprob and 0 <= start < len(message.input_ids):
            req.input_logprobs = InputLogprobs(
                start, req.origin_input_ids, message.top_logprobs_num
            )
        if message.embed:
            if self.pooling is None:
                raise ValueError("this server does not serve embeddings (--is-embedding)")
            req.pool = Pool(self.pooling)
        spec = grammar_spec(message.sampling)
        if spec is not None:  # compiles on the backend's pool; the scheduler waits for it
            req.grammar = self.grammars.request(spec)
        return req
