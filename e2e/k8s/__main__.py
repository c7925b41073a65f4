"""CLI: `python -m e2e.k8s build` resolves the binaries; `python -m e2e.k8s up` runs a
control plane until Ctrl-C (`--real-node`: plus a kubelet + containerd node that runs pods)."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from types import FrameType

import yaml

from .bins import BINARIES, LWS_BINARIES, NODE_BINARIES, BinaryResolutionError, resolve_binaries
from .config import ControlPlaneConfig
from .controlplane import ControlPlane
from .env import K8sEnv
from .ports import free_ports
from .process import ComponentError
from .realnode import HOST_BASE_IMAGE, REAL_NODE_LABEL, NodeUnavailable
from .realnode.product import adapt_model_deployment, operator_chart_values, seed_cache
from .versions import PINNED

__all__ = ["main"]

_REPO = Path(__file__).resolve().parents[2]


def _build(_: argparse.Namespace) -> int:
    names = (*BINARIES, *NODE_BINARIES, *LWS_BINARIES)
    bins = resolve_binaries(names)
    width = max(map(len, names))
    for name in names:
        print(f"{name:<{width}}  v{PINNED.of(name):<8} {bins[name]}")
    return 0


def _up(args: argparse.Namespace) -> int:
    config = ControlPlaneConfig(
        state_dir=Path(args.state_dir).resolve(),
        node_count=args.nodes,
        ready_timeout_s=args.timeout,
    )
    bins = resolve_binaries((*BINARIES, *NODE_BINARIES) if args.real_node else BINARIES)

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    plane = ControlPlane(bins, config)
    try:
        plane.start()
        if args.real_node:
            node = plane.add_real_node(bins["kubelet"], taint=not args.untainted)
            print(f"real node: {node.config.name} (label {REAL_NODE_LABEL}=true", end="")
            print(", tainted NoSchedule" if not args.untainted else "", end="")
            print(f"); image {HOST_BASE_IMAGE}; logs {node.config.logs_dir}")
            _print_product_steps(config)
        print(f"kubeconfig: {config.kubeconfig}")
        print(f"export KUBECONFIG={config.kubeconfig}")
        print(f"logs: {config.logs_dir}   (Ctrl-C stops the control plane)", flush=True)
        while True:
            time.sleep(1)
            plane.check_running()
    except KeyboardInterrupt:
        print("\nstopping the control plane...", file=sys.stderr)
        return 0
    finally:
        plane.stop()


def _print_product_steps(config: ControlPlaneConfig) -> None:
    """Write the chart values and the adapted unified example for the real node, and
    print how to run the whole product with them."""
    out = config.state_dir / "real-node-product"
    out.mkdir(parents=True, exist_ok=True)
    health_port, router_port, worker_port = free_ports(3)
    values = out / "operator-values.yaml"
    values.write_text(yaml.safe_dump(operator_chart_values(config.kubeconfig, health_port)))
    example = _REPO / "examples" / "unified-embedded.yaml"
    (body,) = [d for d in yaml.safe_load_all(example.read_text()) if d["kind"] == "ModelDeployment"]
    # The converted embedded model from the user's kvflow cache, when there is one.
    from kvflow.runtime.env import cache_dir  # light: no torch
    from kvflow.runtime.models.embedded import EMBEDDED_MODEL_NAME

    seed = seed_cache(cache_dir(), out / "seed", EMBEDDED_MODEL_NAME)
    adapted = adapt_model_deployment(body, config.kubeconfig, router_port, worker_port, seed)
    manifest = out / "unified-embedded.yaml"
    manifest.write_text(yaml.safe_dump(adapted, sort_keys=False))
    chat = '{"messages": [{"role": "user", "content": "What is the capital of France?"}]}'
    print("the whole product on the real node (docs/cluster.md, 'A real node'):")
    print(f"  helm install kvflow {_REPO / 'charts' / 'kvflow-operator'} -n kvflow-system \\")
    print(f"    --create-namespace -f {values} --wait")
    print(f"  kubectl apply -f {manifest}")
    print(f"  curl -s http://127.0.0.1:{router_port}/v1/chat/completions \\")
    print(f"    -H 'Content-Type: application/json' -d '{chat}'")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.k8s", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="resolve (download or build) the binaries, print their paths")
    up = sub.add_parser("up", help="start a control plane and keep it running until Ctrl-C")
    up.add_argument(
        "--state-dir",
        default=str(K8sEnv.from_environ().state_dir),
        help="wiped and reused (default %(default)s)",
    )
    # Defaults come from the config dataclass (its class attributes hold them).
    up.add_argument(
        "--nodes",
        type=int,
        default=ControlPlaneConfig.node_count,
        help="fake kwok nodes (default %(default)s)",
    )
    up.add_argument(
        "--timeout",
        type=float,
        default=ControlPlaneConfig.ready_timeout_s,
        help="seconds each component may take to become ready (default %(default)s)",
    )
    up.add_argument(
        "--real-node",
        action="store_true",
        help="also run a real node (containerd + kubelet on loopback; needs root and "
        "the Debian packages make setup installs) whose pods really run",
    )
    up.add_argument(
        "--untainted",
        action="store_true",
        help=f"no NoSchedule taint on the real node (default: pods need a {REAL_NODE_LABEL} "
        "toleration); use with --nodes 0 so every pod lands on it",
    )
    args = parser.parse_args(argv)
    try:
        return _build(args) if args.command == "build" else _up(args)
    except (BinaryResolutionError, ComponentError, NodeUnavailable) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
