"""A TCP relay between network namespaces: listen in one, connect in another.

The pod-network node lives in a network namespace of its own; the control plane and the
tests stay on root loopback. A socket keeps the namespace it was created in, so one
process can listen inside the node's namespace and dial root loopback (or the reverse)
without any address outside loopback in the root namespace. Each rule is
`LISTEN=CONNECT`, each side `[NETNS_PATH@]HOST:PORT` (no path: the namespace the relay
started in). The relay writes `--ready FILE` once every listener is bound.

Run as a script (standard library only): `python relay.py --ready F RULE...`;
`e2e.k8s.realnode.podnet.relay_component()` runs it as a harness component.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import socket
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Endpoint", "Rule", "main", "run"]

_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class Endpoint:
    """A TCP address in a network namespace (`netns` None: the relay's own)."""

    host: str
    port: int
    netns: Path | None = None

    def __str__(self) -> str:
        where = f"{self.netns}@" if self.netns else ""
        return f"{where}{self.host}:{self.port}"

    @classmethod
    def parse(cls, text: str) -> Endpoint:
        netns, _, address = text.rpartition("@")
        host, _, port = address.rpartition(":")
        return cls(host, int(port), Path(netns) if netns else None)


@dataclass(frozen=True)
class Rule:
    """Connections accepted at `listen` are relayed to `connect`."""

    listen: Endpoint
    connect: Endpoint

    def __str__(self) -> str:
        return f"{self.listen}={self.connect}"

    @classmethod
    def parse(cls, text: str) -> Rule:
        listen, _, connect = text.partition("=")
        return cls(Endpoint.parse(listen), Endpoint.parse(connect))


@contextlib.contextmanager
def _in_netns(path: Path | None) -> Iterator[None]:
    """Run the block with the calling thread in network namespace `path` (setns is per
    thread), then return it to the namespace it was in."""
    if path is None:
        yield
        return
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(path, os.O_RDONLY)
    try:
        if _libc.setns(target, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({path})")
        try:
            yield
        finally:
            if _libc.setns(own, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns(back)")
    finally:
        os.close(target)
        os.close(own)


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


def _serve(client: socket.socket, target: Endpoint) -> None:
    try:
        with _in_netns(target.netns):
            upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        upstream.settimeout(10)
        upstream.connect((target.host, target.port))
        upstream.settimeout(None)
    except OSError:
        client.close()
        return
    for sock in (client, upstream):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
    back.start()
    _pump(client, upstream)
    back.join()
    client.close()
    upstream.close()


def _accept(listener: socket.socket, target: Endpoint) -> None:
    while True:
        client, _ = listener.accept()
        threading.Thread(target=_serve, args=(client, target), daemon=True).start()


def run(rules: Sequence[Rule], ready: Path) -> None:
    """Bind every rule's listener, write `ready`, relay until killed."""
    listeners = []
    for rule in rules:
        with _in_netns(rule.listen.netns):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((rule.listen.host, rule.listen.port))
        sock.listen(128)
        listeners.append((sock, rule.connect))
    threads = [threading.Thread(target=_accept, args=pair, daemon=True) for pair in listeners]
    for thread in threads:
        thread.start()
    ready.write_text("\n".join(str(r) for r in rules) + "\n")
    for thread in threads:
        thread.join()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ready", type=Path, required=True)
    parser.add_argument("rules", nargs="+", type=Rule.parse)
    args = parser.parse_args(argv)
    run(args.rules, args.ready)


if __name__ == "__main__":
    main()
