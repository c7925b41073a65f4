"""A streamed ``/generate`` of a kvflow (or SGLang) server, event by event: what the device
scripts' clients (gpu_pd_run.sh, gpu_pd_interference.sh, gpu_hicache_run.sh) measure from.

They run from /tmp and find this folder through ``$PD_LIB`` (set by device.sh).
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["events"]


def events(port: int, body: dict[str, Any], timeout: float) -> Iterator[tuple[float, dict]]:
    """POST ``body`` (with ``"stream": true``) to 127.0.0.1:``port`` and yield each server-sent
    event as (``time.monotonic()`` when it arrived, the event); ends at ``[DONE]`` or when the
    server closes. A status other than 200 raises ``RuntimeError`` with the body's start. The
    request goes out on the first ``next()``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"port {port}: HTTP {resp.status}: {resp.read()[:300]!r}")
    while True:
        line = resp.readline()
        if not line:
            return
        if not line.startswith(b"data: "):
            continue
        payload = line[6:].strip()
        if payload == b"[DONE]":
            return
        yield time.monotonic(), json.loads(payload)
