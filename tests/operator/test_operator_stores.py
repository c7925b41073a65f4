"""The operator's shared-store registry (kvflow.operator.stores) against the runtime's."""

from __future__ import annotations

import copy
import dataclasses
import itertools
from typing import Any

import pytest

from kvflow import contract
from kvflow.operator import SpecError, parse_model_deployment
from kvflow.operator.pods import worker_serve_options
from kvflow.operator.stores import STORES, SharedStore, shared_store, store_type

BODY: dict[str, Any] = {
    "apiVersion": "kvflow.dev/v1alpha1",
    "kind": "ModelDeployment",
    "metadata": {"name": "m", "namespace": "models", "uid": "u", "generation": 1},
    "spec": {"unified": {"replicas": 1}, "hiCache": {"hostMemory": "2Gi"}},
}


def with_store(kind: str, **spec: Any) -> dict[str, Any]:
    body = copy.deepcopy(BODY)
    body["spec"]["hiCache"]["sharedStore"] = {"type": kind, "size": "8Gi"}
    body["spec"].update(spec)
    return body


def test_the_operator_knows_the_runtime_s_stores() -> None:
    from kvflow.runtime.cache.storage import STORAGE_BACKENDS

    assert sorted(STORES) == STORAGE_BACKENDS.choices()


@pytest.mark.parametrize("kind", sorted(STORES))
def test_each_store_s_argv_round_trips_through_the_runtime_parser(kind: str) -> None:
    from kvflow.runtime.server.args import parse_args

    md = parse_model_deployment(with_store(kind))
    store = shared_store(md)
    assert isinstance(store, store_type(kind)) and store.kind == kind
    options = worker_serve_options(md, md.workers[0], "")
    assert options.hicache is not None
    assert options.hicache.storage_path == store.cluster_client().storage_path != ""
    engine = parse_args(contract.serve_argv(options)[2:]).engine
    parsed = {f: getattr(engine, f) for f in contract.HICACHE_ENGINE_FIELDS}
    assert parsed == {
        f"hicache_{name}": value for name, value in dataclasses.asdict(options.hicache).items()
    }
    assert engine.hicache_storage == kind


def test_engine_config_takes_the_contract_s_fields_and_defaults() -> None:
    from kvflow.runtime.config import EngineConfig

    defaults = contract.HiCacheOptions()
    for name in contract.HICACHE_ENGINE_FIELDS:
        assert getattr(EngineConfig(), name) == getattr(defaults, name.removeprefix("hicache_"))
    assert list(contract.HICACHE_FLAGS) == [
        "--hicache-host-memory-gb",
        "--hicache-write-policy",
        "--hicache-storage",
        "--hicache-storage-path",
    ]
    # no store: neither the store nor its path is rendered
    assert contract.HiCacheOptions(1.0, storage_path="/x").argv() == [
        "--hicache-host-memory-gb",
        "1.0",
        "--hicache-write-policy",
        "write_through",
    ]


def test_no_store_is_none_and_renders_no_storage_flag() -> None:
    md = parse_model_deployment(copy.deepcopy(BODY))
    assert shared_store(md) is None
    argv = contract.serve_argv(worker_serve_options(md, md.workers[0], ""))
    assert "--hicache-host-memory-gb" in argv and "--hicache-storage" not in argv


def test_an_unknown_store_is_refused() -> None:
    with pytest.raises(SpecError) as refused:
        parse_model_deployment(with_store("redis"))
    assert refused.value.field_path == "spec.hiCache.sharedStore.type"
    assert "redis" in str(refused.value)
    with pytest.raises(ValueError, match="unknown shared store 'redis'"):
        store_type("redis")


def test_a_store_s_spec_section_is_refused_with_another_store() -> None:
    for kind, other in itertools.permutations(STORES, 2):
        for section in store_type(other).spec_sections:
            with pytest.raises(SpecError) as refused:
                parse_model_deployment(with_store(kind, **{section: {}}))
            assert refused.value.field_path == f"spec.{section}"


def test_every_store_implements_the_contract() -> None:
    for kind in STORES:
        cls = store_type(kind)
        assert issubclass(cls, SharedStore) and not cls.__abstractmethods__
