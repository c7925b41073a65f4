"""Mooncake started with a loopback local hostname keeps all its TCP traffic on loopback.

Why this needs a test: with an HTTP metadata server (the store's mode), Mooncake's transfer
engine does not advertise the local hostname it is given but the first non-``lo`` interface
address (``findLocalIpAddresses`` in ``transfer_metadata_plugin.cpp``; the "new RPC
mapping" branch of ``TransferEngineImpl::init``), unless ``MC_TCP_BIND_ADDRESS`` names one.
Peers then connect to that address (e.g. eth0's), off loopback. kvflow sets
``MC_TCP_BIND_ADDRESS`` to the local hostname when that is a loopback address (see
``kvflow.runtime.utils.mooncake_env.engine_env``).

Each participant runs in its own process; the test samples the TCP sockets each one owns
(``/proc/PID/fd`` socket inodes matched in ``/proc/PID/net/tcp{,6}``) every few ms while it
works and once more when it has finished, and asserts every connected endpoint, both ends,
is in 127.0.0.0/8 (or ``::1`` / ``::ffff:127.x``); listening sockets may be bound to the
wildcard address (the engine binds its listeners to every interface, which sends nothing).
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvflow.runtime.utils.mooncake_env import engine_env, loopback_bind_address

PEER = Path(__file__).with_name("mooncake_loopback_peer.py")
LISTEN = 0x0A
ESTABLISHED = 0x01
IP = ipaddress.IPv4Address | ipaddress.IPv6Address
# (local ip, local port, remote ip, remote port, tcp state)
Endpoint = tuple[IP, int, IP, int, int]


def _ip(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw[::-1])
    return ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))


def tcp_sockets(pid: int) -> set[Endpoint]:
    """The TCP sockets process ``pid`` holds open now (empty once it is gone)."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
        found = set()
        for table in ("tcp", "tcp6"):
            with open(f"/proc/{pid}/net/{table}") as handle:
                next(handle)
                for line in handle:
                    fields = line.split()
                    if fields[9] not in inodes:
                        continue
                    local, remote = fields[1].split(":"), fields[2].split(":")
                    found.add(
                        (
                            _ip(local[0]),
                            int(local[1], 16),
                            _ip(remote[0]),
                            int(remote[1], 16),
                            int(fields[3], 16),
                        )
                    )
        return found
    except (FileNotFoundError, ProcessLookupError):
        return set()


def is_loopback(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def off_loopback(endpoint: Endpoint) -> bool:
    local_ip, _, remote_ip, _, state = endpoint
    if state == LISTEN:
        return not (local_ip.is_unspecified or is_loopback(local_ip))
    return not (is_loopback(local_ip) and is_loopback(remote_ip))


class Sampler:
    """Samples the TCP sockets of the processes it is given, on a thread, until stopped."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.pids: dict[str, int] = {}
        self.seen: dict[str, set[Endpoint]] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._thread.start()

    def watch(self, role: str, pid: int) -> None:
        with self._lock:
            self.pids[role] = pid
            self.seen.setdefault(role, set())

    def sample(self) -> None:
        with self._lock:
            pids = dict(self.pids)
        for role, pid in pids.items():
            found = tcp_sockets(pid)
            with self._lock:
                self.seen[role] |= found

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sample()

    def off_loopback(self) -> dict[str, list[str]]:
        return {
            role: sorted(f"{e[0]}:{e[1]} -> {e[2]}:{e[3]} state {e[4]:#x}" for e in found)
            for role, found in self.seen.items()
            if any(off_loopback(e) for e in found)
        }

    def connections(self, role: str) -> set[Endpoint]:
        return {e for e in self.seen[role] if e[4] == ESTABLISHED}

    def listening_ports(self, role: str) -> set[int]:
        return {e[1] for e in self.seen[role] if e[4] == LISTEN}


class Peer:
    """``mooncake_loopback_peer.py ROLE ARGS`` in a subprocess; stays up until :meth:`end`."""

    def __init__(self, role: str, *args: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(PEER.parent)}
        # The fix under test must come from kvflow, not from the environment of the test run.
        for key in ("MC_TCP_BIND_ADDRESS", "MC_LEGACY_RPC_PORT_BINDING", "KVFLOW_POD_IP"):
            env.pop(key, None)
        self.role = role
        self.proc = subprocess.Popen(
            [sys.executable, "-P", str(PEER), role, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )

    def reply(self, timeout_s: float = 120) -> dict:
        stdout = self.proc.stdout
        assert stdout is not None
        result: list[str] = []
        reader = threading.Thread(target=lambda: result.append(stdout.readline()))
        reader.start()
        reader.join(timeout_s)
        if not result or not result[0]:
            self.end()
            raise AssertionError(f"{self.role}: no reply; stderr: {self.stderr()[-3000:]}")
        return json.loads(result[0])

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def end(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # type: ignore[union-attr]
                self.proc.wait(30)
            except (subprocess.TimeoutExpired, BrokenPipeError):
                self.proc.kill()
                self.proc.wait(10)

    def stderr(self) -> str:
        if self.proc.poll() is None:
            return ""
        return self.proc.stderr.read() if self.proc.stderr else ""  # type: ignore[union-attr]


@pytest.fixture
def sampler() -> Iterator[Sampler]:
    sampler = Sampler()
    yield sampler
    sampler.stop()


def test_two_store_clients_talk_over_loopback_only(mooncake_master, sampler) -> None:
    sampler.watch("master", mooncake_master.proc.pid)
    keys = [f"loopback-test-{i}" for i in range(64)]
    master, metadata = mooncake_master.address, mooncake_master.metadata_url
    writer = Peer("store-writer", master, metadata, json.dumps(keys))
    reader = None
    try:
        sampler.watch("writer", writer.proc.pid)
        assert writer.reply()["put"] == [True] * len(keys)
        reader = Peer("store-reader", master, metadata, json.dumps(keys))
        sampler.watch("reader", reader.proc.pid)
        seen = reader.reply()
        assert seen["found"] == [True] * len(keys)
        assert seen["equal"] == [True] * len(keys)
        time.sleep(0.2)  # a few more samples with everything connected
        sampler.stop()
    finally:
        for peer in (reader, writer):
            if peer is not None:
                peer.end()
    # The reader fetched the writer's pages over a connection of its own to the writer.
    writer_ports = sampler.listening_ports("writer")
    assert {e for e in sampler.connections("reader") if e[3] in writer_ports}, sampler.seen
    assert sampler.off_loopback() == {}


def test_transfer_engine_pair_talks_over_loopback_only(sampler) -> None:
    nbytes = 4 << 20
    target = Peer("te-target", str(nbytes))
    source = None
    try:
        sampler.watch("target", target.proc.pid)
        where = target.reply()
        source = Peer("te-source", where["session_id"], str(where["addr"]), str(nbytes))
        sampler.watch("source", source.proc.pid)
        written = source.reply()["digest"]
        target.send("digest")
        assert target.reply()["digest"] == written
        time.sleep(0.2)
        sampler.stop()
    finally:
        for peer in (source, target):
            if peer is not None:
                peer.end()
    target_ports = sampler.listening_ports("target")
    assert {e for e in sampler.connections("source") if e[3] in target_ports}, sampler.seen
    assert sampler.off_loopback() == {}


@pytest.mark.parametrize(
    ("hostname", "bind"),
    [
        ("127.0.0.1", "127.0.0.1"),
        ("127.0.0.5:12345", "127.0.0.5"),
        ("localhost", "127.0.0.1"),
        ("10.1.2.3", None),  # a pod IP: the engine's own choice stands
        ("node-a.example", None),
        ("::1", None),  # the engine listens on IPv4 only without MC_USE_IPV6
        ("", None),
    ],
)
def test_bind_address_is_set_for_loopback_hostnames_only(hostname: str, bind: str | None) -> None:
    assert loopback_bind_address(hostname) == bind
    assert engine_env(5.0, hostname).get("MC_TCP_BIND_ADDRESS") == bind
