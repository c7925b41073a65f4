"""Start-up checks of an EAGLE draft head against its target, from their configs only
(no weights, no torch): run before any process starts and again when the models load;
and which hidden states of the target the head reads (:func:`target_features`)."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from kvflow.runtime.config import EngineConfig, ModelConfig
from kvflow.runtime.models.paths import resolve_model_path
from kvflow.runtime.models.registry import EAGLE_HEADS

__all__ = ["FeatureSpec", "check_draft_model", "target_features"]


class FeatureSpec(NamedTuple):
    """What the target stores per KV slot for its EAGLE head."""

    width: int  # values per slot
    # the layers whose inputs are concatenated, ascending (EAGLE-3); empty: the final-norm
    # hidden state (EAGLE-1/2)
    layers: tuple[int, ...]

    def label(self, dtype: str) -> str:
        """What a slot's row holds, in ``dtype``: two targets whose labels are equal keep
        features one head reads alike (what PD peers compare)."""
        states = "final-norm hidden state" if not self.layers else "inputs of layers "
        states += ",".join(str(layer) for layer in self.layers)
        return f"{states} x{self.width} {dtype}"


def check_draft_model(config: EngineConfig, target: ModelConfig) -> Path | None:
    """The EAGLE / EAGLE-3 head's folder (or, for dummy weights, config file); None for
    the other algorithms. Raises ValueError (one line) for a missing path, a checkpoint
    that is not a head of the algorithm, or one that does not fit the target."""
    algorithm = config.speculative_algorithm
    if algorithm not in EAGLE_HEADS:
        return None
    path = config.speculative_draft_model_path
    if not path:
        raise ValueError(
            f"--speculative-algorithm {algorithm} needs --speculative-draft-model-path"
        )
    flag = f"--speculative-draft-model-path {path}"
    try:
        folder = resolve_model_path(path, config.load_format)
    except FileNotFoundError as err:
        raise ValueError(f"{flag}: {err}") from err
    head = ModelConfig.from_path(folder)
    wanted = EAGLE_HEADS[algorithm]
    if head.architecture not in wanted:
        hint = ""
        if head.architecture == "LlamaForCausalLM":  # how some heads are published
            hint = f"; a head saved as LlamaForCausalLM: set its architectures to {wanted[0]}"
        raise ValueError(
            f"{flag}: {head.architecture} is not a head for --speculative-algorithm "
            f"{algorithm} ({', '.join(wanted)}){hint}"
        )
    weights_at = folder if folder.is_dir() else folder.parent
    if config.load_format != "dummy" and not any(weights_at.glob("*.safetensors")):
        raise ValueError(
            f"{flag}: no *.safetensors in {weights_at} (a head saved as pytorch_model.bin "
            "must be converted to safetensors first)"
        )
    for what, theirs, ours in (
        ("hidden_size", head.hidden_size, target.hidden_size),
        ("vocab_size", head.vocab_size, target.vocab_size),
    ):
        if theirs != ours:
            raise ValueError(f"{flag}: the head's {what} is {theirs}, the target's {ours}")
    if algorithm == "EAGLE3":
        if head.num_layers != 1:
            raise ValueError(f"{flag}: EAGLE-3 heads of {head.num_layers} layers are not built")
        _aux_layers(head, target, flag)
    return folder


def _aux_layers(head: ModelConfig, target: ModelConfig, flag: str) -> tuple[int, ...]:
    """SGLang's rule: the inputs of layers ``id + 1`` for the head's
    ``eagle_aux_hidden_state_layer_ids``, else of layers ``2, n // 2, n - 3``."""
    n = target.num_layers
    if head.eagle_aux_layer_ids is not None:
        layers = [i + 1 for i in head.eagle_aux_layer_ids]
    else:
        layers = [2, n // 2, n - 3]
    if len(set(layers)) != 3 or not all(0 <= i < n for i in layers):
        raise ValueError(
            f"{flag}: EAGLE-3 reads the inputs of target layers {layers}, which a "
            f"{n}-layer target does not have (three distinct ones are needed)"
        )
    return tuple(sorted(layers))


def target_features(config: EngineConfig, target: ModelConfig) -> FeatureSpec | None:
    """What the target keeps per KV slot for ``config``'s EAGLE head (None: no EAGLE)."""
    path = check_draft_model(config, target)
    if path is None:
        return None
    if config.speculative_algorithm == "EAGLE":
        return FeatureSpec(target.hidden_size, ())
    layers = _aux_layers(ModelConfig.from_path(path), target, str(path))
    return FeatureSpec(3 * target.hidden_size, layers)
