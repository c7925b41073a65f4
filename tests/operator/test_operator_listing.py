"""Listing the watched ModelDeployments (kube.watched_model_deployments), as drift repair and
the autoscaler do."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from kvflow.operator.drift import DriftRepair
from kvflow.operator.kube import ApiFailure, watched_model_deployments


def md(namespace: str, name: str) -> dict[str, Any]:
    return {"metadata": {"namespace": namespace, "name": name}}


class Api:
    """ModelDeployments by namespace; listing ``broken`` fails."""

    def __init__(self, broken: str = "") -> None:
        self.items = {"a": [md("a", "m1"), md("a", "m2")], "b": [md("b", "m3")]}
        self.broken = broken
        self.asked: list[str | None] = []

    def list_model_deployments(self, namespace: str | None) -> list[dict[str, Any]]:
        self.asked.append(namespace)
        if namespace == self.broken:
            raise ApiFailure("Forbidden", "namespace b is not watched", permanent=True)
        if namespace is None:
            return [item for items in self.items.values() for item in items]
        return self.items.get(namespace, [])


def names(bodies) -> list[str]:
    return [body["metadata"]["name"] for body in bodies]


def test_no_namespace_means_every_namespace_in_one_listing() -> None:
    api = Api()
    assert names(watched_model_deployments(api, (), "test")) == ["m1", "m2", "m3"]
    assert api.asked == [None]


def test_a_failed_listing_is_logged_and_skipped(caplog: pytest.LogCaptureFixture) -> None:
    api = Api(broken="b")
    with caplog.at_level(logging.WARNING):
        listed = names(watched_model_deployments(api, ("b", "a"), "drift repair"))
    assert listed == ["m1", "m2"] and api.asked == ["b", "a"]
    assert "drift repair: cannot list ModelDeployments: namespace b" in caplog.text


def test_drift_repair_reconciles_what_is_listed() -> None:
    reconciled: list[tuple[str, str]] = []

    class Reconciler:
        def reconcile(self, namespace: str, name: str) -> object:
            reconciled.append((namespace, name))
            return None if name == "m2" else object()  # m2: gone meanwhile

    drift = DriftRepair(Api(broken="b"), Reconciler(), ["a", "b"], interval=60)  # type: ignore[arg-type]
    assert drift.sweep() == 1
    assert reconciled == [("a", "m1"), ("a", "m2")]
