"""Page keys for the shared store: chained page by page, inside a namespace of the model.

A key names the KV of one full page *in its context*: page ``i``'s key hashes page
``i - 1``'s key with page ``i``'s token ids, so equal keys mean equal prefixes, and a key
alone is enough to find a page in the store. Every key starts with the digest of a
:class:`StoreNamespace` (the model's identity and its KV layout), so instances of the same
model share pages and never read another model's::

    <namespace digest, 16 hex>-<chain hash, 32 hex>      e.g. 3f0c...9a-7be1...04

Hashes are BLAKE2b over a canonical encoding (sorted JSON for the namespace, little-endian
int64 for token ids): the same inputs give the same keys in every process and on every host.
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import cached_property

__all__ = ["KEY_SCHEME_VERSION", "StoreNamespace", "page_keys"]

# Part of every namespace digest: a change to the key scheme or to the page object format
# must bump it, so that old pages become unreachable instead of misread.
KEY_SCHEME_VERSION = 1
_CHAIN_BYTES = 16
_NAMESPACE_BYTES = 8


@dataclass(frozen=True)
class StoreNamespace:
    """What must be equal for two instances to exchange KV pages.

    ``tp_rank`` is in the namespace because each tensor-parallel rank stores its own shard of
    a page (its KV heads) under its own key. ``layout`` names how a page's bytes are ordered
    (e.g. ``"page_first"``, as the host pool lays them out); ``kv_bytes_per_token`` is
    optional, a cross-check of the layout's arithmetic.
    """

    model: str
    dtype: str
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layout: str = "page_first"
    tp_size: int = 1
    tp_rank: int = 0
    kv_bytes_per_token: int | None = None

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is outside tp_size {self.tp_size}")

    @cached_property
    def digest(self) -> str:
        """16 hex digits naming the namespace; the first part of each of its keys."""
        canonical = json.dumps(
            {"scheme": KEY_SCHEME_VERSION, **asdict(self)}, sort_keys=True, separators=(",", ":")
        )
        return hashlib.blake2b(canonical.encode(), digest_size=_NAMESPACE_BYTES).hexdigest()

    def root(self, extra_key: str | None = None) -> bytes:
        """The chain's seed: the namespace digest, salted with ``extra_key`` when given
        (the prefix cache's namespace of a request, e.g. a LoRA adapter or a cache salt)."""
        seed = hashlib.blake2b(digest_size=_CHAIN_BYTES, person=b"kvflow-l3-root")
        seed.update(self.digest.encode())
        if extra_key is not None:
            seed.update(b"\x00" + extra_key.encode())
        return seed.digest()


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    tokens = array("q", token_ids)
    if sys.byteorder == "big":
        tokens.byteswap()
    return tokens.tobytes()


def _chain_of(namespace: StoreNamespace, key: str) -> bytes:
    prefix, sep, chain = key.partition("-")
    if prefix != namespace.digest or not sep or len(chain) != 2 * _CHAIN_BYTES:
        raise ValueError(f"key {key!r} is not a page key of namespace {namespace.digest}")
    return bytes.fromhex(chain)


def page_keys(
    namespace: StoreNamespace,
    token_ids: Sequence[int],
    page_size: int | None = None,
    prior_key: str | None = None,
    extra_key: str | None = None,
) -> list[str]:
    """Keys of the full pages of ``token_ids``; a partial last page gets no key.

    ``prior_key`` continues a chain: it is the key of the page just before ``token_ids[0]``
    (as returned by an earlier call), so ``page_keys(ns, a + b)`` equals
    ``page_keys(ns, a) + page_keys(ns, b, prior_key=<last key of a>)`` when ``len(a)`` is a
    multiple of the page size. ``extra_key`` salts the chain's root; it only matters when
    ``prior_key`` is None (a continued chain already carries it). ``page_size`` defaults to
    the namespace's and must equal it when given.
    """
    page_size = namespace.page_size if page_size is None else page_size
    if page_size != namespace.page_size:
        raise ValueError(
            f"page_size {page_size} differs from the namespace's {namespace.page_size}"
        )
    previous = namespace.root(extra_key) if prior_key is None else _chain_of(namespace, prior_key)
    if hasattr(token_ids, "tolist"):  # a tensor or an array: one conversion, not per item
        token_ids = token_ids.tolist()
    num_pages = len(token_ids) // page_size
    tokens = _token_bytes(token_ids[: num_pages * page_size])
    page_len = 8 * page_size
    keys: list[str] = []
    for start in range(0, num_pages * page_len, page_len):
        previous = hashlib.blake2b(
            previous + tokens[start : start + page_len], digest_size=_CHAIN_BYTES
        ).digest()
        keys.append(f"{namespace.digest}-{previous.hex()}")
    return keys
