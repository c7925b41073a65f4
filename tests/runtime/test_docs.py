"""The docs list every metric the server exports."""

from pathlib import Path

from kvflow.runtime.server.metrics import METRIC_NAMES


def test_every_metric_is_documented():
    doc = (Path(__file__).parents[2] / "docs" / "runtime.md").read_text()
    for name in METRIC_NAMES:
        assert f"`{name}`" in doc, name


def test_every_hicache_metric_is_documented():
    from kvflow.runtime.server.hicache_metrics import HICACHE_METRIC_NAMES

    doc = (Path(__file__).parents[2] / "docs" / "hicache.md").read_text()
    for name in HICACHE_METRIC_NAMES:
        assert f"`{name}`" in doc, name
