"""Real ``kvflow serve`` processes on the embedded model."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from server_process import ServerProcess
from shared_resource import Shared, stop_unwanted

HERE = Path(__file__).parent


@pytest.fixture(scope="session")
def embedded_ready(model_path) -> Path:
    """Convert the embedded model before any server races to do it."""
    return model_path


@pytest.fixture(scope="session")
def shared_server(embedded_ready, tmp_path_factory) -> Iterator[Shared[ServerProcess]]:
    def start() -> tuple[ServerProcess, Callable[[], object]]:
        proc = ServerProcess(
            "--max-total-tokens",
            "6000",
            "--context-length",
            "2048",
            log=tmp_path_factory.mktemp("server") / "server.log",
        )
        return proc, proc.stop

    # Kept while the tests of this directory run (the modules that use it are not
    # consecutive: others between them start servers of their own).
    shared: Shared[ServerProcess] = Shared(start, lambda item: HERE in Path(item.path).parents)
    with shared:
        yield shared


@pytest.fixture(scope="module")
def server(shared_server: Shared[ServerProcess]) -> ServerProcess:
    """One default server for the modules of this directory that use it (each start
    loads the model)."""
    return shared_server.get()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    stop_unwanted(nextitem)
