"""SGLang's LoRA routes: ``POST /load_lora_adapter`` and ``POST /unload_lora_adapter``
while serving, and the adapters' cards in ``/v1/models``."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from kvflow.runtime.server.tokenizer_manager import TokenizerManager

__all__ = ["adapter_cards", "add_lora_routes"]


class LoadLoraAdapterBody(BaseModel):
    """SGLang's ``LoadLoRAAdapterReqInput`` (``pinned`` is accepted: every adapter may be
    evicted from its device slot here, never from host memory)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    lora_name: str
    lora_path: str
    pinned: bool = False


class UnloadLoraAdapterBody(BaseModel):
    """SGLang's ``UnloadLoRAAdapterReqInput``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    lora_name: str


def _reply(tm: TokenizerManager) -> dict[str, Any]:
    # SGLang's LoadLoRAAdapterReqOutput
    return {"success": True, "error_message": "", "loaded_adapters": dict(tm.lora_adapters)}


def adapter_cards(tm: TokenizerManager, created: int = 0) -> list[dict[str, Any]]:
    """One ``/v1/models`` entry per loaded adapter, SGLang's shape (``parent``: the base)."""
    return [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "kvflow",
            "root": path,
            "parent": tm.args.model_name,
            "max_model_len": tm.context_len,
        }
        for name, path in sorted(tm.lora_adapters.items())
    ]


def add_lora_routes(app: FastAPI, tm: TokenizerManager) -> None:
    @app.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraAdapterBody) -> dict[str, Any]:
        await tm.load_lora_adapter(body.lora_name, body.lora_path)
        return _reply(tm)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraAdapterBody) -> dict[str, Any]:
        await tm.unload_lora_adapter(body.lora_name)
        return _reply(tm)
