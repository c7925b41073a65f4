"""A real prefill/decode pair (``kvflow serve --role prefill|decode``), a unified server
to compare with, and ``kvflow router`` in PD mode in front of the pair; SGLang's own router
in front of the same pair on request (``sglang_router``)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
sys.path.insert(0, str(Path(__file__).parents[1] / "router"))
sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

from pd_flags import COMMON, PD_BOOTSTRAP_TIMEOUT, PD_INTERNAL_KEY, trusting
from router_process import RouterProcess
from server_process import ServerProcess, free_port
from sglang_router_process import SglangRouterProcess, start_sglang_router
from shared_resource import Shared, stop_unwanted


class PDStack(NamedTuple):
    prefill: ServerProcess
    bootstrap_port: int
    decode: ServerProcess
    unified: ServerProcess
    router: RouterProcess


@pytest.fixture(scope="module", autouse=True)
def internal_key() -> Iterator[str]:
    """The internal key in the environment every server and router of a tests/pd module
    inherits (module-scoped: the other directories' servers and routers start without),
    and a bootstrap timeout of 20 s instead of SGLang's 300 (an unclaimed room's KV is
    freed within a test's wait, yet a decode slowed by a loaded machine may claim late)."""
    from kvflow.contract import BOOTSTRAP_TIMEOUT_ENV, INTERNAL_KEY_ENV

    settings = {INTERNAL_KEY_ENV: PD_INTERNAL_KEY, BOOTSTRAP_TIMEOUT_ENV: PD_BOOTSTRAP_TIMEOUT}
    before = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    yield PD_INTERNAL_KEY
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _start_pd(model_path: Path, logs: Path) -> tuple[PDStack, Callable[[], object]]:
    """The stack and the function that stops it (the servers start at once: each load
    takes tens of seconds)."""
    bootstrap_port = free_port()
    specs = {
        "prefill": ("--role", "prefill", "--bootstrap-port", str(bootstrap_port), *COMMON),
        "decode": ("--role", "decode", *trusting(bootstrap_port), *COMMON),
        "unified": COMMON,
    }
    with ThreadPoolExecutor(3) as pool:
        futures = {
            name: pool.submit(ServerProcess, *flags, log=logs / f"{name}.log")
            for name, flags in specs.items()
        }
    started = {name: f.result() for name, f in futures.items() if f.exception() is None}
    router = None

    def stop() -> None:
        if router is not None:
            router.stop()
        for proc in started.values():
            proc.stop()

    try:
        failed = [f.exception() for f in futures.values() if f.exception() is not None]
        if failed:
            raise failed[0]  # type: ignore[misc]
        router = RouterProcess(
            "--prefill-urls",
            f"{started['prefill'].url}#{bootstrap_port}",
            "--decode-urls",
            started["decode"].url,
            log=logs / "router.log",
        )
    except BaseException:
        stop()
        raise
    stack = PDStack(
        started["prefill"], bootstrap_port, started["decode"], started["unified"], router
    )
    return stack, stop


@pytest.fixture(scope="session")
def shared_pd(model_path, tmp_path_factory) -> Iterator[Shared[PDStack]]:
    # Stopped as soon as the next test does not use it (the modules that do are consecutive).
    shared: Shared[PDStack] = Shared(
        lambda: _start_pd(model_path, tmp_path_factory.mktemp("pd")),
        lambda item: "pd" in getattr(item, "fixturenames", ()),
    )
    with shared:
        yield shared


@pytest.fixture(scope="module")
def pd(shared_pd: Shared[PDStack]) -> PDStack:
    """A prefill/decode pair with its router and a unified server to compare with; one
    stack for consecutive modules (each start loads three servers)."""
    return shared_pd.get()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the last consecutive test of the shared PD stack (and after its module's
    fixtures, such as ``sglang_router``, are torn down), stop the stack."""
    stop_unwanted(nextitem)


@pytest.fixture(scope="module")
def sglang_router(pd, tmp_path_factory) -> Iterator[SglangRouterProcess]:
    """sglang-router in PD mode in front of ``pd``'s pair."""
    log = tmp_path_factory.mktemp("sglang-router") / "router.log"
    router = start_sglang_router(pd.prefill.url, pd.bootstrap_port, pd.decode.url, log)
    yield router
    router.stop()
