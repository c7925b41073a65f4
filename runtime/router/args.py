"""``kvflow router`` arguments: the contract's ``ROUTER_FLAGS`` plus router-only tuning flags.

Tuning flags are generated from the config dataclasses (``--health-interval-s`` from
``HealthConfig.interval_s`` and so on), so their defaults live in one place.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing

from kvflow import contract
from kvflow.runtime.router.config import (
    AdmissionConfig,
    BreakerConfig,
    CacheAwareConfig,
    HealthConfig,
    RetryConfig,
    RouterConfig,
)
from kvflow.runtime.router.discovery import WorkerSpec
from kvflow.runtime.router.policies import POLICIES

__all__ = ["build_parser", "parse_args", "static_specs"]

# config section -> (its dataclass, flag prefix)
_SECTIONS: dict[str, tuple[type, str]] = {
    "health": (HealthConfig, "health"),
    "breaker": (BreakerConfig, "breaker"),
    "retry": (RetryConfig, "retry"),
    "admission": (AdmissionConfig, ""),
    "cache_aware": (CacheAwareConfig, ""),
}


# flag -> help of the generated tuning flags (defaults are appended by the formatter)
_HELP = {
    "--health-interval-s": "seconds between active checks (GET /health, then /metrics for load)",
    "--health-timeout-s": "timeout of one check",
    "--health-failure-threshold": "failed checks in a row that mark a worker unhealthy",
    "--health-success-threshold": "passed checks in a row that mark it healthy again",
    "--breaker-failure-threshold": "request failures in a row (connect error, 5xx) that open a breaker",
    "--breaker-cooldown-s": "open -> half-open after this long; one probe per cooldown",
    "--retry-max-retries": "retries on other workers, before the client saw a byte",
    "--retry-initial-backoff-s": "first backoff; doubles each retry",
    "--retry-max-backoff-s": "backoff cap",
    "--retry-jitter": "random fraction taken off each backoff",
    "--retry-budget-s": "total time the retries of one request may take",
    "--max-concurrent": "requests forwarded at once",
    "--max-queued": "requests waiting for a slot; past it 429",
    "--queue-timeout-s": "longest wait for a slot; past it 429",
    "--request-timeout-s": "whole-request limit (504, or an SSE error event once streaming)",
    "--retry-after-s": "Retry-After of a 429",
    "--cache-threshold": "cache_aware: route by prefix when matched/prompt length >= this",
    "--balance-abs-threshold": "cache_aware: imbalanced when max-min load > this ...",
    "--balance-rel-threshold": "cache_aware: ... and max load > min load * this",
    "--max-tree-size": "cache_aware: characters (or token ids) kept per worker tree (LRU)",
}


def _flag(prefix: str, name: str) -> str:
    return "--" + "-".join(p for p in (prefix, name) if p).replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvflow router",
        description="Route OpenAI-compatible requests over kvflow (or SGLang) workers.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    group = parser.add_argument_group("router contract (what the operator sets)")
    for flag, text in contract.ROUTER_FLAGS.items():
        kwargs: dict = {"help": text}
        if flag == "--port":
            kwargs.update(type=int, default=RouterConfig.port)
        elif flag == "--host":
            kwargs["default"] = RouterConfig.host
        elif flag == "--policy":
            kwargs.update(choices=POLICIES.choices(), default=RouterConfig.policy)
        elif flag.endswith("-urls"):
            kwargs["default"] = ""
        elif flag == "--lora-adapters":
            kwargs["default"] = None
        group.add_argument(flag, **kwargs)
    router = parser.add_argument_group("router")
    router.add_argument(
        "--bootstrap-port",
        type=int,
        default=RouterConfig.bootstrap_port,
        help="prefill bootstrap port when a prefill URL does not name one (URL#PORT)",
    )
    router.add_argument(
        "--connect-timeout-s",
        type=float,
        default=RouterConfig.connect_timeout_s,
        help="timeout of a TCP connect to a worker",
    )
    router.add_argument("--log-level", default=RouterConfig.log_level, help="logging level")
    router.add_argument(
        "--admin-port",
        type=int,
        default=None,
        help="serve the admin routes (/workers) on this port only, not on --port",
    )
    router.add_argument(
        "--admin-host",
        default=RouterConfig.admin_host,
        help="the address the admin port binds (with --admin-port)",
    )
    for section, (cls, prefix) in _SECTIONS.items():
        sub = parser.add_argument_group(section.replace("_", " "))
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = _flag(prefix, f.name)
            sub.add_argument(flag, type=hints[f.name], default=f.default, help=_HELP[flag])
    return parser


def _urls(value: str) -> tuple[str, ...]:
    return tuple(u.strip().rstrip("/") for u in value.split(",") if u.strip())


def parse_args(argv: list[str]) -> RouterConfig:
    parser = build_parser()
    ns = parser.parse_args(argv)
    sections = {
        section: cls(
            **{
                f.name: getattr(ns, _flag(prefix, f.name)[2:].replace("-", "_"))
                for f in dataclasses.fields(cls)
            }
        )
        for section, (cls, prefix) in _SECTIONS.items()
    }
    config = RouterConfig(
        host=ns.host,
        port=ns.port,
        policy=ns.policy,
        worker_urls=_urls(ns.worker_urls),
        prefill_urls=_urls(ns.prefill_urls),
        decode_urls=_urls(ns.decode_urls),
        discover_namespace=ns.discover_namespace or None,
        discover_selector=ns.discover_selector or None,
        lora_adapters=_lora_adapters(parser, ns.lora_adapters),
        bootstrap_port=ns.bootstrap_port,
        api_key=os.environ.get(contract.API_KEY_ENV) or None,
        internal_key=os.environ.get(contract.INTERNAL_KEY_ENV) or None,
        connect_timeout_s=ns.connect_timeout_s,
        log_level=ns.log_level,
        admin_host=ns.admin_host,
        admin_port=ns.admin_port,
        **sections,
    )
    if config.admin_port is not None and config.admin_port == config.port:
        parser.error("--admin-port must differ from --port")
    if config.discovers and (config.worker_urls or config.prefill_urls or config.decode_urls):
        parser.error("give worker URLs or --discover-*, not both")
    if config.discovers and config.lora_adapters is not None:
        parser.error(
            "--lora-adapters is for static workers; discovered pods carry their own "
            f"({contract.LORA_ADAPTERS_ANNOTATION})"
        )
    if bool(config.prefill_urls) != bool(config.decode_urls):
        parser.error("PD mode needs both --prefill-urls and --decode-urls")
    try:
        static_specs(config)
    except ValueError as err:
        parser.error(str(err))
    return config


def _lora_adapters(
    parser: argparse.ArgumentParser, value: str | None
) -> tuple[tuple[str, str], ...] | None:
    if value is None:
        return None
    try:
        return tuple(sorted(contract.parse_lora_adapters(value).items()))
    except ValueError as err:
        parser.error(f"--lora-adapters: {err}")


def static_specs(config: RouterConfig) -> list[WorkerSpec]:
    """The workers the flags name; a prefill entry may carry its bootstrap port as ``URL#PORT``.
    Each keeps ``--lora-adapters`` loaded when it is given."""
    lora = config.lora_adapters
    specs = [WorkerSpec(url, lora_adapters=lora) for url in config.worker_urls]
    for entry in config.prefill_urls:
        url, _, port = entry.partition("#")
        bootstrap = int(port) if port else config.bootstrap_port
        specs.append(WorkerSpec(url.rstrip("/"), "prefill", bootstrap, lora))
    specs += [WorkerSpec(url, "decode", lora_adapters=lora) for url in config.decode_urls]
    return specs
