"""API errors: transient ones are retried with backoff, permanent ones surface at once."""

from __future__ import annotations

import json

import pytest
from kubernetes.client.exceptions import ApiException

from kvflow.operator.kube import ApiFailure, Backoff, with_backoff

FAST = Backoff(attempts=4, first=0.001, cap=0.002)


def api_error(status: int, message: str = "boom") -> ApiException:
    error = ApiException(status=status, reason="x")
    error.body = json.dumps({"kind": "Status", "message": message})
    return error


class Flaky:
    """Fails with the given errors first, then returns "done"; counts calls."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "done"


@pytest.mark.parametrize("status", [409, 429, 500, 503])
def test_transient_errors_are_retried(status: int) -> None:
    call = Flaky(api_error(status), api_error(status))
    assert with_backoff(call, FAST, "test") == "done"
    assert call.calls == 3


def test_connection_errors_are_retried() -> None:
    call = Flaky(ConnectionRefusedError("refused"))
    assert with_backoff(call, FAST, "test") == "done" and call.calls == 2


def test_retries_are_bounded() -> None:
    call = Flaky(*[api_error(503, "etcd leader changed")] * 10)
    with pytest.raises(ApiFailure) as caught:
        with_backoff(call, FAST, "test")
    assert call.calls == FAST.attempts
    assert not caught.value.permanent and caught.value.reason == "ApiUnavailable"
    assert caught.value.message == "etcd leader changed"


@pytest.mark.parametrize(
    ("status", "reason"), [(422, "ApplyRejected"), (400, "ApplyRejected"), (403, "Forbidden")]
)
def test_permanent_errors_are_not_retried(status: int, reason: str) -> None:
    call = Flaky(api_error(status, "spec.foo: Invalid value"))
    with pytest.raises(ApiFailure) as caught:
        with_backoff(call, FAST, "test")
    assert call.calls == 1
    assert caught.value.permanent and caught.value.reason == reason
    assert caught.value.message == "spec.foo: Invalid value"


def test_backoff_grows_and_is_capped() -> None:
    assert list(Backoff(attempts=6, first=1, factor=2, cap=5).delays()) == [1, 2, 4, 5, 5]
