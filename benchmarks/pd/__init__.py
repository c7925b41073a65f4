"""PD benchmark: 1 prefill + 1 decode behind ``kvflow router`` vs one unified server behind
``kvflow router --worker-urls`` on the same prompts (``compare``), and the long-prefill
interference experiment for the GPU machine (``interference``). See ``bench_pd.py``."""

from .compare import CompareConfig, run_compare
from .interference import InterferenceConfig, run_interference
from .report import render_markdown

__all__ = [
    "CompareConfig",
    "InterferenceConfig",
    "render_markdown",
    "run_compare",
    "run_interference",
]
