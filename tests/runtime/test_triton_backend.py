"""The Triton attention backend inside the engine equals the torch backend, token for token,
with the KV cache in the model's dtype and in FP8 (``--kv-cache-dtype fp8_e4m3``).

Runs anywhere: on CPU the kernels execute under Triton's interpreter (``TRITON_INTERPRET=1``
must be set before triton is imported, so this runs in a subprocess) on a tiny random
Llama-shaped model; on a GPU machine the same script runs the compiled kernels.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, sys, tempfile, pathlib
    import torch
    from kvflow.runtime.engine import Engine
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 256, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "eos_token_id": 255}
    folder = pathlib.Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(config))
    prompts = [[(7 * i + 3 * j) % 250 for j in range(5 + 3 * i)] for i in range(4)]
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    outputs = {}
    for kv in ("auto", "fp8_e4m3"):
        for backend in ("torch", "triton"):
            engine = Engine(str(folder), load_format="dummy", skip_tokenizer_init=True,
                            device="cpu", attention_backend=backend, chunked_prefill_size=8,
                            max_total_tokens=512, kv_cache_dtype=kv)
            first = engine.generate(input_ids=prompts, sampling_params=params)
            again = engine.generate(input_ids=prompts, sampling_params=params)  # cache hits
            outputs[f"{backend}-{kv}"] = [r.output_ids for r in first + again]
            assert engine.is_memory_free()
    print(json.dumps(outputs))
""")


def test_triton_backend_matches_torch_backend():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-P", "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    outputs = json.loads(done.stdout.strip().splitlines()[-1])
    assert outputs["triton-auto"] == outputs["torch-auto"]
    # an FP8 KV cache (scales 1.0): both read the same stored values, new tokens' included
    assert outputs["triton-fp8_e4m3"] == outputs["torch-fp8_e4m3"]
