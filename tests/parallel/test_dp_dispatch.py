"""The data-parallel dispatcher over real ZMQ sockets: round robin, shortest queue, an abort
to the group that holds its request, a control request to every group, stats added up."""

from __future__ import annotations

import pytest
import zmq

from kvflow.runtime.server.dp_dispatch import DataParallelDispatcher, merge_stats
from kvflow.runtime.server.ipc import Puller, make_ipc_paths
from kvflow.runtime.wire import GenerateRequest, SamplingParams
from kvflow.runtime.wire.hicache import HiCacheStats
from kvflow.runtime.wire.messages import AbortRequest, ControlRequest, SchedulerStats


@pytest.fixture
def groups():
    ctx = zmq.Context()
    paths = make_ipc_paths()
    inboxes = [Puller(ctx, paths.scheduler_inbox(g)) for g in range(3)]
    yield ctx, paths, inboxes
    ctx.destroy(linger=0)


def _request(rid: str) -> GenerateRequest:
    return GenerateRequest(input_ids=[1, 2], sampling=SamplingParams(), rid=rid)


def _received(inboxes) -> list[list]:
    return [
        [m for m in [inbox.recv(2000), *inbox.recv_all()] if m is not None] for inbox in inboxes
    ]


def test_round_robin_and_abort_to_the_holding_group(groups):
    ctx, paths, inboxes = groups
    dispatch = DataParallelDispatcher(ctx, paths, 3, "round_robin")
    for rid in ("a", "b", "c", "d"):
        dispatch.send(_request(rid))
    got = _received(inboxes)
    assert [[m.rid for m in box] for box in got] == [["a", "d"], ["b"], ["c"]]
    dispatch.send(AbortRequest("b", "stop"))
    assert inboxes[1].recv(2000) == AbortRequest("b", "stop")
    assert inboxes[0].recv(200) is None and inboxes[2].recv(200) is None
    dispatch.finished("b")
    dispatch.send(AbortRequest("b", "late"))  # finished meanwhile: every group hears it
    assert [box[0] for box in _received(inboxes)] == [AbortRequest("b", "late")] * 3
    dispatch.send_to(2, ControlRequest("x", "get_stats"))
    assert inboxes[2].recv(2000) == ControlRequest("x", "get_stats")


def test_shortest_queue_follows_what_each_group_still_holds(groups):
    ctx, paths, _ = groups
    dispatch = DataParallelDispatcher(ctx, paths, 3, "shortest_queue")
    for rid in ("a", "b", "c"):
        dispatch.send(_request(rid))
    assert dispatch.load == [1, 1, 1]
    dispatch.finished("b")
    assert dispatch.pick() == 1
    dispatch.send(_request("e"))
    dispatch.send(_request("f"), group=2)  # a prompt's samples stay with its group
    assert dispatch.load == [1, 1, 2]
    assert dispatch.pick() == 0
    with pytest.raises(ValueError, match="unknown load balance method"):
        DataParallelDispatcher(ctx, paths, 2, "random")


def test_merge_stats_adds_the_groups_up():
    def stats(running: int, total: int, rank: int) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=running,
            num_queue_reqs=1,
            kv_total_tokens=total,
            kv_used_tokens=10,
            kv_request_tokens=5,
            cached_tokens=5,
            evictable_tokens=2,
            generated_tokens=7,
            free_request_rows=3,
            total_request_rows=4,
            forward_steps=9,
            num_retractions=0,
            hicache=HiCacheStats(host_total_tokens=100, storage="file"),
            dp_rank=rank,
        )

    merged = merge_stats([stats(2, 1000, 0), stats(3, 500, 1)])
    assert (merged.num_running_reqs, merged.kv_total_tokens, merged.num_queue_reqs) == (5, 1500, 2)
    assert merged.hicache == HiCacheStats(host_total_tokens=200, storage="file")
    assert merged.dp_rank == 0
