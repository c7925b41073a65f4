"""The shared decoder blocks under another checkpoint layout: a tiny Qwen2 (q/k/v biases,
untied LM head) loads shard by shard and generates what transformers generates."""

from __future__ import annotations

import pytest
import torch

QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "eos_token_id": 299,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(**QWEN2)).to(torch.float32).eval()
    with torch.no_grad():
        for param in hf.parameters():  # larger than the default init: peaked logits
            param.normal_(0, 0.08) if param.dim() > 1 else param.normal_(0, 0.5)
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    hf.save_pretrained(folder)
    return folder, hf


def test_qwen2_layout_matches_transformers(qwen2):
    from kvflow.runtime.engine import Engine

    folder, hf = qwen2
    engine = Engine(str(folder), skip_tokenizer_init=True, dtype="float32", max_total_tokens=1024)
    assert type(engine.runner.model).__name__ == "LlamaForCausalLM"  # Qwen2 maps to Llama
    assert engine.runner.model.layers[0].self_attn.qkv_proj.bias is not None
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 290, (n,), generator=g).tolist() for n in (3, 11, 40)]
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    ours = [r.output_ids for r in engine.generate(input_ids=prompts, sampling_params=params)]
    assert engine.is_memory_free()
    theirs = []
    with torch.no_grad():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12)
            theirs.append(out[0, len(ids) :].tolist())
    assert ours == theirs


def test_a_missing_shard_is_named(qwen2):
    from kvflow.runtime.config import ModelConfig
    from kvflow.runtime.models.llama import LlamaForCausalLM

    folder, hf = qwen2
    model = LlamaForCausalLM(ModelConfig.from_path(folder))
    weights = [(n, t) for n, t in hf.state_dict().items() if "layers.1.self_attn.v_proj" not in n]
    with pytest.raises(KeyError, match=r"layers\.1\.self_attn\.qkv_proj\.(bias|weight)#v"):
        model.load_weights(weights)
    model.load_weights(hf.state_dict().items())  # complete: no error
