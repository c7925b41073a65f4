"""The bootstrap endpoint and its client as a trust boundary: the internal key on every
route, bounded bodies and calls, and answers checked before use."""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest
from fake_bootstrap import FakeBootstrap, Raw, stall, states
from kv_helpers import kv_pool, model_config

from kvflow.runtime.disagg import bootstrap_client, layout_of
from kvflow.runtime.disagg.bootstrap import BootstrapServer
from kvflow.runtime.disagg.bootstrap_client import BootstrapClient, BootstrapError, RoomReport
from kvflow.runtime.disagg.ranks import Endpoint
from kvflow.runtime.disagg.rooms import Rooms

KEY = "internal-secret"
HASH = "ab" * 16


@pytest.fixture(scope="module")
def layout():
    config = model_config()
    return layout_of(kv_pool(config, num_slots=8), config, page_size=1)


@pytest.fixture
def server(layout):
    server = BootstrapServer("127.0.0.1", 0, layout, Rooms(timeout_s=5), key=KEY)
    server.start()
    yield server
    server.stop()


def _post(port: int, path: str, body: object, headers: dict[str, str] | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("POST", path, body=json.dumps(body), headers=headers or {})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


ROUTES = [
    ("/register", {"session": "127.0.0.1:1", "layout": {}}),
    ("/rooms", {"session": "127.0.0.1:1", "claims": []}),
    ("/rooms/status", {"rooms": [], "cancel": [7]}),
]


@pytest.mark.parametrize(("path", "body"), ROUTES)
@pytest.mark.parametrize("header", [None, "Bearer wrong", f"Basic {KEY}", KEY, f"Bearer {KEY}x"])
def test_every_route_needs_the_key(server, path, body, header) -> None:
    headers = {} if header is None else {"Authorization": header}
    status, answer = _post(server.port, path, body, headers)
    assert status == 401
    assert "internal key" in answer["error"]


def test_the_key_opens_every_route_and_the_client_sends_it(server, layout) -> None:
    client = BootstrapClient(f"127.0.0.1:{server.port}", key=KEY)
    client.register("127.0.0.1:1", layout)
    assert client.claim("127.0.0.1:1", [(7, [0, 1], HASH)]) == {}
    assert client.status([7], cancel=[7])[7].state == "cancelled"
    with pytest.raises(BootstrapError, match="internal key") as refused:
        BootstrapClient(f"127.0.0.1:{server.port}").register("127.0.0.1:1", layout)
    assert refused.value.refused


def test_without_a_key_the_routes_stay_open(layout) -> None:
    server = BootstrapServer("127.0.0.1", 0, layout, Rooms(timeout_s=5))
    server.start()
    try:
        client = BootstrapClient(f"127.0.0.1:{server.port}")
        client.register("127.0.0.1:1", layout)
        assert client.status([3], cancel=[])[3].state == "unknown"
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("path", "body", "why"),
    [
        ("/rooms/status", {"rooms": [-1]}, "rooms must be"),
        ("/rooms/status", {"rooms": [1 << 64]}, "rooms must be"),
        ("/rooms/status", {"rooms": [True]}, "rooms must be"),
        ("/rooms/status", {"rooms": "7"}, "rooms must be"),
        ("/rooms/status", {"cancel": [1.5]}, "cancel must be"),
        ("/rooms/status", {"rooms": [1], "wait_ms": 1001}, "wait_ms must be"),
        ("/rooms/status", {"rooms": [1], "wait_ms": -1}, "wait_ms must be"),
        ("/rooms/status", {"rooms": [1], "wait_ms": True}, "wait_ms must be"),
        ("/rooms", {"session": "s", "claims": [{"room": 1, "slots": [0]}]}, "prompt_hash"),
        (
            "/rooms",
            {"session": "s", "claims": [{"room": 1, "slots": [0], "prompt_hash": "é" * 32}]},
            "prompt_hash",
        ),
        (
            "/rooms",
            {"session": "s", "claims": [{"room": 1, "slots": [-2], "prompt_hash": HASH}]},
            "slots must be",
        ),
        ("/rooms", {"session": "s", "claims": {"room": 1}}, "claims must be"),
        ("/register", {"session": "s", "layout": {"num_slots": 3}}, "KV layout fields"),
    ],
)
def test_malformed_bodies_are_a_400(server, layout, path, body, why) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    server.sessions["s"] = (Endpoint("s", layout),)
    status, answer = _post(server.port, path, body, headers)
    assert status == 400, answer
    assert why in answer["error"]


def test_an_oversized_body_is_refused_unread(server) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    conn.putrequest("POST", "/rooms/status")
    conn.putheader("Authorization", f"Bearer {KEY}")
    conn.putheader("Content-Length", str(1 << 40))
    conn.endheaders()
    response = conn.getresponse()
    assert response.status == 413
    conn.close()


def _timed(call) -> tuple[BaseException, float]:
    start = time.monotonic()
    with pytest.raises(BootstrapError) as err:
        call()
    return err.value, time.monotonic() - start


def test_a_silent_peer_fails_the_call_within_its_timeout(layout) -> None:
    with FakeBootstrap(stall) as fake:
        err, took = _timed(lambda: BootstrapClient(fake.address, 0.5).register("s", layout))
    assert "unreachable" in str(err) and not err.refused
    assert took < 1.5


def test_a_peer_that_drips_its_answer_is_cut_at_the_deadline() -> None:
    answer = b'HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n{"states": {}}'

    def drip(path: str, body: dict) -> Raw:
        return Raw(answer, byte_interval_s=0.05)  # every read is quick; the whole is not

    with FakeBootstrap(drip) as fake:
        _, took = _timed(lambda: BootstrapClient(fake.address, 0.5).status([1], []))
    assert took < 1.5


def test_an_answer_over_the_limit_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bootstrap_client, "MAX_BODY_BYTES", 100)
    with FakeBootstrap(states({str(i): {"state": "done"} for i in range(50)})) as fake:
        err, _ = _timed(lambda: BootstrapClient(fake.address, 2).status([1], []))
    assert "too much" in str(err)


@pytest.mark.parametrize(
    "answer",
    [
        Raw(b"HTTP/1.0 200 OK\r\n\r\nnot json"),
        Raw(b"HTTP/1.0 200 OK\r\n\r\n[1, 2]"),
        Raw(b"garbage\r\n\r\n"),
        Raw(b"HTTP/1.0 500 Oops\r\n\r\n<html>"),
        (200, {"states": [1, 2]}),
        (200, {"states": {"not-a-room": {}}}),
        (200, {"states": {"1e400": {}}}),
        (200, {}),
    ],
)
def test_a_malformed_answer_is_a_bootstrap_error(answer) -> None:
    with FakeBootstrap(lambda path, body: answer) as fake:
        _timed(lambda: BootstrapClient(fake.address, 2).status([1], []))


def test_room_reports_are_checked_one_by_one() -> None:
    raw = {
        "1": {"state": "done", "result": {"first_token": 5}},
        "2": {"state": "bogus"},
        "3": [1, 2],
        "4": {"state": "failed", "message": "x" * 10_000},
        "5": {"state": "done", "result": [1]},
        "-1": {"state": "done"},  # not asked about: left out
        "99": {"state": "done"},
    }
    with FakeBootstrap(states(raw)) as fake:
        reports = BootstrapClient(fake.address, 2).status([1, 2, 3, 4, 5], [])
    assert reports[1] == RoomReport("done", {"first_token": 5}, "")
    for room in (2, 3, 5):
        assert reports[room].state == "failed" and "malformed" in reports[room].message
    assert len(reports[4].message) == 500
    assert set(reports) == {1, 2, 3, 4, 5}


def test_refusals_are_checked() -> None:
    def refuse(path: str, body: dict):
        return 200, {"refused": {"7": "claimed already", "8": {"nested": 1}}}

    with FakeBootstrap(refuse) as fake:
        refused = BootstrapClient(fake.address, 2).claim("s", [(7, [1], HASH), (8, [2], HASH)])
        assert fake.calls[-1][1]["claims"][0] == {"room": 7, "slots": [1], "prompt_hash": HASH}
    assert refused == {7: "claimed already", 8: "refused by the prefill"}


@pytest.mark.parametrize(
    ("peer", "why"),
    [
        (
            {"transport": "cuda_ipc"},
            "the decode's KV transport is 'cuda_ipc', this prefill's 'mooncake'",
        ),
        ({"transport": "mooncake", "protocol": "rdma"}, "the decode's Mooncake protocol is 'rdma'"),
    ],
)
def test_a_decode_on_another_transport_is_refused_at_registration(layout, peer, why) -> None:
    """The prefill's transport checks the decode's peer info (a real Mooncake transport):
    a decode that could never receive this prefill's writes is refused with the reason,
    before any room is claimed."""
    from kvflow.runtime.disagg import KV_TRANSPORTS

    with KV_TRANSPORTS.get("mooncake")(timeout_s=2) as transport:
        server = BootstrapServer(
            "127.0.0.1", 0, layout, Rooms(timeout_s=5), on_register=transport.add_peer
        )
        server.start()
        try:
            client = BootstrapClient(f"127.0.0.1:{server.port}")
            with pytest.raises(BootstrapError, match=why) as refused:
                client.register("127.0.0.1:1", layout, peer)
            assert refused.value.refused and not server.sessions
            client.register("127.0.0.1:1", layout, transport.peer_info())  # the same: taken
            client.register("127.0.0.1:2", layout)  # no peer info: a Mooncake TCP decode
            assert set(server.sessions) == {"127.0.0.1:1", "127.0.0.1:2"}
        finally:
            server.stop()


def test_a_claim_wakes_the_prefill_and_a_waiting_poll_hears_the_room_end(layout) -> None:
    """The prefill's loop hears of a claim when it arrives (``on_claim``), and the decode's
    poll that waits at the prefill is answered once the room ends, not at its next poll."""
    claimed = threading.Event()
    rooms = Rooms(timeout_s=5)
    server = BootstrapServer("127.0.0.1", 0, layout, rooms, key=KEY, on_claim=claimed.set)
    server.start()
    try:
        client = BootstrapClient(f"127.0.0.1:{server.port}", timeout_s=30, key=KEY)
        client.register("127.0.0.1:1", layout)
        assert client.claim("127.0.0.1:1", [(8, [0, 1], HASH)]) == {}
        assert claimed.is_set()
        rooms.arrive(8)
        threading.Timer(0.2, rooms.finish, (8, "done", {"first_token": 1})).start()
        # asked while the room is queued: the answer is its end (the prefill waited)
        reports = client.status([8], cancel=[], wait_ms=1000)
        assert reports[8] == RoomReport("done", {"first_token": 1}, "")
    finally:
        server.stop()
