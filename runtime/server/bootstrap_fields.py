"""SGLang's ``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room`` request fields, and
kvflow's ``bootstrap_token`` (the router's signature of the pair, see
:mod:`kvflow.runtime.wire.pair_token`)."""

from __future__ import annotations

from typing import Any

from kvflow.runtime.wire import Bootstrap, RequestError

__all__ = ["bootstrap_of", "bootstraps_of", "check_sample_rooms"]


def bootstrap_of(host: Any, port: Any, room: Any, token: Any = None) -> Bootstrap | None:
    """The pairing of one prompt; None when no field is set, 400 when only some are."""
    given = [v is not None for v in (host, port, room)]
    if not any(given):
        return None
    if not all(given):
        raise RequestError(
            400, "bootstrap_host, bootstrap_port and bootstrap_room go together: give all three"
        )
    if token is not None and not isinstance(token, str):
        raise RequestError(400, "bootstrap_token must be a string")
    try:
        return Bootstrap(host, port, room, token)
    except ValueError as err:
        raise RequestError(400, str(err)) from err


def bootstraps_of(
    host: Any, port: Any, room: Any, count: int, token: Any = None
) -> list[Bootstrap | None]:
    """One pairing per prompt of a batch: lists of ``count`` values, or single values when
    ``count`` is 1."""
    values = [host, port, room, token]
    if any(isinstance(v, list) for v in values):
        if any(v is not None and (not isinstance(v, list) or len(v) != count) for v in values):
            raise RequestError(400, f"bootstrap_* lists must have one value per prompt ({count})")
        return [
            bootstrap_of(*(v[i] if v is not None else None for v in values)) for i in range(count)
        ]
    if count > 1 and room is not None:
        raise RequestError(400, "a batch needs one bootstrap_room per prompt (lists)")
    return [bootstrap_of(host, port, room, token)] * count


def check_sample_rooms(prompts: list[tuple[Bootstrap | None, int]]) -> None:
    """400 unless the rooms the ``n`` samples of each prompt ``(bootstrap, n)`` take
    (``room`` to ``room + n - 1``, see :meth:`Bootstrap.sample`) stay below 2**64 and no two
    prompts share one."""
    taken: list[tuple[int, int]] = []
    for bootstrap, n in prompts:
        if bootstrap is None:
            continue
        first, last = bootstrap.room, bootstrap.room + n - 1
        if last >= 1 << 64:
            raise RequestError(
                400, f"bootstrap_room {first} leaves no room for {n} samples (room + n > 2**64)"
            )
        for lo, hi in taken:
            if first <= hi and lo <= last:
                raise RequestError(
                    400,
                    f"bootstrap rooms {first}..{last} of {n} samples overlap rooms {lo}..{hi} "
                    "of another prompt",
                )
        taken.append((first, last))
