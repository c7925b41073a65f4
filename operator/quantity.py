"""Kubernetes resource quantities ("4Gi", "500m", "1e9") as exact numbers.

The operator adds HiCache host memory to memory requests, so it needs exact arithmetic on
quantities without importing the kubernetes client into the pure builders.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_SUFFIXES = {
    "Ki": Decimal(2**10),
    "Mi": Decimal(2**20),
    "Gi": Decimal(2**30),
    "Ti": Decimal(2**40),
    "Pi": Decimal(2**50),
    "Ei": Decimal(2**60),
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([a-zA-Z]*)$")


class QuantityError(ValueError):
    """A string that is not a Kubernetes quantity."""


def parse_quantity(value: str | int | float) -> Decimal:
    """The exact value of a quantity: ``parse_quantity("4Gi") == 4 * 2**30``."""
    if isinstance(value, int | float):
        return Decimal(str(value))
    match = _QUANTITY.match(value.strip())
    if match is None or match.group(2) not in _SUFFIXES:
        raise QuantityError(f"{value!r} is not a Kubernetes quantity")
    try:
        return Decimal(match.group(1)) * _SUFFIXES[match.group(2)]
    except InvalidOperation as exc:
        raise QuantityError(f"{value!r} is not a Kubernetes quantity") from exc


def format_bytes(amount: Decimal | int) -> str:
    """Bytes as the shortest exact binary quantity: ``"6Gi"``, ``"1536Mi"``, ``"1000"``."""
    whole = int(Decimal(amount).to_integral_value(rounding="ROUND_CEILING"))
    for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        unit = int(_SUFFIXES[suffix])
        if whole and whole % unit == 0:
            return f"{whole // unit}{suffix}"
    return str(whole)
