"""Writes the chart's Grafana dashboards (charts/kvflow-operator/files/dashboards/*.json).

Each dashboard is a list of panels, each panel a list of PromQL queries over metrics the
runtime (runtime/server/metrics.py), the router (runtime/router/metrics.py) and the
operator's autoscaler (operator/autoscale/metrics.py) export. tests/operator/
test_dashboards_prometheus.py evaluates every query against a real Prometheus scraping real
servers; tests/operator/test_autoscale_chart.py checks the files are this script's output.

    .venv/bin/python -P scripts/gen_dashboards.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[1] / "charts/kvflow-operator/files/dashboards"

RT = '{namespace=~"$namespace", model_name=~"$model"}'  # runtime series of the selection
NS = '{namespace=~"$namespace"}'
AS = '{namespace=~"$namespace", deployment=~"$deployment"}'
RATE = "[$__rate_interval]"


def quantiles(metric: str, sel: str = RT, by: str = "") -> list[tuple[str, str]]:
    group = f"le{', ' + by if by else ''}"
    return [
        (
            f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{sel}{RATE})))",
            f"p{int(q * 100)}{' {{' + by + '}}' if by else ''}",
        )
        for q in (0.5, 0.9, 0.99)
    ]


# dashboard uid -> (title, variables, [(panel title, unit, [(expr, legend)])])
RUNTIME_VARS = ("namespace", "model")
DASHBOARDS: dict[str, tuple[str, tuple[str, ...], list[tuple[str, str, list[tuple[str, str]]]]]] = {
    "kvflow-overview": (
        "kvflow / Overview and SLO",
        RUNTIME_VARS,
        [
            (
                "Requests per second",
                "reqps",
                [
                    (f"sum(rate(sglang:num_requests_total{RT}{RATE}))", "finished"),
                ],
            ),
            ("Time to first token", "s", quantiles("sglang:time_to_first_token_seconds")),
            ("Inter-token latency", "s", quantiles("sglang:inter_token_latency_seconds")),
            ("End-to-end latency", "s", quantiles("sglang:e2e_request_latency_seconds")),
            (
                "Tokens per second",
                "short",
                [
                    (f"sum(rate(sglang:generation_tokens_total{RT}{RATE}))", "generated"),
                    (f"sum(rate(sglang:prompt_tokens_total{RT}{RATE}))", "prompt"),
                ],
            ),
            (
                "Generation throughput per pod (5 s)",
                "short",
                [
                    (f"sum by (pod) (sglang:gen_throughput{RT})", "{{pod}}"),
                ],
            ),
            (
                "Queued and running requests per pod",
                "short",
                [
                    (f"sum by (pod) (sglang:num_queue_reqs{RT})", "queued {{pod}}"),
                    (f"sum by (pod) (sglang:num_running_reqs{RT})", "running {{pod}}"),
                    (
                        f"sum by (pod) (sglang:num_grammar_queue_reqs{RT})",
                        "compiling grammar {{pod}}",
                    ),
                ],
            ),
            (
                "Aborted and rejected requests per second",
                "reqps",
                [
                    (f"sum(rate(sglang:num_aborted_requests_total{RT}{RATE}))", "aborted"),
                    (
                        f"sum by (reason) (rate(kvflow:num_rejected_requests_total{RT}{RATE}))",
                        "rejected {{reason}}",
                    ),
                ],
            ),
            (
                "SLO: share of first tokens within 1 s",
                "percentunit",
                [
                    (
                        f'sum(rate(sglang:time_to_first_token_seconds_bucket{{namespace=~"$namespace", '
                        f'model_name=~"$model", le="1.0"}}{RATE})) / '
                        f"sum(rate(sglang:time_to_first_token_seconds_count{RT}{RATE}))",
                        "TTFT <= 1 s",
                    ),
                ],
            ),
        ],
    ),
    "kvflow-kv-cache": (
        "kvflow / KV cache",
        RUNTIME_VARS,
        [
            (
                "KV cache used by requests",
                "percentunit",
                [
                    (f"max by (pod) (sglang:token_usage{RT})", "{{pod}}"),
                ],
            ),
            (
                "KV cache held by the prefix cache",
                "percentunit",
                [
                    (f"max by (pod) (kvflow:prefix_cache_usage{RT})", "{{pod}}"),
                ],
            ),
            (
                "Prefix cache hit rate (window)",
                "percentunit",
                [
                    (
                        f"sum(rate(sglang:cached_tokens_total{RT}{RATE})) / "
                        f"sum(rate(sglang:prompt_tokens_total{RT}{RATE}))",
                        "cached / prompt tokens",
                    ),
                ],
            ),
            (
                "Prefix cache hit rate since start",
                "percentunit",
                [
                    (f"max by (pod) (sglang:cache_hit_rate{RT})", "{{pod}}"),
                ],
            ),
            (
                "KV pool pages",
                "short",
                [
                    (
                        f"max by (pod, page_size, num_pages) (sglang:cache_config_info{RT})",
                        "{{pod}}: {{num_pages}} pages of {{page_size}}",
                    ),
                ],
            ),
        ],
    ),
    "kvflow-hicache": (
        "kvflow / HiCache tiers",
        RUNTIME_VARS,
        [
            (
                "Host tier used",
                "percentunit",
                [
                    (
                        f"sum by (pod) (sglang:hicache_host_used_tokens{RT}) / "
                        f"sum by (pod) (sglang:hicache_host_total_tokens{RT})",
                        "{{pod}}",
                    ),
                ],
            ),
            (
                "Prompt tokens found per tier per second",
                "short",
                [
                    (
                        f"sum by (tier) (rate(kvflow:hicache_hit_tokens_total{RT}{RATE}))",
                        "{{tier}}",
                    ),
                ],
            ),
            (
                "Hit rate per tier",
                "percentunit",
                [
                    (
                        f"sum by (tier) (rate(kvflow:hicache_hit_tokens_total{RT}{RATE})) / "
                        f"scalar(sum(rate(sglang:prompt_tokens_total{RT}{RATE})))",
                        "{{tier}}",
                    ),
                ],
            ),
            (
                "Tokens moved between tiers per second",
                "short",
                [
                    (f"sum(rate(sglang:backuped_tokens_total{RT}{RATE}))", "device to host"),
                    (f"sum(rate(sglang:load_back_tokens_total{RT}{RATE}))", "back to device"),
                    (
                        f"sum(rate(sglang:prefetched_tokens_total{RT}{RATE}))",
                        "prefetched from storage",
                    ),
                    (
                        f"sum(rate(kvflow:hicache_dropped_tokens_total{RT}{RATE}))",
                        "dropped (no host room)",
                    ),
                ],
            ),
            (
                "Storage tier bytes per second",
                "Bps",
                [
                    (f"sum by (op) (rate(kvflow:hicache_storage_bytes_total{RT}{RATE}))", "{{op}}"),
                ],
            ),
            (
                "Storage tier time per call",
                "s",
                [
                    (
                        f"sum by (op) (rate(kvflow:hicache_storage_seconds_total{RT}{RATE})) / "
                        f"sum by (op) (rate(kvflow:hicache_storage_ops_total{RT}{RATE}))",
                        "{{op}}",
                    ),
                ],
            ),
            (
                "Storage errors and prefetch outcomes per second",
                "short",
                [
                    (f"sum(rate(kvflow:hicache_storage_errors_total{RT}{RATE}))", "errors"),
                    (
                        f"sum by (outcome) (rate(kvflow:hicache_prefetch_total{RT}{RATE}))",
                        "prefetch {{outcome}}",
                    ),
                ],
            ),
        ],
    ),
    "kvflow-pd": (
        "kvflow / Prefill-decode disaggregation",
        RUNTIME_VARS,
        [
            (
                "Prefill: requests waiting for their decode or being sent",
                "short",
                [
                    (f"sum by (pod) (sglang:num_prefill_inflight_queue_reqs{RT})", "{{pod}}"),
                ],
            ),
            (
                "Decode: pre-allocation and transfer queues",
                "short",
                [
                    (
                        f"sum by (pod) (sglang:num_decode_prealloc_queue_reqs{RT})",
                        "prealloc {{pod}}",
                    ),
                    (
                        f"sum by (pod) (sglang:num_decode_transfer_queue_reqs{RT})",
                        "transfer {{pod}}",
                    ),
                ],
            ),
            (
                "KV transfer GB/s (window)",
                "short",
                [
                    (
                        f"sum by (pod) (rate(kvflow:kv_transfer_bytes_total{RT}{RATE})) / 1e9",
                        "{{pod}}",
                    ),
                ],
            ),
            ("KV write latency", "s", quantiles("kvflow:kv_transfer_seconds")),
            (
                "Latest KV write",
                "short",
                [
                    (f"max by (pod) (sglang:kv_transfer_speed_gb_s{RT})", "GB/s {{pod}}"),
                    (f"max by (pod) (sglang:kv_transfer_latency_ms{RT})", "ms {{pod}}"),
                ],
            ),
            (
                "Failed KV transfers per second",
                "reqps",
                [
                    (
                        f"sum by (pod) (rate(sglang:num_transfer_failed_reqs_total{RT}{RATE}))",
                        "{{pod}}",
                    ),
                ],
            ),
        ],
    ),
    "kvflow-router": (
        "kvflow / Router",
        ("namespace",),
        [
            (
                "Requests per second by status",
                "reqps",
                [
                    (
                        f"sum by (status) (rate(kvflow_router_requests_total{NS}{RATE}))",
                        "{{status}}",
                    ),
                ],
            ),
            (
                "In flight per worker",
                "short",
                [
                    (f"sum by (worker) (kvflow_router_in_flight{NS})", "{{worker}}"),
                ],
            ),
            (
                "Load per worker (own in-flight + reported)",
                "short",
                [
                    (f"max by (worker) (kvflow_router_worker_load{NS})", "{{worker}}"),
                ],
            ),
            (
                "Worker health and circuit breaker",
                "short",
                [
                    (f"min by (worker) (kvflow_router_worker_healthy{NS})", "healthy {{worker}}"),
                    (f"max by (worker) (kvflow_router_breaker_state{NS})", "breaker {{worker}}"),
                ],
            ),
            (
                "Retries and router rejections per second",
                "reqps",
                [
                    (
                        f"sum by (route) (rate(kvflow_router_retries_total{NS}{RATE}))",
                        "retries {{route}}",
                    ),
                    (
                        f"sum by (reason) (rate(kvflow_router_rejected_total{NS}{RATE}))",
                        "rejected {{reason}}",
                    ),
                    (
                        f"sum by (state) (rate(kvflow_router_breaker_transitions_total{NS}{RATE}))",
                        "breaker to {{state}}",
                    ),
                ],
            ),
            (
                "Admission queue",
                "short",
                [
                    (f"sum(kvflow_router_queue_length{NS})", "waiting"),
                    *quantiles("kvflow_router_queue_wait_seconds", NS)[1:2],
                ],
            ),
            (
                "Upstream time to first byte p90 per worker",
                "s",
                [
                    quantiles("kvflow_router_upstream_ttfb_seconds", NS, "worker")[1],
                ],
            ),
            (
                "cache_aware prefix match ratio",
                "percentunit",
                [
                    quantiles("kvflow_router_cache_match_ratio", NS)[0],
                ],
            ),
        ],
    ),
    "kvflow-autoscaler": (
        "kvflow / Autoscaler",
        ("namespace", "deployment"),
        [
            (
                "Desired vs current replicas",
                "short",
                [
                    (
                        f"max by (deployment, role) (kvflow_autoscaler_desired_replicas{AS})",
                        "desired {{deployment}}/{{role}}",
                    ),
                    (
                        f"max by (deployment, role) (kvflow_autoscaler_current_replicas{AS})",
                        "current {{deployment}}/{{role}}",
                    ),
                    (
                        f"max by (deployment, role) (kvflow_autoscaler_ready_replicas{AS})",
                        "ready {{deployment}}/{{role}}",
                    ),
                ],
            ),
            (
                "Decisions per minute",
                "short",
                [
                    (
                        f"sum by (role, direction) (rate(kvflow_autoscaler_decisions_total{AS}{RATE})) * 60",
                        "{{role}} {{direction}}",
                    ),
                ],
            ),
            (
                "Signals vs targets",
                "short",
                [
                    (
                        f"max by (role, signal) (kvflow_autoscaler_signal{AS})",
                        "{{role}} {{signal}}",
                    ),
                    (
                        f"max by (role, signal) (kvflow_autoscaler_target{AS})",
                        "target {{role}} {{signal}}",
                    ),
                ],
            ),
            (
                "Pods with fresh metrics",
                "short",
                [
                    (f"max by (role) (kvflow_autoscaler_reporting_pods{AS})", "{{role}}"),
                ],
            ),
        ],
    ),
}

VARIABLE_QUERIES = {
    "namespace": "label_values(namespace)",
    "model": 'label_values(sglang:num_requests_total{namespace=~"$namespace"}, model_name)',
    "deployment": (
        'label_values(kvflow_autoscaler_desired_replicas{namespace=~"$namespace"}, deployment)'
    ),
}


def variable(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "type": "query",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": VARIABLE_QUERIES[name],
        "refresh": 2,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"text": "All", "value": "$__all"},
    }


def dashboard(uid: str) -> dict[str, Any]:
    title, variables, panels = DASHBOARDS[uid]
    built = []
    for i, (panel_title, unit, queries) in enumerate(panels):
        built.append(
            {
                "id": i + 1,
                "type": "timeseries",
                "title": panel_title,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"x": (i % 2) * 12, "y": (i // 2) * 8, "w": 12, "h": 8},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [
                    {
                        "refId": chr(ord("A") + j),
                        "datasource": {"type": "prometheus", "uid": "${datasource}"},
                        "expr": expr,
                        "legendFormat": legend,
                    }
                    for j, (expr, legend) in enumerate(queries)
                ],
            }
        )
    datasource = {
        "name": "datasource",
        "type": "datasource",
        "query": "prometheus",
        "current": {"text": "Prometheus", "value": "prometheus"},
    }
    return {
        "uid": uid,
        "title": title,
        "tags": ["kvflow"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [datasource, *(variable(v) for v in variables)]},
        "panels": built,
    }


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for uid in DASHBOARDS:
        text = json.dumps(dashboard(uid), indent=2) + "\n"
        (OUT / f"{uid}.json").write_text(text)


if __name__ == "__main__":
    main()
