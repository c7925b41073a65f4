"""Router benchmark: overhead in front of a fast load target, and cache-aware routing's value
over real ``kvflow serve`` workers, for ``kvflow router`` and ``sglang-router`` (see
``bench_router.py``).
"""

from .cache_value import CacheConfig, run_cache_value
from .overhead import OverheadConfig, run_overhead
from .report import render_markdown
from .routers import SGLANG_ROUTER_VERSION, default_sglang_venv, ensure_sglang_router

__all__ = [
    "SGLANG_ROUTER_VERSION",
    "CacheConfig",
    "OverheadConfig",
    "default_sglang_venv",
    "ensure_sglang_router",
    "render_markdown",
    "run_cache_value",
    "run_overhead",
]
