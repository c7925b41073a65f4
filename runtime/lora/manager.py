"""The adapters of one model runner: the host registry, the device slots, the wrapped
projections, and the adapter layout of each forward."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from kvflow.runtime.forward_batch import ForwardBatch
from kvflow.runtime.layers import LinearBase
from kvflow.runtime.lora.adapter import LoraAdapter, LoraLimits, load_adapter
from kvflow.runtime.lora.batch import LOOP_SEGMENTS, MASKED_ROWS, LoraBatch
from kvflow.runtime.lora.layers import LoraContext, LoraLinear
from kvflow.runtime.lora.options import LoraOptions, parse_lora_paths
from kvflow.runtime.lora.slots import LoraSlots
from kvflow.runtime.lora.targets import LORA_TARGETS, resolve_target_modules

__all__ = ["LoraManager"]
logger = logging.getLogger(__name__)


def _unbounded_limits(model_limits: LoraLimits) -> LoraLimits:
    return LoraLimits(
        1 << 30,
        frozenset(LORA_TARGETS),
        model_limits.num_layers,
        model_limits.in_features,
        model_limits.out_features,
    )


class LoraManager:
    """Adapters by name in host memory, ``max_loras_per_batch`` device slots of
    ``max_lora_rank`` (LRU), and every targeted projection of ``model`` wrapped in a
    :class:`LoraLinear`. Not thread-safe: the scheduler's loop drives it.

    :meth:`active` runs one forward with its requests' adapters (``fb.lora_paths``) in
    slots; the scheduler admits no batch with more adapters than slots
    (:meth:`fits`)."""

    def __init__(
        self, model: nn.Module, options: LoraOptions, dtype: torch.dtype, device: str
    ) -> None:
        self.dtype, self.device = dtype, device
        layers = model.get_submodule("layers")
        assert isinstance(layers, nn.ModuleList), "a decoder stack (CausalLM.layers)"
        startup = parse_lora_paths(options.lora_paths)
        probe = self._shape_limits(layers, frozenset(LORA_TARGETS))
        read = [load_adapter(name, path, _unbounded_limits(probe)) for name, path in startup]
        max_rank = options.max_lora_rank or max((a.rank for a in read), default=0)
        if options.lora_target_modules:
            targets = resolve_target_modules(options.lora_target_modules)
        else:
            targets = frozenset().union(*(a.target_modules for a in read))
        if not max_rank or not targets:
            raise ValueError(
                "--enable-lora without start-up adapters (--lora-paths) needs "
                "--max-lora-rank and --lora-target-modules"
            )
        self.limits = self._shape_limits(layers, targets, max_rank)
        self.context = LoraContext()
        self.wrapped = self._wrap(layers, targets, options.max_loras_per_batch, max_rank)
        self.slots = LoraSlots(options.max_loras_per_batch)
        # each slot's adapter rank, read by the kernels (a slot never written: rank 0, no work)
        self.slot_ranks = torch.zeros(options.max_loras_per_batch, dtype=torch.int32, device=device)
        self.adapters: dict[str, LoraAdapter] = {}
        for name, path in startup:
            self.load(name, path)
        if torch.device(device).type == "cuda":
            self.warm_kernels()

    # -- model surgery ---------------------------------------------------------------------
    @staticmethod
    def _shape_limits(
        layers: nn.ModuleList, targets: frozenset[str], max_rank: int = 1
    ) -> LoraLimits:
        """The input width and output rows of each targeted module (layer 0's shapes; a
        layer where a target is not a dense projection is refused by :meth:`_wrap`)."""
        in_features, out_features = {}, {}
        for module in targets:
            target = LORA_TARGETS[module]
            layer = layers[0].get_submodule(target.layer)
            if isinstance(layer, LoraLinear):
                layer = layer.base
            if isinstance(layer, LinearBase):  # the whole projection's: adapters are
                in_features[module] = layer.whole_input_size
                out_features[module] = layer.whole_output_size(target.shard)
        return LoraLimits(max_rank, targets, len(layers), in_features, out_features)

    def _wrap(
        self, layers: nn.ModuleList, targets: frozenset[str], num_slots: int, max_rank: int
    ) -> dict[tuple[int, str], LoraLinear]:
        wrapped: dict[tuple[int, str], LoraLinear] = {}
        paths = sorted({LORA_TARGETS[m].layer for m in targets})
        on_cuda = str(self.device).startswith("cuda")
        for layer_id, layer in enumerate(layers):
            for path in paths:
                parent_path, _, attr = path.rpartition(".")
                parent = layer.get_submodule(parent_path)
                base = getattr(parent, attr, None)
                if not isinstance(base, LinearBase):
                    raise ValueError(
                        f"layer {layer_id}'s {path} is not a dense projection (mixture-of-"
                        "experts MLPs take no adapters): narrow --lora-target-modules"
                    )
                lora = LoraLinear(
                    base, self.context, num_slots, max_rank, self.dtype, self.device,
                    join_base=on_cuda,
                )  # fmt: skip
                setattr(parent, attr, lora)
                wrapped[(layer_id, path)] = lora
            if on_cuda:
                # NOTE: a joined projection leaves its old weight's memory free in torch's
                # cache; the next layer's joint buffers could be cut out of those blocks,
                # and what is left of a block cannot go back to the driver for the KV pool
                # (sized after this). Returned a layer at a time, the old weights never mix
                # with the new buffers.
                torch.cuda.empty_cache()
        return wrapped

    def warm_kernels(self) -> None:
        """Run each wrapped projection's LoRA kernels once in every eager layout that
        reaches Triton (past :data:`~kvflow.runtime.lora.batch.LOOP_SEGMENTS` adapter
        segments and :data:`~kvflow.runtime.lora.batch.MASKED_ROWS` rows: the segmented
        kernels, with segments of up to 16, 32 and more rows), on scratch inputs and
        outputs, so that Triton compiles them at start-up: on an H200 the first prefill
        that took them stalled serving for ~4.5 s while they compiled. Decode graphs
        compile theirs at capture."""

        def alternating(rows: list[int]) -> tuple[list[int], list[int]]:
            return [(0, -1)[i % 2] for i in range(len(rows))], rows  # slot 0, the base model

        many = 2 * (LOOP_SEGMENTS + 1)
        layouts = [alternating([n] * max(many, MASKED_ROWS // n + 1)) for n in (16, 32)]
        layouts.append(alternating([MASKED_ROWS + 1] + [1] * (many - 1)))
        shapes: dict[str, LoraLinear] = {}
        for (_, path), lora in self.wrapped.items():  # (every layer's shapes are layer 0's)
            shapes.setdefault(path, lora)
        for slots, rows in layouts:
            batch = LoraBatch.of(slots, rows, self.device, self.slot_ranks)
            assert batch is not None
            for lora in shapes.values():
                x = torch.zeros(
                    sum(rows), lora.a_slots.shape[2], dtype=self.dtype, device=self.device
                )
                out = x.new_zeros(sum(rows), lora.b_slots.shape[1])
                batch.add_delta(x, out, lora.weights)

    # -- the registry ----------------------------------------------------------------------
    def load(self, name: str, path: str) -> LoraAdapter:
        """Read an adapter into host memory under ``name``; raises ValueError (a bad
        adapter, one this server cannot apply, or a name in use)."""
        return self.add(self.read(name, path))

    def read(self, name: str, path: str) -> LoraAdapter:
        """Read and check an adapter without registering it: touches nothing the loop
        uses, so it may run on another thread (:meth:`add` registers it afterwards)."""
        if name in self.adapters:
            raise ValueError(f"a LoRA adapter named {name!r} is loaded already; unload it first")
        return load_adapter(name, path, self.limits)

    def add(self, adapter: LoraAdapter) -> LoraAdapter:
        """Register an adapter :meth:`read` returned; ValueError when its name is in use."""
        if adapter.name in self.adapters:
            raise ValueError(
                f"a LoRA adapter named {adapter.name!r} is loaded already; unload it first"
            )
        self.adapters[adapter.name] = adapter
        logger.info(
            "LoRA adapter %s loaded from %s (rank %d)", adapter.name, adapter.path, adapter.rank
        )
        return adapter

    def unload(self, name: str) -> None:
        """Forget an adapter (the caller checks that no request uses it)."""
        if name not in self.adapters:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded")
        del self.adapters[name]
        self.slots.drop(name)
        logger.info("LoRA adapter %s unloaded", name)

    def key_of(self, name: str) -> str:
        """The prefix-cache namespace of requests on adapter ``name``."""
        if name not in self.adapters:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded")
        return f"lora:{self.adapters[name].key}"

    def fits(self, names: set[str | None]) -> bool:
        """Whether a batch of requests on these adapters (None: the base model) gets a
        slot for each."""
        return len(names - {None}) <= self.slots.num_slots

    # -- one forward -----------------------------------------------------------------------
    def _write(self, adapter: LoraAdapter, slot: int) -> None:
        for lora in self.wrapped.values():
            lora.clear_slot(slot)
        # NOTE: a fill queued on the stream (no host sync), ordered with the weights' copies
        self.slot_ranks[slot] = adapter.rank
        for (layer_id, module), (a, b) in adapter.weights.items():
            target = LORA_TARGETS[module]
            lora = self.wrapped[(layer_id, target.layer)]
            lora.write_slot(
                slot, target.shard, a.to(lora.a_slots), (b * adapter.scaling).to(lora.b_slots)
            )

    def assign_slots(self, fb: ForwardBatch) -> list[int] | None:
        """Each request's device slot for ``fb`` (-1: the base model), its adapters loaded
        into slots on a miss (evicting the least recently used ones the batch does not
        need); None when no request names an adapter."""
        names = [n for n in fb.lora_paths if n is not None]
        if not names:
            return None
        for name in names:
            if name not in self.adapters:
                raise ValueError(f"no LoRA adapter named {name!r} is loaded")
        plan = self.slots.plan(names)
        for name, slot in plan.loads:
            self._write(self.adapters[name], slot)
        return [-1 if n is None else plan.slots[n] for n in fb.lora_paths]

    @contextmanager
    def active(self, fb: ForwardBatch) -> Iterator[None]:
        """Run one eager forward with ``fb``'s adapters in device slots
        (:meth:`assign_slots`); decode CUDA graphs use :class:`~kvflow.runtime.lora.graph.LoraGraphInputs`."""
        slots = self.assign_slots(fb)
        if slots is None:
            yield
            return
        rows = [1] * fb.batch_size if fb.is_decode else fb.extend_seq_lens_cpu
        self.context.batch = LoraBatch.of(
            slots, rows, self.device, self.slot_ranks,
            num_slots=self.slots.num_slots, dtype=self.dtype,
        )  # fmt: skip
        try:
            yield
        finally:
            self.context.batch = None
