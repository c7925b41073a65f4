"""``kvflow up -f md.yaml``: run a ModelDeployment's topology as local processes."""

from __future__ import annotations

import argparse
import base64
import json
import shlex
import signal
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from kvflow.operator import SpecError, parse_model_deployment

from .plan import LOOPBACK, LocalPlan, LocalRefusal, local_gpu_count, local_plan
from .supervisor import Console, RoleFailed, RoleProcess, Supervisor

__all__ = ["main"]

QUESTION = "What is the capital of France?"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvflow up",
        description="Run a ModelDeployment as local processes: the Mooncake master or a file "
        "store, the workers (unified, or prefill + decode) and the router, on 127.0.0.1.",
    )
    parser.add_argument("-f", "--file", required=True, help="YAML with one ModelDeployment")
    parser.add_argument(
        "--port", type=int, default=None, help="router port (default: spec.endpoint.port)"
    )
    parser.add_argument(
        "--state-dir",
        default=None,
        help="logs, file store and Mooncake config (default: a new temporary folder)",
    )
    parser.add_argument(
        "--max-restarts", type=int, default=3, help="restarts of a crashed process before giving up"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the processes and exit without starting"
    )
    return parser


def read_file(path: Path) -> tuple[dict[str, Any], dict[str, dict[str, str]]]:
    """The ModelDeployment document of ``path`` and the Secrets beside it (name -> data)."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]
    found = [d for d in docs if d.get("kind") == "ModelDeployment"]
    if len(found) != 1:
        raise SpecError("kind", f"{path} must hold exactly one ModelDeployment, found {len(found)}")
    body = found[0]
    meta = body.setdefault("metadata", {})
    meta.setdefault("namespace", "default")
    meta.setdefault("uid", "local")
    meta.setdefault("generation", 1)
    secrets: dict[str, dict[str, str]] = {}
    for doc in docs:
        if doc.get("kind") != "Secret":
            continue
        data = {k: base64.b64decode(v).decode() for k, v in (doc.get("data") or {}).items()}
        data.update({k: str(v) for k, v in (doc.get("stringData") or {}).items()})
        secrets[str(doc["metadata"]["name"])] = data
    return body, secrets


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def _port_taken(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return True
    return False


def _model_id(plan: LocalPlan) -> str:
    """The model name the endpoint reports (what a client puts in ``model``)."""
    headers = {"Authorization": f"Bearer {plan.api_key}"} if plan.api_key else {}
    request = urllib.request.Request(f"{plan.endpoint}/v1/models", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return str(json.load(answer)["data"][0]["id"])
    except (OSError, ValueError, KeyError, IndexError):
        return "default"  # kvflow serves one model and does not check the name


def curl_line(plan: LocalPlan, model: str) -> str:
    """A ready-to-paste chat request to the endpoint."""
    body = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 32}
    parts = ["curl", f"{plan.endpoint}/v1/chat/completions", "-H", "Content-Type: application/json"]
    if plan.api_key:
        parts += ["-H", f"Authorization: Bearer {plan.api_key}"]
    parts += ["-d", json.dumps(body)]
    return shlex.join(parts)


def _print_plan(plan: LocalPlan, console: Console) -> None:
    for process in plan.processes:
        console.line(f"{process.name}: {shlex.join(process.argv)}")
    if plan.not_applied:
        console.line("cluster-only fields, not applied locally: " + ", ".join(plan.not_applied))


def _run(plan: LocalPlan, state_dir: Path, console: Console, max_restarts: int) -> int:
    stop = threading.Event()

    def on_signal(signum: int, _: Any) -> None:
        console.line(f"{signal.Signals(signum).name}: stopping")
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    supervisor = Supervisor(plan, state_dir / "logs", console, max_restarts)
    started = time.monotonic()
    try:
        if not supervisor.start(stop):
            return 0
        console.line(f"ready in {time.monotonic() - started:.1f} s")
        console.line(f"endpoint: {plan.endpoint}/v1")
        console.line(f"try: {curl_line(plan, _model_id(plan))}")

        def back(role: RoleProcess) -> None:
            console.line(f"{role.spec.name} healthy again")

        supervisor.watch(stop, back)
        return 0
    except RoleFailed as err:
        console.line(f"failed: {err}")
        return 1
    finally:
        supervisor.shutdown()
        console.line("stopped")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    console = Console(sys.stdout)
    try:
        body, secrets = read_file(Path(args.file))
        md = parse_model_deployment(body)
    except (OSError, yaml.YAMLError, SpecError) as err:
        print(f"kvflow up: {err}", file=sys.stderr)
        return 2
    port = md.endpoint.port if args.port is None else args.port
    if not args.dry_run and _port_taken(port):
        print(
            f"kvflow up: port {port} is in use on {LOOPBACK}; pick another with --port",
            file=sys.stderr,
        )
        return 2
    state_dir = Path(args.state_dir or tempfile.mkdtemp(prefix=f"kvflow-up-{md.name}-"))
    (state_dir / "logs").mkdir(parents=True, exist_ok=True)
    try:
        plan = local_plan(md, body, secrets, state_dir, port, _free_port, local_gpu_count())
    except LocalRefusal as err:
        print(f"kvflow up: {args.file} cannot run locally:", file=sys.stderr)
        for reason in err.reasons:
            print(f"  {reason}", file=sys.stderr)
        return 2
    console.line(f"{md.name} ({md.mode}) from {args.file}, state in {state_dir}")
    _print_plan(plan, console)
    if args.dry_run:
        return 0
    return _run(plan, state_dir, console, args.max_restarts)
