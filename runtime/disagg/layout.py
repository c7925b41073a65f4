"""What a peer must know about a KV pool to write into it: shapes, dtype and addresses.

A decode instance sends its :class:`KVLayout` to the prefill at registration; the prefill
refuses a layout whose shape differs from its own (:meth:`KVLayout.mismatch`) instead of
writing bytes that would decode as garbage KV, and the decode refuses the prefill's answer
likewise. ``dtype`` is the KV as stored (``--kv-cache-dtype``): an FP8 pool moves one byte
per element, and a bfloat16 peer of an FP8 one is refused. FP8 scales come with the model's
checkpoint on both sides and are not compared (as the weights are not).

Under EAGLE / EAGLE3 the pool has one more buffer: the target's features, one row per KV
slot (``ModelRunner.hidden_pool``), which the decode's head reads of the prompt. They
travel with the KV, slot for slot; ``features`` names what a row holds (which states, how
wide, which dtype), and peers must agree on it as on the KV's shape: a decode that drafts
with EAGLE paired with a prefill that keeps no features (or another head's) is refused at
registration, so its requests fail with the reason instead of drafting from zeros.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from kvflow.runtime.config import ModelConfig
    from kvflow.runtime.mem import KVPool

__all__ = ["FeatureBuffer", "KVLayout", "Region", "layout_of", "model_fingerprint"]


class FeatureBuffer(NamedTuple):
    """An EAGLE target's features as the layout describes them: ``buffer`` is a contiguous
    ``[num_slots, width]`` tensor, ``kind`` what a row holds (``FeatureSpec.label``)."""

    kind: str
    buffer: Any


class Region(NamedTuple):
    """One contiguous buffer of the pool, as a transport registers it."""

    ptr: int
    nbytes: int


def model_fingerprint(config: ModelConfig) -> str:
    """A readable identity of the model's KV shape and vocabulary (not of its weights)."""
    return (
        f"{config.architecture}:layers={config.num_layers}:kv_heads={config.num_kv_heads}"
        f":head_dim={config.head_dim}:vocab={config.vocab_size}"
    )


# Fields two peers must agree on, in the order a mismatch is reported: the specific shape
# fields first, so a different layer count is named as such and not as "model".
_COMPARED = (
    ("num_layers", "layers"),
    ("num_kv_heads", "kv heads"),
    ("head_dim", "head_dim"),
    ("dtype", "dtype"),
    ("page_size", "page size"),
    ("slot_bytes", "bytes per slot"),
    ("model", "model"),
    ("features", "EAGLE features per slot"),
)
_HINTS = {
    "dtype": ": start prefill and decode with the same --kv-cache-dtype (and --dtype)",
    "slot_bytes": ": start prefill and decode with the same --kv-cache-dtype (and --dtype)",
    "features": (
        ": start prefill and decode with the same --speculative-algorithm (EAGLE, EAGLE3) "
        "and --speculative-draft-model-path"
    ),
}
# (name, default) of the fields a layout without features leaves out of its dict, so a
# peer that predates them reads it as before
_FEATURE_FIELDS = (("features", ""), ("feature_bytes", 0), ("feature_addr", 0))


@dataclass(frozen=True)
class KVLayout:
    """The KV pool of one instance, for transfer: per layer a K and a V buffer of
    ``num_slots`` slots, each slot ``slot_bytes`` bytes (``[kv_heads, head_dim]`` of
    ``dtype``), slot ``i`` of layer ``l``'s K at ``k_addrs[l] + i * slot_bytes``.

    Addresses and ``num_slots`` are the instance's own; everything else must equal the
    peer's. ``page_size`` is the allocator's page size: slot indices are token slots.
    Under tensor parallelism it is one rank's pool: ``num_kv_heads`` (and ``slot_bytes``)
    are that rank's share, ``model`` names the model's own head count.

    ``features`` (EAGLE targets; empty: none): what the feature buffer at ``feature_addr``
    holds, ``feature_bytes`` per slot, slot ``i`` at ``feature_addr + i * feature_bytes``.
    """

    model: str
    dtype: str
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    slot_bytes: int
    k_addrs: tuple[int, ...]
    v_addrs: tuple[int, ...]
    num_slots: int
    features: str = ""
    feature_bytes: int = 0
    feature_addr: int = 0

    def __post_init__(self) -> None:
        if len(self.k_addrs) != self.num_layers or len(self.v_addrs) != self.num_layers:
            raise ValueError(
                f"KVLayout has {len(self.k_addrs)} K and {len(self.v_addrs)} V addresses "
                f"for {self.num_layers} layers"
            )
        if min(self.page_size, self.slot_bytes, self.num_slots) <= 0:
            raise ValueError("KVLayout page_size, slot_bytes and num_slots must be positive")
        if self.feature_bytes < 0 or bool(self.features) != (self.feature_bytes > 0):
            raise ValueError("KVLayout features need a positive feature_bytes, and only they")

    @property
    def buffer_bytes(self) -> int:
        """Bytes of one layer's K (or V) buffer."""
        return self.num_slots * self.slot_bytes

    def regions(self) -> list[Region]:
        """Every K and V buffer, layer by layer, then the features' (if any): what a
        transport must register."""
        kv = [
            Region(addr, self.buffer_bytes)
            for pair in zip(self.k_addrs, self.v_addrs, strict=True)
            for addr in pair
        ]
        if not self.features:
            return kv
        return [*kv, Region(self.feature_addr, self.num_slots * self.feature_bytes)]

    def mismatch(self, other: KVLayout) -> str | None:
        """``None`` when ``other`` can receive this pool's KV (or send into it), else a
        message naming the first differing field, this side's value first."""
        for name, label in _COMPARED:
            mine, theirs = getattr(self, name), getattr(other, name)
            if name == "features":  # (empty: this side keeps none)
                mine, theirs = mine or "none", theirs or "none"
            if mine != theirs:
                hint = _HINTS.get(name, "")
                return (
                    f"KV layout mismatch: {label} differs (local {mine!r}, peer {theirs!r}){hint}"
                )
        return None

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: tuples become lists."""
        raw = asdict(self)
        raw["k_addrs"], raw["v_addrs"] = list(self.k_addrs), list(self.v_addrs)
        if not self.features:
            for name, _ in _FEATURE_FIELDS:
                del raw[name]
        return raw

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> KVLayout:
        names = {f.name for f in fields(cls)}
        values = {name: default for name, default in _FEATURE_FIELDS} | dict(raw)
        if set(values) != names:
            raise ValueError(
                f"KV layout fields {sorted(set(values) ^ names)} are missing or unknown"
            )
        values["features"] = str(values["features"])
        values["feature_bytes"], values["feature_addr"] = (
            int(values["feature_bytes"]),
            int(values["feature_addr"]),
        )
        values["k_addrs"] = tuple(int(a) for a in raw["k_addrs"])
        values["v_addrs"] = tuple(int(a) for a in raw["v_addrs"])
        return cls(**values)


def layout_of(
    kv_pool: KVPool,
    model_config: ModelConfig,
    page_size: int,
    kv_heads: int | None = None,
    features: FeatureBuffer | None = None,
) -> KVLayout:
    """The layout of ``kv_pool`` (its buffers must be contiguous, as :class:`KVPool`
    allocates them), checked against ``model_config``'s KV shape. ``kv_heads``: the KV
    heads the pool holds, a tensor-parallel rank's share (default: all of the model's);
    the fingerprint names the model's. ``features``: an EAGLE target's, one row per slot."""
    k_buffers, v_buffers = kv_pool.k_buffer, kv_pool.v_buffer
    if len(k_buffers) != model_config.num_layers or len(v_buffers) != model_config.num_layers:
        raise ValueError(
            f"KV pool has {len(k_buffers)} layers, the model {model_config.num_layers}"
        )
    kv_heads = model_config.num_kv_heads if kv_heads is None else kv_heads
    first = k_buffers[0]
    expected = (first.shape[0], kv_heads, model_config.head_dim)
    for buf in (*k_buffers, *v_buffers):
        if tuple(buf.shape) != expected or not buf.is_contiguous():
            raise ValueError(
                f"KV buffer of shape {tuple(buf.shape)} (contiguous: {buf.is_contiguous()}) "
                f"does not fit {list(expected)}"
            )
    num_slots = first.shape[0]
    extra: dict[str, Any] = {}
    if features is not None:
        rows = features.buffer
        if rows.dim() != 2 or rows.shape[0] != num_slots or not rows.is_contiguous():
            raise ValueError(
                f"feature buffer of shape {tuple(rows.shape)} does not hold one contiguous "
                f"row per slot of {num_slots}"
            )
        extra = {
            "features": features.kind,
            "feature_bytes": rows[0].numel() * rows.element_size(),
            "feature_addr": rows.data_ptr(),
        }
    return KVLayout(
        model=model_fingerprint(model_config),
        dtype=str(kv_pool.dtype).removeprefix("torch."),
        page_size=page_size,
        num_layers=len(k_buffers),
        num_kv_heads=kv_heads,
        head_dim=model_config.head_dim,
        slot_bytes=first[0].numel() * first.element_size(),
        k_addrs=tuple(buf.data_ptr() for buf in k_buffers),
        v_addrs=tuple(buf.data_ptr() for buf in v_buffers),
        num_slots=num_slots,
        **extra,
    )
