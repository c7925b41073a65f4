"""Tiny random-weight Llama configs for speculative decoding's tests (a target and drafts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from eagle_checkpoints import TINY, write_eagle3_head, write_eagle_head


def write_config(folder: Path, **overrides) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**TINY, **overrides}))
    return str(folder / "config.json")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """``target``: the tiny config; ``shallow``: the same shapes with one layer (other random
    weights: a draft that is often wrong); ``two-layer``: with two."""
    root = tmp_path_factory.mktemp("spec-models")
    return {
        "target": write_config(root / "target"),
        "shallow": write_config(root / "shallow", num_hidden_layers=1),
        "two-layer": write_config(root / "two-layer", num_hidden_layers=2),
    }


@pytest.fixture
def tiny_engine():
    """Build engines on a tiny config with random weights (``load_format="dummy"``)."""
    from kvflow.runtime.engine import Engine

    def build(path: str, **kwargs):
        # float32: in bfloat16 a verify (extend) row and a decode row of the same position
        # may round to another argmax, and these tests compare token for token
        settings = dict(
            load_format="dummy",
            skip_tokenizer_init=True,
            device="cpu",
            dtype="float32",
            max_total_tokens=2048,
        )
        return Engine(path, **{**settings, **kwargs})

    return build


@pytest.fixture(scope="session")
def eagle_head_writer():
    """:func:`write_eagle_head`, for tests that need a head of other shapes."""
    return write_eagle_head


@pytest.fixture(scope="session")
def eagle_heads(tmp_path_factory) -> dict[str, str]:
    """EAGLE heads for the tiny target: ``random`` (often wrong), ``identity`` (see
    :func:`write_eagle_head`), ``wide`` (hidden size 32: refused); EAGLE-3 heads with a
    48-token vocabulary (``eagle3``) and with the target's (``eagle3-full-vocab``)."""
    root = tmp_path_factory.mktemp("eagle-heads")
    return {
        "random": write_eagle_head(root / "random"),
        "identity": write_eagle_head(root / "identity", identity=True),
        "wide": write_eagle_head(root / "wide", hidden_size=32, intermediate_size=64),
        "eagle3": write_eagle3_head(root / "eagle3"),
        "eagle3-full-vocab": write_eagle3_head(root / "eagle3-full", draft_vocab_size=None),
    }


def write_echo_target(folder: Path, seed: int = 1) -> str:
    """A tiny Llama checkpoint whose attention and MLP add nothing (``o_proj`` and
    ``down_proj`` zero, final norm of ones): its next token depends on the last token only,
    ``argmax(lm_head(embed(t)))``, the token an :func:`write_echo_head` head drafts."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    tensors = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for name, value in tensors.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            value.zero_()
    tensors["model.norm.weight"] = torch.ones(TINY["hidden_size"])
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(TINY))
    return str(folder)


def write_echo_head(folder: Path, sharpness: float = 2000.0) -> str:
    """An EAGLE head that drafts what :func:`write_echo_target` emits: ``fc`` passes the
    token's embedding (times ``sharpness``: a confident head) and the layer adds nothing,
    so its logits are the target's LM head on the embedding (the target's final norm of
    ones only rescales them): the first choice is always right."""
    import torch
    from safetensors.torch import load_file, save_file

    path = write_eagle_head(folder, identity=True)
    tensors = load_file(str(folder / "model.safetensors"))
    hidden = TINY["hidden_size"]
    eye = torch.eye(hidden) * sharpness
    tensors["fc.weight"] = torch.cat((eye, torch.zeros(hidden, hidden)), 1)
    save_file(tensors, str(folder / "model.safetensors"))
    return path


@pytest.fixture(scope="session")
def echo_models(tmp_path_factory) -> dict[str, str]:
    """``target``: :func:`write_echo_target`; ``head``: :func:`write_echo_head`."""
    root = tmp_path_factory.mktemp("echo")
    return {"target": write_echo_target(root / "target"), "head": write_echo_head(root / "head")}
