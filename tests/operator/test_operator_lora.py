"""``spec.lora``, unit level: the workers' flags (parsed by the runtime's own parser), where
each adapter's files are in a pod, a pod template that an adapter list change leaves alone
(so the running pods are not replaced), the pod annotations the router reads, the
refusals (parser and CRD), and the status read from the router's metrics."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from operator_testing import SPECS, apply_defaults, crd_schema, load_model_deployment

from kvflow import contract
from kvflow.operator import SpecError, parse_model_deployment, render_children
from kvflow.operator.lora import adapter_annotation, cluster_adapter_storage, pods_to_annotate
from kvflow.operator.lora_status import adapters_by_role
from kvflow.operator.reconcile import status_patch

ADAPTERS = [
    {"name": "sql", "source": "pvc", "pvc": {"claimName": "adapters", "path": "sql"}},
    {"name": "chat", "source": "hostPath", "hostPath": {"path": "/data/loras/chat"}},
    {"name": "hub", "source": "huggingFace", "huggingFace": {"id": "org/hub", "revision": "v2"}},
]


def _body(adapters: list[dict[str, Any]] | None = None, **lora: Any) -> dict[str, Any]:
    body = load_model_deployment(SPECS["unified-embedded"])
    body["spec"]["lora"] = {"adapters": copy.deepcopy(ADAPTERS if adapters is None else adapters),
                            **lora}  # fmt: skip
    return body


def _template(body: dict[str, Any]) -> dict[str, Any]:
    md = parse_model_deployment(body)
    (deployment,) = [
        c
        for c in render_children(md)
        if c["kind"] == "Deployment" and c["metadata"]["name"] == f"{md.name}-unified"
    ]
    return deployment["spec"]["template"]


def test_workers_run_enable_lora_with_the_spec_slots() -> None:
    from kvflow.runtime.server.args import parse_args

    template = _template(_body(maxLorasPerBatch=4, maxLoraRank=32, targetModules=["q_proj"]))
    argv = template["spec"]["containers"][0]["command"]
    assert argv[argv.index("--enable-lora") :][:7] == [
        "--enable-lora", "--max-loras-per-batch", "4", "--max-lora-rank", "32",
        "--lora-target-modules", "q_proj",
    ]  # fmt: skip
    assert "--lora-paths" not in argv  # the adapters come through the router, not argv
    engine = parse_args(argv[2:]).engine
    assert (engine.enable_lora, engine.max_loras_per_batch, engine.max_lora_rank) == (True, 4, 32)
    assert engine.lora_target_modules == ("q_proj",)


def test_each_source_is_where_its_path_says() -> None:
    template = _template(_body())
    spec = template["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["lora-pvc-0"]["persistentVolumeClaim"] == {
        "claimName": "adapters",
        "readOnly": True,
    }
    assert volumes["lora-host-0"]["hostPath"] == {"path": "/data/loras", "type": "Directory"}
    assert volumes["lora-hf"] == {"name": "lora-hf", "emptyDir": {}}
    mounts = {m["name"]: m for m in spec["containers"][0]["volumeMounts"]}
    assert mounts["lora-pvc-0"]["mountPath"] == "/adapters/pvc/adapters"
    assert mounts["lora-host-0"]["mountPath"] == "/data/loras"
    assert all(mounts[n]["readOnly"] for n in ("lora-pvc-0", "lora-host-0", "lora-hf"))
    (fetch,) = spec["initContainers"]
    assert fetch["command"] == [
        "hf", "download", "org/hub", "--revision", "v2", "--local-dir", "/adapters/hf/hub",
    ]  # fmt: skip
    md = parse_model_deployment(_body())
    assert cluster_adapter_storage(md).paths == {
        "sql": "/adapters/pvc/adapters/sql",
        "chat": "/data/loras/chat",
        "hub": "/adapters/hf/hub",
    }
    assert adapter_annotation(md) == (
        "chat=/data/loras/chat,hub=/adapters/hf/hub,sql=/adapters/pvc/adapters/sql"
    )


def test_an_adapter_next_to_mounted_ones_leaves_the_pod_template_alone() -> None:
    """Adding or removing adapters on a mounted claim or folder changes only the annotation:
    the Deployment keeps its template, so no pod is replaced. A new claim or a Hub adapter
    (one more init container) is a new template."""
    before = _template(_body())
    more = [
        *ADAPTERS,
        {"name": "sql2", "source": "pvc", "pvc": {"claimName": "adapters", "path": "sql2"}},
        {"name": "chat2", "source": "hostPath", "hostPath": {"path": "/data/loras/chat2"}},
    ]
    assert _template(_body(more)) == before
    assert _template(_body(ADAPTERS[:2] + ADAPTERS[2:])) == before
    assert _template(_body([ADAPTERS[0], ADAPTERS[2]])) != before  # the folder is unmounted
    other_claim = {"name": "x", "source": "pvc", "pvc": {"claimName": "other"}}
    assert _template(_body([*ADAPTERS, other_claim])) != before
    assert adapter_annotation(parse_model_deployment(_body(more))) != adapter_annotation(
        parse_model_deployment(_body())
    )


def _pod(name: str, role: str, annotation: str | None = None, **meta: Any) -> dict[str, Any]:
    annotations = {} if annotation is None else {contract.LORA_ADAPTERS_ANNOTATION: annotation}
    labels = {contract.ROLE_LABEL: role}
    return {"metadata": {"name": name, "labels": labels, "annotations": annotations, **meta}}


def test_running_worker_pods_get_the_list_in_their_annotation() -> None:
    md = parse_model_deployment(_body())
    wanted = adapter_annotation(md)
    assert wanted is not None
    pods = [
        _pod("w-0", "unified"),
        _pod("w-1", "unified", wanted),
        _pod("w-2", "unified", "sql=/old"),
        _pod("w-3", "unified", deletionTimestamp="2026-01-01T00:00:00Z"),
        _pod("r-0", "router"),
    ]
    assert pods_to_annotate(md, pods) == [("w-0", wanted), ("w-2", wanted)]
    empty = parse_model_deployment(_body([]))
    assert adapter_annotation(empty) == ""  # the router unloads whatever is there
    no_lora = load_model_deployment(SPECS["unified-embedded"])
    assert pods_to_annotate(parse_model_deployment(no_lora), pods) == []


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"adapters": [ADAPTERS[0], ADAPTERS[0]]}, "spec.lora.adapters[1].name", "twice"),
        (
            {"adapters": [{**ADAPTERS[0], "name": "base:sql"}]},
            "spec.lora.adapters[0].name",
            "is not",
        ),
        ({"adapters": [{"name": "x", "source": "pvc"}]}, "spec.lora.adapters[0].pvc", "required"),
        (
            {"adapters": [{"name": "x", "source": "embedded"}]},
            "spec.lora.adapters[0].source",
            "one of",
        ),
        (
            {"adapters": [{"name": "x", "source": "hostPath", "hostPath": {"path": "/x"}}]},
            "spec.lora.adapters[0].hostPath.path",
            "parent folder",
        ),
        (
            {"adapters": [{"name": "x", "source": "hostPath", "hostPath": {"path": "/usr/x"}}]},
            "spec.lora.adapters[0].hostPath.path",
            "mounted over /usr",
        ),
        (
            {"adapters": [{"name": "x", "source": "hostPath", "hostPath": {"path": "/var/x"}}]},
            "spec.lora.adapters[0].hostPath.path",
            "mounted over /var/cache/kvflow",  # /var would hide the operator's mounts
        ),
    ],
)
def test_bad_adapter_lists_are_refused(change: dict[str, Any], field: str, words: str) -> None:
    body = load_model_deployment(SPECS["unified-embedded"])
    body["spec"]["lora"] = change
    with pytest.raises(SpecError, match=words) as refused:
        parse_model_deployment(body)
    assert refused.value.field_path == field


def test_lora_runs_with_tensor_and_data_parallelism() -> None:
    """The runtime applies adapters at any --tp-size (each rank its part) and --dp-size."""
    body = _body()
    body["spec"]["unified"] = {**body["spec"]["unified"], "gpus": 2}
    assert parse_model_deployment(body).workers[0].tp_size == 2
    body["spec"]["unified"]["tensorParallelSize"] = 1
    assert parse_model_deployment(body).workers[0].dp_size == 2


def test_crd_defaults_and_rules_match_the_parser() -> None:
    schema = crd_schema()
    spec = schema["properties"]["spec"]
    lora = spec["properties"]["lora"]
    adapters = lora["properties"]["adapters"]
    assert adapters["x-kubernetes-list-map-keys"] == ["name"]  # a name twice: refused
    name = adapters["items"]["properties"]["name"]["pattern"]
    from kvflow.operator.lora import ADAPTER_NAME

    assert name == f"^{ADAPTER_NAME.pattern}$"
    rules = [r for r in spec["x-kubernetes-validations"] if r.get("fieldPath") == ".lora"]
    assert not any("tensorParallelSize" in r["rule"] for r in rules)  # LoRA runs with TP
    assert any("--is-embedding" in r["rule"] for r in rules)
    body = _body([ADAPTERS[2]])
    body["spec"]["lora"] = {"adapters": [{k: v for k, v in ADAPTERS[2].items()}]}
    defaulted = apply_defaults(body, schema)
    assert defaulted["spec"]["lora"]["maxLorasPerBatch"] == 8
    assert parse_model_deployment(defaulted) == parse_model_deployment(body)


def test_status_counts_each_adapter_on_the_ready_pods_the_router_reports() -> None:
    md = parse_model_deployment(_body())
    ready = [{"type": "Ready", "status": "True"}]

    def worker(name: str, ip: str) -> dict[str, Any]:
        pod = _pod(name, "unified")
        pod["metadata"]["labels"]["kvflow.dev/role"] = "unified"
        pod["status"] = {"podIP": ip, "conditions": ready}
        return pod

    pods = [worker("w-0", "10.0.0.1"), worker("w-1", "10.0.0.2")]
    text = (
        "# TYPE kvflow_router_lora_adapter_loaded gauge\n"
        'kvflow_router_lora_adapter_loaded{adapter="sql",worker="http://10.0.0.1:8000"} 1.0\n'
        'kvflow_router_lora_adapter_loaded{adapter="sql",worker="http://10.0.0.2:8000"} 1.0\n'
        'kvflow_router_lora_adapter_loaded{adapter="chat",worker="http://10.0.0.2:8000"} 1.0\n'
        'kvflow_router_lora_adapter_loaded{adapter="gone",worker="http://10.0.0.9:8000"} 1.0\n'
    )
    assert adapters_by_role(md, pods, text) == {
        "unified": {"sql": "2/2", "chat": "1/2", "hub": "0/2"}
    }
    # an adapter taken off the list leaves status: the merge patch deletes its key
    old = {"roles": {"unified": {"ready": 2, "loraAdapters": {"sql": "2/2", "old": "1/2"}}}}
    new = {"roles": {"unified": {"ready": 2, "loraAdapters": {"sql": "2/2"}}}}
    patch = status_patch(old, new)
    assert patch == {
        "roles": {"unified": {"ready": 2, "loraAdapters": {"sql": "2/2", "old": None}}}
    }
