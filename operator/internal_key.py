"""The deployment's internal credential (``$KVFLOW_INTERNAL_KEY``) for disaggregated serving.

The router signs each prefill/decode pair with it (``bootstrap_token``), the decode
contacts only prefills its router signed for, and the prefill's bootstrap routes require it
as their bearer token. Clients never see it. The operator keeps it in a Secret it creates
once per ModelDeployment with a random value (never read back, never rotated by the
operator: delete the Secret and the next reconcile makes a new one; the pods pick it up
when they restart); the Secret is owned by the ModelDeployment, so it goes with it.
"""

from __future__ import annotations

import secrets
from typing import Any

from kvflow import contract

from . import names
from .podparts import secret_env
from .spec import ModelDeployment, SecretKeyRef

__all__ = ["internal_key_env", "internal_key_secret", "new_internal_key"]

_COMPONENT = "internal-key"
_DATA_KEY = "key"


def _ref(md: ModelDeployment) -> SecretKeyRef:
    return SecretKeyRef(names.child_name(md.name, _COMPONENT), _DATA_KEY)


def internal_key_env(md: ModelDeployment) -> list[dict[str, Any]]:
    """The router's and PD workers' ``$KVFLOW_INTERNAL_KEY`` (disaggregated only)."""
    return [secret_env(contract.INTERNAL_KEY_ENV, _ref(md))] if md.disaggregated else []


def internal_key_secret(md: ModelDeployment, key: str) -> dict[str, Any]:
    """The Secret holding ``key``; created only when absent (see :func:`new_internal_key`)."""
    ref = _ref(md)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": names.object_meta(md, ref.name, _COMPONENT),
        "type": "Opaque",
        "stringData": {ref.key: key},
    }


def new_internal_key() -> str:
    return secrets.token_hex(32)
