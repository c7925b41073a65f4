"""EAGLE and EAGLE-3 heads against transformers references of SGLang's math: the head's
output rows and drafts of a request's first draft step (the head catches up over the whole
request from the target's stored hidden states) match the same layers written with
transformers' Llama modules over the whole sequence, within 1e-4."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

PROMPTS = [[(5 * i + j % (3 + i)) % 90 for j in range(3 + 9 * i)] for i in range(4)]
PARAMS = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def _eagle(tiny_engine, target, head, algorithm="EAGLE"):
    return tiny_engine(
        target,
        speculative_algorithm=algorithm,
        speculative_draft_model_path=head,
        speculative_num_steps=3,
    )


def _watch_first_step(engine) -> dict:
    """Fills, for a request generated alone, its first draft step: ``tokens``, the target's
    ``features`` the head read, the head's ``outputs`` (last row of each forward) and the
    ``drafts``; clear it before the next request."""
    target = engine.runner
    drafter = engine.scheduler.spec.drafter
    propose, draft_ids = drafter.propose, drafter.head.draft_ids
    step: dict = {}

    def spy(reqs, max_drafts):  # the first step of a request: the head catches up over all
        if step:
            return propose(reqs, max_drafts)
        (req,) = reqs
        slots = target.req_to_token.read(req.req_pool_idx, req.seq_len - 1)
        step.update(tokens=req.all_token_ids(), features=target.hidden_pool[slots].clone())
        step["outputs"] = []
        step["drafts"] = propose(reqs, max_drafts)[0]
        return [step["drafts"]]

    def outputs(hidden):
        if "drafts" not in step:
            step["outputs"].append(hidden.clone())
        return draft_ids(hidden)

    drafter.propose, drafter.head.draft_ids = spy, outputs
    return step


def test_random_head_matches_a_transformers_reference(tiny_models, tiny_engine, eagle_heads):
    # SGLang's EAGLE-1/2 math written with transformers' Llama layer over the whole
    # sequence: fc(concat(embed(t[p+1]), f[p])), the layer without its input norm (causal,
    # rotary at p), the target's LM head on the last row; each draft feeds the next
    head = Path(eagle_heads["random"])
    engine = _eagle(tiny_engine, tiny_models["target"], str(head))
    target = engine.runner
    step = _watch_first_step(engine)

    weights = load_file(str(head / "model.safetensors"))
    config = LlamaConfig(**json.loads((head / "config.json").read_text()))
    config._attn_implementation = "sdpa"  # causal without a mask
    layer = LlamaDecoderLayer(config, layer_idx=0)
    layer.load_state_dict(
        {k.removeprefix("layers.0."): v for k, v in weights.items() if k.startswith("layers.")},
        strict=False,
    )
    layer.input_layernorm = torch.nn.Identity()
    rotary = LlamaRotaryEmbedding(config)
    embed = target.model.embed_tokens.weight

    def fc(tokens: list[int], features: torch.Tensor) -> torch.Tensor:
        both = torch.cat((embed[tokens], features), dim=-1)
        return both @ weights["fc.weight"].T + weights["fc.bias"]

    for prompt in PROMPTS:
        step.clear()
        engine.generate(input_ids=prompt, sampling_params=PARAMS)
        drafts, got = step["drafts"], step["outputs"]
        assert len(drafts) == len(got) == 3
        with torch.no_grad():
            rows = fc(step["tokens"][1:], step["features"])
            for draft, have in zip(drafts, got, strict=True):
                positions = torch.arange(rows.shape[0])[None]
                out = layer(rows[None], position_ids=positions,
                            position_embeddings=rotary(rows[None], positions))  # fmt: skip
                want = (out[0] if isinstance(out, tuple) else out)[0, -1:]
                torch.testing.assert_close(have, want, atol=1e-4, rtol=1e-4)
                assert draft == int(target.model.compute_logits(want).argmax())
                rows = torch.cat((rows, fc([draft], want)))
    assert engine.is_memory_free()


def test_eagle3_head_matches_a_transformers_reference(tiny_models, tiny_engine, eagle_heads):
    # SGLang's EAGLE-3 midlayer written with transformers' modules: attention (q/k/v over
    # 2 * hidden) on concat(input_layernorm(embed), hidden_norm(x)), x = fc(features) on
    # catch-up rows and the head's own output after; norm, lm_head and d2t for the token
    head = Path(eagle_heads["eagle3"])
    engine = _eagle(tiny_engine, tiny_models["target"], str(head), "EAGLE3")
    target = engine.runner
    step = _watch_first_step(engine)
    w = load_file(str(head / "model.safetensors"))
    config = LlamaConfig(**json.loads((head / "config.json").read_text()))
    config._attn_implementation = "sdpa"  # causal without a mask
    hidden = config.hidden_size
    wide = LlamaConfig(**{**config.to_dict(), "hidden_size": 2 * hidden, "head_dim": 16})
    wide._attn_implementation = "sdpa"
    attn = LlamaAttention(wide, layer_idx=0)
    attn.o_proj = torch.nn.Linear(attn.o_proj.in_features, hidden, bias=False)
    attn.load_state_dict({k.removeprefix("midlayer.self_attn."): v for k, v in w.items()
                          if k.startswith("midlayer.self_attn.")})  # fmt: skip
    mlp = LlamaMLP(config)
    mlp.load_state_dict({k.removeprefix("midlayer.mlp."): v for k, v in w.items()
                         if k.startswith("midlayer.mlp.")})  # fmt: skip
    norms = {}
    for name in ("midlayer.input_layernorm", "midlayer.hidden_norm",
                 "midlayer.post_attention_layernorm", "norm"):  # fmt: skip
        norms[name] = LlamaRMSNorm(hidden, config.rms_norm_eps)
        norms[name].weight.data.copy_(w[f"{name}.weight"])
    rotary = LlamaRotaryEmbedding(config)
    embed = target.model.embed_tokens.weight
    hot = w["d2t"] + torch.arange(w["d2t"].shape[0])

    def midlayer(embeds: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        both = torch.cat((norms["midlayer.input_layernorm"](embeds),
                          norms["midlayer.hidden_norm"](x)), dim=-1)[None]  # fmt: skip
        positions = torch.arange(x.shape[0])[None]
        out, _ = attn(both, rotary(both, positions), attention_mask=None)
        x = out[0] + x
        return mlp(norms["midlayer.post_attention_layernorm"](x)) + x

    for prompt in PROMPTS:
        step.clear()
        engine.generate(input_ids=prompt, sampling_params=PARAMS)
        drafts, got = step["drafts"], step["outputs"]
        assert len(drafts) == len(got) == 3
        with torch.no_grad():
            tokens = step["tokens"][1:]
            x = step["features"] @ w["fc.weight"].T
            for draft, have in zip(drafts, got, strict=True):
                want = midlayer(embed[tokens], x)[-1:]
                torch.testing.assert_close(have, want, atol=1e-4, rtol=1e-4)
                logits = norms["norm"](want) @ w["lm_head.weight"].T
                assert draft == int(hot[logits.argmax()])
                tokens, x = [*tokens, draft], torch.cat((x, want))
    assert engine.is_memory_free()
