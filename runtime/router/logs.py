"""The router's logging: one line per request at ``info``, written cheaply.

Two costs of Python's logging matter at thousands of requests a second:

- each record looks up its caller's frame, thread, process and asyncio task; the router's
  format shows none of them, so they are switched off (the logging HOWTO's own advice);
- a stream handler flushes after every record: one ``write`` system call per request.
  Here ``info`` and ``debug`` lines stay in a 64 KiB buffer until :func:`flush_every`
  (a task the router runs) flushes it, every :data:`FLUSH_INTERVAL_S`; a warning or an
  error flushes at once, with everything before it. At exit logging flushes the rest.

The per-request line goes through :func:`request_line`: once :func:`configure` ran, it is
written straight into that buffer in the records' format, with no ``LogRecord`` (the
timestamp's text is made once a second), which costs a few microseconds instead of tens.
"""

from __future__ import annotations

import asyncio
import io
import logging
import sys
import time

__all__ = ["FLUSH_INTERVAL_S", "configure", "flush_every", "request_line"]

FLUSH_INTERVAL_S = 0.2
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_BUFFER_BYTES = 64 * 1024


class _BatchingHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A stream handler that leaves flushing below ``warning`` to :func:`flush_every`."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.stream.write(self.format(record) + self.terminator)
            if record.levelno >= logging.WARNING:
                self.flush()
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)


def _buffered_stderr() -> io.TextIOBase:
    """stderr's file descriptor behind our own buffer (PYTHONUNBUFFERED leaves sys.stderr
    with none), or sys.stderr itself when it has no descriptor (a test's capture)."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return sys.stderr  # type: ignore[return-value]
    return open(  # lives as long as the process
        fd,
        "w",
        buffering=_BUFFER_BYTES,
        encoding=getattr(sys.stderr, "encoding", None) or "utf-8",
        errors="backslashreplace",
        closefd=False,
    )


class _RequestLines:
    """Writes ``<asctime> INFO <logger>: <message>`` lines into the configured stream."""

    def __init__(self, logger: logging.Logger, stream: io.TextIOBase | None) -> None:
        self.logger = logger
        self.stream = stream
        self._second = -1
        self._stamp = ""

    def write(self, message: str) -> None:
        if not self.logger.isEnabledFor(logging.INFO):
            return
        if self.stream is None:  # logging configured elsewhere (tests, a library user)
            self.logger.info("%s", message)
            return
        now = time.time()
        second = int(now)
        if second != self._second:
            self._second = second
            self._stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(second))
        millis = int((now - second) * 1000)
        self.stream.write(f"{self._stamp},{millis:03d} INFO {self.logger.name}: {message}\n")


_requests = _RequestLines(logging.getLogger("kvflow.router"), None)


def request_line(message: str) -> None:
    """Log one request's line at ``info`` on the ``kvflow.router`` logger."""
    _requests.write(message)


def configure(level: str) -> None:
    """Root logging for the ``kvflow router`` process (process-wide, once, at start)."""
    logging._srcfile = None  # type: ignore[attr-defined]
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    logging.logAsyncioTasks = False  # type: ignore[attr-defined]  # Python >= 3.12
    handler = _BatchingHandler(_buffered_stderr())
    handler.setFormatter(logging.Formatter(FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler])
    _requests.stream = handler.stream


async def flush_every(interval_s: float = FLUSH_INTERVAL_S) -> None:
    """Flush every root handler each ``interval_s`` until cancelled."""
    while True:
        await asyncio.sleep(interval_s)
        for handler in logging.getLogger().handlers:
            handler.flush()
