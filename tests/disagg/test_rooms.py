"""The prefill's room table: claims, early transfers, cancels and how a room ends."""

from __future__ import annotations

import threading
import time

from kvflow.runtime.disagg.rooms import Claim, Rooms

CLAIM = Claim("127.0.0.1:1", (4, 5, 6), "00" * 16)


def test_a_claimed_queued_room_starts_early_and_a_cancel_waits_for_its_writes():
    rooms = Rooms(timeout_s=5)
    assert rooms.arrive(1) is None
    assert rooms.start_early(1) is None  # not claimed yet: nothing to send to
    assert rooms.claim(1, CLAIM) is None
    assert rooms.start_early(1) == CLAIM
    assert rooms.start_early(1) is None  # once
    # a cancel while writes may be in flight does not end the room...
    assert rooms.status([1], cancel=[1])[1]["state"] == "transferring"
    # ...the prefill's end does, as cancelled (the decode frees its slots only now)
    rooms.finish(1, "done", {"first_token": 3})
    assert rooms.status([1], cancel=[])[1]["state"] == "cancelled"


def test_a_cancelled_queued_room_does_not_start_early():
    rooms = Rooms(timeout_s=5)
    rooms.arrive(2)
    rooms.claim(2, CLAIM)
    rooms.status([], cancel=[2])
    assert rooms.start_early(2) is None
    assert rooms.take_claim(2) == "cancelled"


def test_a_room_keeps_the_first_way_it_ended():
    rooms = Rooms(timeout_s=5)
    rooms.arrive(3)
    rooms.claim(3, CLAIM)
    assert rooms.start_early(3) == CLAIM
    rooms.finish(3, "failed", {}, "the decode claimed 3 slots for a 4-token prompt")
    rooms.finish(3, "failed", {}, "failed")  # a later give-up does not hide the reason
    report = rooms.status([3], cancel=[])[3]
    assert report["state"] == "failed"
    assert "3 slots" in report["message"]


def test_a_late_claim_hears_why_the_room_ended():
    """A decode short of KV claims late: past the bootstrap timeout the prefill has failed
    the room, and the refusal says so (not "claimed already": nobody claimed it)."""
    rooms = Rooms(timeout_s=0.01)
    rooms.arrive(4)
    rooms.ready(4)
    time.sleep(0.02)
    assert rooms.take_claim(4) == "no decode claimed the room within 0 s"
    why = rooms.claim(4, CLAIM)
    assert why is not None and "ended before the decode claimed it" in why
    assert "no decode claimed the room" in why
    assert rooms.claim(5, CLAIM) is None
    assert rooms.claim(5, CLAIM) == "bootstrap room 5 is claimed already"


def test_a_refused_prefill_request_fails_its_room_at_once():
    """The prefill refused the request (building or queueing it): the decode's claim, made
    before or after, hears why at once; a room another request holds is left alone."""
    rooms = Rooms(timeout_s=300)
    assert rooms.claim(6, CLAIM) is None  # the decode claimed first: waiting
    rooms.refuse(6, "the prefill refused the request: the prompt is empty")
    report = rooms.status([6], cancel=[])[6]
    assert report["state"] == "failed" and "the prompt is empty" in report["message"]
    rooms.refuse(7, "the prefill refused the request: too long")  # no claim yet
    why = rooms.claim(7, CLAIM)
    assert why is not None and "too long" in why
    rooms.arrive(8)  # another request holds room 8: a duplicate's refusal leaves it
    rooms.refuse(8, "bootstrap room 8 is in use (queued)")
    assert rooms.claim(8, CLAIM) is None
    assert rooms.start_early(8) == CLAIM


def _status_in_thread(rooms: Rooms, room_ids: list[int], wait_s: float):
    """Start ``rooms.status(room_ids, [], wait_s)`` on a thread; the thread and its answer."""
    answer: list[dict] = []
    thread = threading.Thread(target=lambda: answer.append(rooms.status(room_ids, [], wait_s)))
    thread.start()
    time.sleep(0.2)  # inside its wait by now (if it ended sooner, the asserts say so)
    return thread, answer


def _claimed_and_queued(rooms: Rooms, room: int) -> None:
    rooms.claim(room, CLAIM)
    rooms.arrive(room)


def test_a_waiting_status_call_answers_once_its_room_ends():
    rooms = Rooms(timeout_s=5)
    _claimed_and_queued(rooms, 4)
    thread, answer = _status_in_thread(rooms, [4], wait_s=60)
    assert not answer, "answered before the room ended"
    rooms.finish(4, "done", {"first_token": 3})
    thread.join(timeout=30)  # not the minute it may wait
    assert answer == [{4: {"state": "done", "result": {"first_token": 3}, "message": ""}}]


def test_a_waiting_status_call_answers_when_a_room_arrives_unclaimed():
    """Its decode may hold that room's claim until the call returns: it must not wait."""
    rooms = Rooms(timeout_s=5)
    _claimed_and_queued(rooms, 5)
    thread, answer = _status_in_thread(rooms, [5], wait_s=60)
    rooms.arrive(6)  # no claim yet
    thread.join(timeout=30)
    assert answer and answer[0][5]["state"] == "queued"
    # while it stays unclaimed, a status call does not wait at all
    thread, answer = _status_in_thread(rooms, [5], wait_s=60)
    thread.join(timeout=30)
    assert answer and answer[0][5]["state"] == "queued"


def test_a_status_call_waits_no_longer_than_asked():
    rooms = Rooms(timeout_s=5)
    _claimed_and_queued(rooms, 7)
    assert rooms.status([7], [], wait_s=0.05)[7]["state"] == "queued"
