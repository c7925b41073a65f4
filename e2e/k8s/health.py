"""HTTP(S) health probes for the components."""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request
from collections.abc import Callable

__all__ = ["http_probe", "insecure_tls", "mutual_tls"]


def http_probe(url: str, context: ssl.SSLContext | None = None) -> Callable[[], bool]:
    """A probe that passes when `url` answers 200 within 2 seconds."""

    def probe() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2, context=context) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    return probe


def mutual_tls(ca_file: str, cert_file: str, key_file: str) -> ssl.SSLContext:
    """Verify the server against `ca_file` and present a client certificate."""
    context = ssl.create_default_context(cafile=ca_file)
    context.load_cert_chain(cert_file, key_file)
    return context


def insecure_tls() -> ssl.SSLContext:
    """For components serving a self-signed cert (controller-manager, scheduler): the
    probe only asks whether /healthz answers, on loopback."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context
