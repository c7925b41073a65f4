"""Where a bench_serving run's per-request latency goes: for each of SGLang's
``bench_serving`` JSON files given (``--output-details``, the last record of each), the
median TTFT and end-to-end latency, then the inter-token gaps of requests ``--from`` on,
split at ``--threshold-ms``: gaps past it are decode steps a prefill step interrupted
(their share of all gaps, their mean and median), the others plain decode steps (their
mean). Per request, ``output_len - 1`` gaps of the two kinds add up to its decode time,
so two runs' difference splits into what their prefill steps and their decode steps cost.

    python3 -P benchmarks/serving_gaps.py bench-base.jsonl bench-lora.jsonl [--json-out F]
        [--strip-to DIR]

``--strip-to``: each file again under DIR without its per-request lists (token gaps,
texts), small enough to commit beside the summary it came with.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def gap_stats(record: dict, first: int, threshold_ms: float) -> dict:
    """The numbers of the module docstring for one bench_serving record."""
    gaps = [g * 1e3 for itls in record["itls"][first:] for g in itls]
    long = [g for g in gaps if g > threshold_ms]
    short = [g for g in gaps if g <= threshold_ms]
    return {
        "completed": record.get("completed"),
        "median_ttft_ms": record.get("median_ttft_ms"),
        "median_e2e_latency_ms": record.get("median_e2e_latency_ms"),
        "median_itl_ms": record.get("median_itl_ms"),
        "gaps": len(gaps),
        "long_share": len(long) / len(gaps) if gaps else 0.0,
        "long_mean_ms": statistics.mean(long) if long else 0.0,
        "long_median_ms": statistics.median(long) if long else 0.0,
        "long_time_share": sum(long) / sum(gaps) if gaps else 0.0,
        "short_mean_ms": statistics.mean(short) if short else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--from", dest="first", type=int, default=150,
                        help="the first request counted (past a phase's start-up)")  # fmt: skip
    parser.add_argument("--threshold-ms", type=float, default=10.0)
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--strip-to", type=Path)
    args = parser.parse_args()
    rows = {}
    print("| file | median TTFT | median E2E | median ITL | long gaps | their mean | "
          "their share of time | other gaps' mean |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for path in args.files:
        record = json.loads(path.read_text().strip().splitlines()[-1])
        row = rows[str(path)] = gap_stats(record, args.first, args.threshold_ms)
        print(f"| {path.name} | {row['median_ttft_ms']:.1f} ms | "
              f"{row['median_e2e_latency_ms']:,.0f} ms | {row['median_itl_ms']:.2f} ms | "
              f"{row['long_share']:.1%} | {row['long_mean_ms']:.1f} ms | "
              f"{row['long_time_share']:.0%} | {row['short_mean_ms']:.2f} ms |")  # fmt: skip
        if args.strip_to:
            args.strip_to.mkdir(parents=True, exist_ok=True)
            n = len(record["itls"])
            small = {k: v for k, v in record.items() if not (isinstance(v, list) and len(v) == n)}
            (args.strip_to / path.name).write_text(json.dumps(small) + "\n")
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
