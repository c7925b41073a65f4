"""``kvflow up``'s local placement, without starting anything: the processes of each
example, what a cluster-only field does, and what is refused locally."""

from __future__ import annotations

import copy
import itertools
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvflow import contract
from kvflow.operator import parse_model_deployment
from kvflow.up.cli import read_file
from kvflow.up.plan import LocalRefusal, local_plan

REPO = Path(__file__).resolve().parents[2]
UNIFIED = REPO / "examples" / "unified-embedded.yaml"
DISAGGREGATED = REPO / "examples" / "disaggregated-hicache.yaml"


def plan_of(
    body: dict[str, Any], secrets: dict[str, dict[str, str]], tmp_path: Path, gpus: int = 0
):
    ports = itertools.count(20000)
    return local_plan(
        parse_model_deployment(body), body, secrets, tmp_path, 8000, lambda: next(ports), gpus
    )


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_unified_example_is_workers_then_a_router_given_their_urls(tmp_path: Path) -> None:
    body, secrets = read_file(UNIFIED)
    plan = plan_of(body, secrets, tmp_path)
    names = [p.name for p in plan.processes]
    assert names == ["unified-0", "unified-1", "router"]
    workers, router = plan.processes[:2], plan.processes[2]
    for worker in workers:
        assert worker.argv[:5] == [sys.executable, "-P", "-m", "kvflow", "serve"]
        assert flag(worker.argv, "--host") == "127.0.0.1" and "--model-path" not in worker.argv
        assert worker.health.url == f"http://127.0.0.1:{flag(worker.argv, '--port')}/health"
        assert worker.env[contract.POD_IP_ENV] == "127.0.0.1" and worker.stage == 1
    urls = [f"http://127.0.0.1:{flag(w.argv, '--port')}" for w in workers]
    assert flag(router.argv, "--worker-urls") == ",".join(urls)
    assert flag(router.argv, "--port") == "8000" and router.stage == 2
    assert router.health.path == contract.ROUTER_READINESS_PATH
    assert plan.endpoint == "http://127.0.0.1:8000" and plan.api_key is None
    assert plan.not_applied == ["unified.resources"]


def test_same_runtime_options_as_the_operator_at_another_placement(tmp_path: Path) -> None:
    """Only placement flags differ between a pod's command and the local process's."""
    from kvflow.operator import render_children

    body, secrets = read_file(DISAGGREGATED)
    md = parse_model_deployment(body)
    plan = plan_of(body, secrets, tmp_path)
    pods = {
        c["metadata"]["labels"]["kvflow.dev/role"]: c["spec"]["template"]["spec"]["containers"][0]
        for c in render_children(md)
        if c["kind"] == "Deployment"
    }
    placement = {"--host", "--port", "--bootstrap-port", "--hicache-storage-path", "--model-path"}

    def runtime_flags(argv: list[str]) -> dict[str, str]:
        pairs = itertools.pairwise(argv)
        return {a: b for a, b in pairs if a.startswith("--") and a not in placement}

    for process in plan.processes:
        role = process.name.rsplit("-", 1)[0]
        if role in ("prefill", "decode"):
            cluster = pods[role]["command"]
            assert runtime_flags(process.argv[5:]) == runtime_flags(cluster[2:])
    by_name = {p.name: p for p in plan.processes}
    master, prefill = by_name["mooncake-master"], by_name["prefill-0"]
    rpc = flag(prefill.argv, "--hicache-storage-path")
    assert rpc == f"127.0.0.1:{master.health.port}" and master.stage == 0
    assert "--rpc_address=127.0.0.1" in master.argv
    assert "--enable_http_metadata_server=false" in master.argv
    assert master.env == {}  # the spec gives the master no env
    # Mooncake's own metadata server, on loopback (the master's built-in one binds every
    # interface whatever its host flag says)
    metadata = by_name["mooncake-metadata"]
    assert metadata.argv[1:3] == ["--host", "127.0.0.1"] and metadata.stage == 0
    assert metadata.argv[-1] == str(metadata.health.port)
    router = plan.processes[-1]
    bootstrap = flag(prefill.argv, "--bootstrap-port")
    assert flag(router.argv, "--prefill-urls") == (
        f"http://127.0.0.1:{flag(prefill.argv, '--port')}#{bootstrap}"
    )
    assert len(flag(router.argv, "--decode-urls").split(",")) == 2
    # The API key comes from the Secret in the same file, to every process.
    assert plan.api_key == "change-me"
    assert all(p.env.get(contract.API_KEY_ENV) == "change-me" for p in plan.processes[2:])
    config = Path(prefill.env[contract.MOONCAKE_CONFIG_ENV])
    assert config.parent == tmp_path and f'"127.0.0.1:{master.health.port}"' in config.read_text()


def edited(path: Path, edit: Any) -> tuple[dict[str, Any], dict[str, dict[str, str]]]:
    body, secrets = read_file(path)
    body = copy.deepcopy(body)
    edit(body["spec"])
    return body, secrets


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (
            lambda s: s.update(model={"source": "pvc", "pvc": {"claimName": "m"}}),
            "spec.model.source pvc",
        ),
        (lambda s: s["unified"].update(gpus=1), "spec.*.gpus: 2 GPUs asked, 0 on this machine"),
        (
            lambda s: s["unified"].update(
                autoscaling={"enabled": True, "targets": {"queuePerReplica": 4}}
            ),
            "spec.unified.autoscaling.enabled",
        ),
        (
            lambda s: s["unified"].update(
                volumes=[{"name": "d", "emptyDir": {}}],
                volumeMounts=[{"name": "d", "mountPath": "/d"}],
            ),
            "spec.unified.volumes/volumeMounts",
        ),
        (
            lambda s: s["router"].update(
                env=[{"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
            ),
            "spec.router.env[X]: valueFrom",
        ),
        (
            lambda s: s.update(endpoint={"apiKeySecretRef": {"name": "elsewhere"}}),
            "put the Secret 'elsewhere'",
        ),
        (lambda s: s.update(kvTransfer={"protocol": "rdma"}), "rdma"),
        (lambda s: s["unified"].update(nodesPerReplica=2), "spec.unified.nodesPerReplica 2"),
    ],
)
def test_what_cannot_be_honoured_locally_is_refused(tmp_path: Path, edit: Any, reason: str) -> None:
    body, secrets = edited(UNIFIED, edit)
    if reason == "rdma" and Path("/sys/class/infiniband").is_dir():
        pytest.skip("this machine has RDMA devices")
    with pytest.raises(LocalRefusal) as refused:
        plan_of(body, secrets, tmp_path)
    assert any(reason in line for line in refused.value.reasons), refused.value.reasons


def test_gpus_are_given_out_one_process_at_a_time(tmp_path: Path) -> None:
    body, secrets = edited(UNIFIED, lambda s: s["unified"].update(gpus=2))
    plan = plan_of(body, secrets, tmp_path, gpus=4)
    devices = [p.env.get("CUDA_VISIBLE_DEVICES") for p in plan.processes]
    assert devices == ["0,1", "2,3", None]
    # every GPU of a worker is used, as in a pod: one copy over both (--tp-size 2)
    assert [flag(p.argv, "--tp-size") for p in plan.processes[:2]] == ["2", "2"]
    assert all("--dp-size" not in p.argv for p in plan.processes)


def test_tensor_parallel_size_splits_a_worker_into_data_parallel_copies(tmp_path: Path) -> None:
    body, secrets = edited(
        UNIFIED, lambda s: s["unified"].update(replicas=1, gpus=4, tensorParallelSize=2)
    )
    (worker, _router) = plan_of(body, secrets, tmp_path, gpus=4).processes
    assert worker.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert (flag(worker.argv, "--tp-size"), flag(worker.argv, "--dp-size")) == ("2", "2")


def test_cli_refuses_with_every_reason_and_dry_run_prints_the_commands(tmp_path: Path) -> None:
    spec = tmp_path / "md.yaml"
    body, _ = edited(
        UNIFIED, lambda s: s.update(model={"source": "huggingFace", "huggingFace": {"id": "a/b"}})
    )
    body["spec"]["unified"]["autoscaling"] = {"enabled": True, "targets": {"itlMs": 5}}
    spec.write_text(yaml.safe_dump(body))
    run = [sys.executable, "-P", "-m", "kvflow", "up", "-f", str(spec)]
    refused = subprocess.run(run, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert refused.returncode == 2
    assert "cannot run locally" in refused.stderr
    assert "spec.model.source huggingFace" in refused.stderr
    assert "spec.unified.autoscaling.enabled" in refused.stderr
    dry = subprocess.run(
        [*run[:-1], str(UNIFIED), "--dry-run", "--state-dir", str(tmp_path / "s")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert dry.returncode == 0, dry.stderr
    assert "[kvflow up] router: " in dry.stdout and "--worker-urls" in dry.stdout
    assert "not applied locally: unified.resources" in dry.stdout


def test_file_store_is_a_local_directory_and_host_path_models_are_used_in_place(
    tmp_path: Path,
) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()

    def file_store(spec: dict[str, Any]) -> None:
        spec["model"] = {"source": "hostPath", "hostPath": {"path": str(model_dir)}}
        spec["hiCache"] = {
            "hostMemory": "1Gi",
            "sharedStore": {"type": "file", "size": "10Gi", "storageClassName": "nfs"},
        }

    body, secrets = edited(UNIFIED, file_store)
    state = tmp_path / "state"
    state.mkdir()
    plan = plan_of(body, secrets, state)
    worker = plan.processes[0]
    assert flag(worker.argv, "--hicache-storage") == "file"
    assert flag(worker.argv, "--hicache-storage-path") == str(state / "hicache")
    assert (state / "hicache").is_dir()
    assert flag(worker.argv, "--model-path") == str(model_dir)
    assert "mooncake-master" not in [p.name for p in plan.processes]
    assert "hiCache.sharedStore.storageClassName" in plan.not_applied
    body["spec"]["router"]["replicas"] = 2
    assert "router.replicas (one local router)" in plan_of(body, secrets, state).not_applied
    # A host path that is not a folder here is refused.
    body["spec"]["model"]["hostPath"]["path"] = str(tmp_path / "absent")
    with pytest.raises(LocalRefusal, match="is not a folder here"):
        plan_of(body, secrets, state)


def test_env_values_reach_their_role(tmp_path: Path) -> None:
    def env(spec: dict[str, Any]) -> None:
        spec["prefill"]["env"] = [{"name": "KVFLOW_LOG_LEVEL", "value": "debug"}]
        spec["mooncakeMaster"] = {"env": [{"name": "GLOG_v", "value": "1"}]}

    body, secrets = edited(DISAGGREGATED, env)
    by_name = {p.name: p for p in plan_of(body, secrets, tmp_path).processes}
    assert by_name["prefill-0"].env["KVFLOW_LOG_LEVEL"] == "debug"
    assert "KVFLOW_LOG_LEVEL" not in by_name["decode-0"].env
    assert by_name["mooncake-master"].env == {"GLOG_v": "1"}


def test_a_disaggregated_run_shares_one_fresh_internal_key(tmp_path: Path) -> None:
    """Router and PD workers get the same key (the router signs pairs, the decode checks
    them, the prefill's bootstrap routes require it); each run draws a new one."""
    body, secrets = edited(DISAGGREGATED, lambda spec: None)
    keys = []
    for _ in range(2):
        processes = plan_of(body, secrets, tmp_path).processes
        kvflow = [p for p in processes if p.argv[2:4] == ["-m", "kvflow"]]
        assert {p.name for p in kvflow} == {"prefill-0", "decode-0", "decode-1", "router"}
        keys.append({p.env.get(contract.INTERNAL_KEY_ENV) for p in kvflow})
    assert all(len(k) == 1 and None not in k for k in keys) and keys[0] != keys[1]


def test_lora_adapters_are_local_folders_the_router_loads(tmp_path: Path) -> None:
    """``spec.lora``: every worker runs ``--enable-lora`` with the spec's slots, and the
    router is told to keep each ``hostPath`` adapter loaded on every worker (as it does for
    pods in a cluster); Hub and claim adapters, or a folder missing here, are refused."""
    from kvflow.runtime.router.args import parse_args

    folder = tmp_path / "adapters" / "sql"
    folder.mkdir(parents=True)
    sql = {"name": "sql", "source": "hostPath", "hostPath": {"path": str(folder)}}
    body, secrets = edited(UNIFIED, lambda s: s.update(lora={"maxLoraRank": 8, "adapters": [sql]}))
    plan = plan_of(body, secrets, tmp_path)
    workers, router = plan.processes[:2], plan.processes[2]
    for worker in workers:
        assert "--enable-lora" in worker.argv and flag(worker.argv, "--max-lora-rank") == "8"
    assert flag(router.argv, "--lora-adapters") == f"sql={folder}"
    assert parse_args(router.argv[5:]).lora_adapters == (("sql", str(folder)),)
    hub = {"name": "hub", "source": "huggingFace", "huggingFace": {"id": "org/x"}}
    gone = {"name": "gone", "source": "hostPath", "hostPath": {"path": "/var/tmp/no/such"}}
    body, secrets = edited(UNIFIED, lambda s: s.update(lora={"adapters": [hub, gone]}))
    with pytest.raises(LocalRefusal) as refused:
        plan_of(body, secrets, tmp_path)
    assert refused.value.reasons == [
        "spec.lora.adapters[0].source huggingFace: not reachable locally (a local folder: "
        "source hostPath)",
        "spec.lora.adapters[1].hostPath.path: /var/tmp/no/such is not a folder here",
    ]
