"""What a benchmark sends: both workloads' shapes, and every run's prompts built up front.

The plan (every prompt of every run) is built once, before any server starts, so every
server answers the same prompts in the same order; runs never share prompts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .workloads import Corpus, Prompt, fixed_length_prompts, shared_prefix_prompts

__all__ = ["BenchConfig", "PlannedRun", "build_plan"]


@dataclass(frozen=True)
class BenchConfig:
    """Both workloads' shapes and how many requests each run sends, by concurrency."""

    concurrencies: tuple[int, ...] = (1, 32)
    input_len: int = 170
    output_len: int = 64
    fixed_requests: dict[int, int] = field(default_factory=lambda: {1: 8, 32: 32})
    shared_groups: dict[int, int] = field(default_factory=lambda: {1: 2, 32: 8})
    prefix_len: int = 1000
    question_len: int = 24
    shared_output_len: int = 64
    shared_requests: dict[int, int] = field(default_factory=lambda: {1: 8, 32: 32})
    api: str = "completions"
    run_timeout: float = 600.0
    warmup_requests: int = 2

    def requests(self, workload: str, concurrency: int) -> int:
        table = self.fixed_requests if workload == "fixed" else self.shared_requests
        return table.get(concurrency, 2 * concurrency)

    def groups(self, concurrency: int) -> int:
        """Prefix groups of a shared-prefix run (default 8)."""
        return self.shared_groups.get(concurrency, 8)


@dataclass(frozen=True)
class PlannedRun:
    """One (workload, concurrency) run: the exact prompts and output length."""

    workload: str  # fixed | shared | warmup
    concurrency: int
    max_tokens: int
    prompts: tuple[Prompt, ...]


def build_plan(corpus: Corpus, config: BenchConfig, workloads: set[str]) -> list[PlannedRun]:
    """Warm-up first, then the fixed-length runs, then the shared-prefix runs."""
    warmup = fixed_length_prompts(corpus, config.warmup_requests, config.input_len)
    plan = [PlannedRun("warmup", 1, 8, tuple(warmup))]
    for concurrency in config.concurrencies if "fixed" in workloads else ():
        count = config.requests("fixed", concurrency)
        prompts = fixed_length_prompts(corpus, count, config.input_len)
        plan.append(PlannedRun("fixed", concurrency, config.output_len, tuple(prompts)))
    for concurrency in config.concurrencies if "shared" in workloads else ():
        count = config.requests("shared", concurrency)
        prompts = shared_prefix_prompts(
            corpus, count, config.groups(concurrency), config.prefix_len, config.question_len
        )
        plan.append(PlannedRun("shared", concurrency, config.shared_output_len, tuple(prompts)))
    return plan
