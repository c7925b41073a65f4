"""``cache_aware`` keeps a shared prefix on one worker, judged by the workers' own counters."""

from __future__ import annotations

import httpx
import pytest
from router_process import RouterProcess, worker_counter

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SYSTEM = (
    "You are the archivist of a lighthouse museum. You answer in one short sentence, "
    "you never invent dates, and you always name the lighthouse you are talking about. "
    "The museum holds the logs of forty lighthouses from three centuries of coastal history."
)


def chat(router: RouterProcess, system: str, question: str) -> None:
    body = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 2,
        "temperature": 0,
    }
    response = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text


def counters(workers) -> list[tuple[float, float]]:
    return [
        (
            worker_counter(w.url, "sglang:num_requests_total"),
            worker_counter(w.url, "sglang:cached_tokens_total"),
        )
        for w in workers
    ]


def test_shared_prefix_goes_to_one_worker_and_hits_its_cache(workers, tmp_path):
    router = RouterProcess(
        "--worker-urls",
        ",".join(w.url for w in workers),
        "--policy",
        "cache_aware",
        log=tmp_path / "router.log",
    )
    try:
        before = counters(workers)
        questions = ["Which is the oldest?", "Which is the tallest?", "Which one is red?"]
        questions += ["Which has a foghorn?", "Which one is haunted?", "Which is the newest?"]
        for question in questions:
            chat(router, SYSTEM, question)
        after = counters(workers)
        requests = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
        cached = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
        assert sorted(requests) == [0, len(questions)], requests
        owner = requests.index(len(questions))
        # the owner served the system prompt from its prefix cache from the second request on
        assert cached[owner] >= (len(questions) - 1) * 30, cached

        # an unrelated prompt may go elsewhere (the smaller tree), and its family follows it
        other = (
            "You translate ship logs from Dutch to English, word for word, without comment. " * 3
        )
        before = counters(workers)
        for question in ("Translate: goedemorgen", "Translate: storm op zee", "Translate: licht"):
            chat(router, other, question)
        after = counters(workers)
        requests = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
        assert sorted(requests) == [0, 3], requests
        assert requests.index(3) != owner, "a new prefix goes to the worker with the smaller tree"
        ratio = httpx.get(f"{router.url}/metrics").text
        assert "kvflow_router_cache_match_ratio_count 9.0" in ratio
    finally:
        router.stop()
