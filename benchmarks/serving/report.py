"""Render a results document (the JSON the driver writes) as markdown.

The JSON holds ``command``, ``date``, ``machine``, ``config``, ``servers`` (description and
how each avoids early EOS), ``failures`` and ``rows`` (one per server, workload and
concurrency); the markdown is a pure function of it, so it can be re-rendered later.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["render_markdown"]

_COLUMNS = (
    ("server", "server", "{}"),
    ("round", "round", "{}"),
    ("concurrency", "clients", "{}"),
    ("succeeded", "ok", "{}"),
    ("mean_prompt_tokens", "prompt tok", "{:.0f}"),
    ("output_tokens", "out tok", "{}"),
    ("duration_s", "time s", "{:.1f}"),
    ("output_tok_s", "**out tok/s**", "**{:.2f}**"),
    ("request_s", "req/s", "{:.3f}"),
    ("ttft_median_s", "TTFT med s", "{:.3f}"),
    ("ttft_p99_s", "TTFT p99 s", "{:.3f}"),
    ("itl_median_ms", "ITL med ms", "{:.1f}"),
    ("itl_p99_ms", "ITL p99 ms", "{:.1f}"),
    ("tpot_median_ms", "TPOT med ms", "{:.1f}"),
    ("cached_tokens", "cached tok", "{}"),
    ("server_cpu_s", "server CPU s", "{:.1f}"),
    ("cpu_ms_per_token", "CPU ms / out tok", "{:.0f}"),
    ("others_cpu_pct", "other jobs' CPU %", "{:.0f}"),
    ("load_average", "load avg (1, 5, 15 min)", "{}"),
)

_WORKLOAD_TITLES = {
    "fixed": "Fixed lengths: kvflow vs transformers serve",
    "shared": "Shared prefix: kvflow radix cache on vs off",
}

# (workload, numerator server, denominator server, what the ratio means)
_RATIOS = (
    ("fixed", "kvflow", "transformers", "kvflow / transformers"),
    ("shared", "kvflow", "kvflow-no-radix", "radix on / radix off"),
)


def _cell(row: dict[str, Any], key: str, fmt: str) -> str:
    value = row.get(key)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if key == "succeeded":
        return f"{value}/{row['requests']}" + (" (timed out)" if row.get("timed_out") else "")
    if key == "output_tokens":
        return f"{value} ({row['min_output_tokens']}–{row['max_output_tokens']} per req)"
    return fmt.format(value)


def _table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| " + " | ".join(title for _, title, _ in _COLUMNS) + " |",
        "|" + "---|" * len(_COLUMNS),
    ]
    lines += [
        "| " + " | ".join(_cell(row, key, fmt) for key, _, fmt in _COLUMNS) + " |" for row in rows
    ]
    return lines


def _quotient(top: float | None, bottom: float | None) -> float:
    return top / bottom if top is not None and bottom else math.nan


def _best(rows: list[dict[str, Any]], workload: str) -> dict[tuple[str, int], dict[str, Any]]:
    """The highest-throughput round of each (server, concurrency) of ``workload``."""
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for row in rows:
        key = (row["server"], row["concurrency"])
        if row["workload"] == workload and (
            key not in best or row["output_tok_s"] > best[key]["output_tok_s"]
        ):
            best[key] = row
    return best


def _ratio_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for workload, top, bottom, meaning in _RATIOS:
        index = _best(rows, workload)
        for (server, concurrency), num in sorted(index.items(), key=lambda item: item[0][1]):
            den = index.get((bottom, concurrency))
            if server != top or den is None or not den["output_tok_s"]:
                continue
            throughput = num["output_tok_s"] / den["output_tok_s"]
            ttft = _quotient(den["ttft_median_s"], num["ttft_median_s"])
            cpu = _quotient(den.get("cpu_ms_per_token"), num.get("cpu_ms_per_token"))
            others = " / ".join(_cell(row, "others_cpu_pct", "{:.0f}") for row in (num, den))
            lines.append(
                f"| {meaning} | {concurrency} | **{throughput:.2f}x** | {ttft:.2f}x | {cpu:.2f}x "
                f"| {others} |"
            )
    if not lines:
        return ["No ratio: this run did not measure both sides of any comparison."]
    header = [
        "| comparison | clients | output tok/s ratio | median TTFT speed-up "
        "| CPU per token saving | other jobs' CPU % (each side) |",
        "|---|---|---|---|---|---|",
    ]
    note = (
        "A side whose run had other jobs taking more than ~10% of the CPU was disturbed: "
        "re-run (`--rounds 2` keeps the best round) before reading its ratio."
    )
    return [*header, *lines, "", note]


def _per_clients(requests: dict[Any, int]) -> str:
    """``{1: 8, 32: 32}`` (keys may be strings after JSON) -> ``8 at 1 client, 32 at 32``."""
    return ", ".join(f"{n} at {c} client{'s' if int(c) > 1 else ''}" for c, n in requests.items())


def _setup_lines(doc: dict[str, Any]) -> list[str]:
    config = doc["config"]
    workloads = {
        "fixed": f"- fixed workload: prompts of {config['input_len']} tokens of the Python "
        f"reference manual (distinct, no shared prefix), {config['output_len']} output tokens; "
        f"requests per run: {_per_clients(config['fixed_requests'])}",
        "shared": "- shared-prefix workload: groups of requests sharing a "
        f"{config['prefix_len']}-token prefix, + a distinct question quoting "
        f"{config['question_len']} tokens, {config['shared_output_len']} output tokens; "
        f"requests per run: {_per_clients(config['shared_requests'])}, in groups: "
        f"{_per_clients(config['shared_groups'])} (request i in group i mod groups; runs use "
        "different prefixes; kvflow's cache is flushed between runs)",
    }
    lines = [
        f"- model: `{config['model']}`; client: {config['api']} API, streaming, temperature 0, "
        "closed loop (each client sends its next request when its last one ends); the same "
        "prompts, in the same order, for every server; "
        f"{config['warmup_requests']} warm-up requests per server first (not counted)",
        *(workloads[name] for name in doc["workloads"]),
    ]
    lines += [
        f"- {name} (`{server['description']}`): exact output length via {server['eos_note']}"
        for name, server in doc["servers"].items()
    ]
    lines.append(
        "- out tok/s: output tokens (server's usage) / wall time of the run; TTFT: send to "
        "first text event; ITL: gaps between text events; TPOT: (latency - TTFT) / "
        "(output tokens - 1), median over requests; server CPU s: user + system CPU time of the "
        "server's whole process tree during the run (less sensitive than wall time to other "
        "jobs on a shared machine); other jobs' CPU %: share of all cores used during the run "
        "by processes other than the server and the client (a large share marks a run "
        "disturbed by other work on the machine)"
    )
    return lines


def _failure_lines(doc: dict[str, Any]) -> list[str]:
    lines = []
    for name, error in doc.get("failures", {}).items():
        lines += [f"**{name} failed:**", "", "```", error.strip(), "```", ""]
    errors = [
        f"- {r['server']} {r['workload']} c={r['concurrency']}: {r['first_error']}"
        for r in doc["rows"]
        if r.get("first_error")
    ]
    if errors:
        lines += ["## Request errors (first per run)", "", *errors, ""]
    return lines


def render_markdown(doc: dict[str, Any]) -> str:
    """The results page: command, machine, setup, one table per workload, ratios."""
    rows = doc["rows"]
    out = ["# Serving benchmark: kvflow vs `transformers serve`", ""]
    out += ["Generated by `benchmarks/bench_serving.py`; numbers are measured, never edited.", ""]
    out += ["```", doc["command"], "```", "", f"Run on {doc['date']}.", "", "## Machine", ""]
    out += [f"- {key}: {value}" for key, value in doc["machine"].items()]
    out += [
        f"- load average before / after: {doc['load_before']} / {doc['load_after']} "
        "(the machine is shared; every peer is measured in the same run)",
        "",
    ]
    out += ["## Setup", "", *_setup_lines(doc), ""]
    servers = list(doc["servers"])
    for workload, title in _WORKLOAD_TITLES.items():
        selected = [row for row in rows if row["workload"] == workload]
        selected.sort(key=lambda r: (servers.index(r["server"]), r["concurrency"], r["round"]))
        if selected:
            out += [f"## {title}", "", *_table(selected), ""]
    rounds = doc.get("rounds", 1)
    best = f", best of {rounds} rounds by throughput" if rounds > 1 else ""
    out += [f"## Ratios (same run, same machine{best})", "", *_ratio_lines(rows), ""]
    return "\n".join(out + _failure_lines(doc))
