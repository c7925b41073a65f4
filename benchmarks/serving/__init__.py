"""Serving benchmark: a streaming load generator for OpenAI-compatible servers and a driver
that runs kvflow and ``transformers serve`` on the same prompts (see ``bench_serving.py``).
"""

from .client import Endpoint, RequestResult, RunRecord, run_load
from .cpu import CpuSample, cpu_sample, session_cpu_seconds
from .driver import run_servers
from .machine import load_average, machine_info
from .plan import BenchConfig, PlannedRun, build_plan
from .report import render_markdown
from .servers import (
    SERVERS,
    LaunchOptions,
    RunningServer,
    ServerSpec,
    running_server,
    select_servers,
)
from .stats import Summary, percentile, summarize
from .workloads import Corpus, Prompt, fixed_length_prompts, shared_prefix_prompts

__all__ = [
    "SERVERS",
    "BenchConfig",
    "Corpus",
    "CpuSample",
    "Endpoint",
    "LaunchOptions",
    "PlannedRun",
    "Prompt",
    "RequestResult",
    "RunRecord",
    "RunningServer",
    "ServerSpec",
    "Summary",
    "build_plan",
    "cpu_sample",
    "fixed_length_prompts",
    "load_average",
    "machine_info",
    "percentile",
    "render_markdown",
    "run_load",
    "run_servers",
    "running_server",
    "select_servers",
    "session_cpu_seconds",
    "shared_prefix_prompts",
    "summarize",
]
