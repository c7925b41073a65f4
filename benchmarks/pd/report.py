"""Markdown from the results JSON: both modes (``compare`` and ``interference``)."""

from __future__ import annotations

import math
import statistics
from typing import Any

__all__ = ["render_markdown"]


def _f(value: float, digits: int = 2) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def _median(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def _ratios(pd: list[dict], unified: list[dict], key: str) -> str:
    """PD / unified per round (same round, same prompts): their median, then each round's."""
    by_round = {r["round"]: r["summary"][key] for r in unified}
    per_round = [r["summary"][key] / by_round[r["round"]] for r in pd if by_round.get(r["round"])]
    inner = ", ".join(_f(x) for x in per_round)
    return f"{_f(_median(per_round))} ({inner})"


def _compare_tables(results: dict[str, Any]) -> list[str]:
    runs = results["runs"]
    cells = sorted({(r["concurrency"], r["input_len"]) for r in runs})
    pick = {
        (name, c, n): [r for r in runs if (r["config"], r["concurrency"], r["input_len"]) == (name, c, n)]
        for name in ("pd", "unified") for c, n in cells
    }  # fmt: skip
    lines = [
        "## PD vs unified (medians over rounds; ratio = PD / unified of the same round)",
        "",
        "| clients | prompt tokens | TTFT p50 s unified / PD | ratio | TTFT p99 s unified / PD | ratio | out tok/s unified / PD | ratio |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c, n in cells:
        pd, uni = pick[("pd", c, n)], pick[("unified", c, n)]

        def med(rows: list[dict], key: str) -> float:
            return _median([r["summary"][key] for r in rows])

        lines.append(
            f"| {c} | {n} | {_f(med(uni, 'ttft_median_s'))} / {_f(med(pd, 'ttft_median_s'))} "
            f"| {_ratios(pd, uni, 'ttft_median_s')} "
            f"| {_f(med(uni, 'ttft_p99_s'))} / {_f(med(pd, 'ttft_p99_s'))} "
            f"| {_ratios(pd, uni, 'ttft_p99_s')} "
            f"| {_f(med(uni, 'output_tok_s'), 1)} / {_f(med(pd, 'output_tok_s'), 1)} "
            f"| {_ratios(pd, uni, 'output_tok_s')} |"
        )
    lines += [
        "",
        "## The KV transfer inside PD's TTFT (prefill's `/metrics`, per run; medians over rounds)",
        "",
        "| clients | prompt tokens | writes | ms per 1,000 prompt tokens | mean write ms | share of mean TTFT | GB/s | bytes per prompt token | failed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c, n in cells:
        xfers = [r["transfer"] for r in pick[("pd", c, n)]]

        def tmed(key: str, xfers: list[dict] = xfers) -> float:
            return _median([t[key] for t in xfers])

        lines.append(
            f"| {c} | {n} | {sum(t['writes'] for t in xfers)} | {_f(tmed('ms_per_1k_prompt_tokens'), 1)} "
            f"| {_f(tmed('mean_ms'), 1)} | {_f(tmed('share_of_mean_ttft') * 100, 1)} % "
            f"| {_f(tmed('gb_s'))} | {_f(tmed('bytes_per_prompt_token'), 0)} | {sum(t['failed'] for t in xfers)} |"
        )
    total_bytes = sum(r["transfer"]["bytes"] for r in runs if r["config"] == "pd")
    total_s = sum(r["transfer"]["seconds"] for r in runs if r["config"] == "pd")
    lines += [
        "",
        f"All PD runs together: {total_bytes / 1e9:.3f} GB in {total_s:.2f} s of writes = "
        f"**{_f(total_bytes / total_s / 1e9 if total_s else math.nan)} GB/s** sustained per write.",
        "",
        "## Every run",
        "",
        "| round | config | clients | prompt tokens | ok | TTFT p50 s | TTFT p99 s | ITL p50 ms | out tok/s | load before (1/5/15 min) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in runs:
        s = r["summary"]
        lines.append(
            f"| {r['round']} | {r['config']} | {r['concurrency']} | {r['input_len']} "
            f"| {s['succeeded']}/{s['requests']} | {_f(s['ttft_median_s'])} | {_f(s['ttft_p99_s'])} "
            f"| {_f(s['itl_median_ms'], 1)} | {_f(s['output_tok_s'], 1)} | {r['load_before']} |"
        )
    return lines


def _interference_tables(results: dict[str, Any]) -> list[str]:
    lines = [
        "## Stream ITL, quiet vs long prompts arriving",
        "",
        "| round | target | phase | ITL p50 ms | ITL p99 ms | ITL max ms | stream tok/s | long prompts | long TTFT p50 s | errors | load |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results["runs"]:
        lines.append(
            f"| {r['round']} | {r['target']} | {r['phase']} | {_f(r['itl_p50_ms'], 1)} "
            f"| {_f(r['itl_p99_ms'], 1)} | {_f(r['itl_max_ms'], 1)} | {_f(r['stream_tok_s'], 1)} "
            f"| {r['long_prompts']} | {_f(r['long_ttft_p50_s'])} | {r['errors']} | {r['load']} |"
        )
    return lines


def render_markdown(results: dict[str, Any], notes: str = "") -> str:
    machine = results.get("machine", {})
    title = (
        "PD disaggregation: long-prefill interference"
        if results.get("mode") == "interference"
        else "PD disaggregation vs unified serving"
    )
    lines = [
        f"# {title}",
        "",
        f"Command: `{results.get('command', '')}`",
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()),
        "",
    ]  # fmt: skip
    loads = {}
    for r in results.get("runs", []):
        loads.setdefault(r["round"], []).append(
            float(r.get("load_before", r.get("load", "nan")).split(",")[0])
        )
    if loads:
        per_round = "; ".join(
            f"round {k}: {min(v):.1f}-{max(v):.1f}" for k, v in sorted(loads.items())
        )
        lines += [
            f"Load average (1 min) before each run, per round: {per_round} (nproc {results.get('nproc', machine.get('nproc'))}).",
            "",
        ]
    if notes:
        lines += [notes.strip(), ""]
    if results.get("mode") == "interference":
        lines += _interference_tables(results)
    else:
        lines += _compare_tables(results)
    cfg = results.get("config", {})
    lines += ["", "Configuration: " + ", ".join(f"`{k}={v}`" for k, v in cfg.items()), ""]
    return "\n".join(lines)
