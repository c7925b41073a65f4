"""Copies of KV pages between the device pool and the host pool (HiCache L1 <-> L2).

On CPU a copy is two indexed assignments per layer and is done when the call returns.
On CUDA copies run on a side stream, so they overlap with the compute stream, and move
straight between the pinned host pool and a device block (one DMA per run of consecutive
host pages, which the host allocator hands out: no pinned staging buffer per copy):

- ``to_device`` (load-back of a host hit): the host pages' runs are copied into a device
  block and scattered into the device pool on the side stream, and the compute stream
  waits on an event, so the request's prefill (queued later) reads them. Until the copy
  lands the DMA still reads those host pages: :meth:`TierCopy.wait_loads` before the host
  writes host pages from another thread (the storage tier's prefetch).
- ``to_host`` (backup): the side stream waits for the compute stream (the KV must be
  written), gathers the device pages into a device block, and the compute stream waits
  only for that gather (the pages may be reused right after); the block's runs then go to
  the host pool while compute goes on, readable once :meth:`TierCopy.poll` (or
  :meth:`Copy.wait`) sees the copy finished.

Both sides must wait for the compute stream before writing: a step built ahead and undone
may free a page while its forward is still queued (see the scheduler's NOTE).

Pages move as they are stored: an FP8 KV cache's bytes (through ``uint8`` views, as not
every device's indexing kernels take float8 types), its scales staying with the model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvflow.runtime.mem import KVPool
from kvflow.runtime.mem.host_pool import HostKVPool

__all__ = ["Copy", "TierCopy", "page_runs"]


def _as_copied(buffer: torch.Tensor) -> torch.Tensor:
    """``buffer`` itself, or a ``uint8`` view of a one-byte (FP8) one."""
    return buffer.view(torch.uint8) if buffer.element_size() == 1 else buffer


class Copy:
    """One copy in flight; ``done()`` polls, ``wait()`` blocks, each finishes it once."""

    def __init__(
        self, event: torch.cuda.Event | None = None, finish: Callable[[], None] | None = None
    ) -> None:
        self._event = event
        self._finish = finish
        self.finished = event is None
        if self.finished and finish is not None:
            finish()

    def done(self) -> bool:
        if not self.finished and self._event is not None and self._event.query():
            self._complete()
        return self.finished

    def wait(self) -> None:
        if not self.finished:
            assert self._event is not None
            self._event.synchronize()
            self._complete()

    def _complete(self) -> None:
        self.finished = True
        if self._finish is not None:
            self._finish()
        self._event = self._finish = None


class TierCopy:
    """Moves whole pages between ``device`` (the model's KV pool) and ``host``."""

    def __init__(self, device: KVPool, host: HostKVPool) -> None:
        self.device = device
        self.host = host
        self._host_data = _as_copied(host.data)
        self.page_size = host.page_size
        self.on_cuda = device.k_buffer[0].is_cuda
        self._stream = torch.cuda.Stream() if self.on_cuda else None
        self._in_flight: list[Copy] = []
        self._loads: list[Copy] = []  # to_device copies whose DMA may still read host pages
        self.bytes_to_host = 0
        self.bytes_to_device = 0

    def _pages(self, slots: torch.Tensor) -> torch.Tensor:
        return slots.view(-1, self.page_size)[:, 0] // self.page_size

    def _layer_pages(self, layer: int, kv: int) -> torch.Tensor:
        buf = _as_copied((self.device.k_buffer if kv == 0 else self.device.v_buffer)[layer])
        return buf.view(-1, self.page_size, buf.shape[1], buf.shape[2])

    def to_host(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> Copy:
        """Copy the KV at ``device_slots`` into ``host_slots`` (both whole pages)."""
        host_pages = self._pages(host_slots.cpu())
        self.bytes_to_host += len(host_pages) * self.host.page_bytes
        if not self.on_cuda:
            dev_pages = self._pages(device_slots)
            for layer in range(self.host.num_layers):
                for kv in (0, 1):
                    self._host_data[host_pages, layer, kv] = self._layer_pages(layer, kv)[dev_pages]
            return Copy()
        return self._to_host_cuda(device_slots, host_pages)

    def to_device(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> Copy:
        """Copy the KV at ``host_slots`` into ``device_slots`` (both whole pages)."""
        host_pages = self._pages(host_slots.cpu())
        self.bytes_to_device += len(host_pages) * self.host.page_bytes
        if not self.on_cuda:
            dev_pages = self._pages(device_slots)
            block = self._host_data[host_pages]
            for layer in range(self.host.num_layers):
                for kv in (0, 1):
                    self._layer_pages(layer, kv)[dev_pages] = block[:, layer, kv]
            return Copy()
        return self._to_device_cuda(host_pages, device_slots)

    def poll(self) -> None:
        """Finish the copies the GPU has completed (their host pages become readable)."""
        self._in_flight = [c for c in self._in_flight if not c.done()]
        self._loads = [c for c in self._loads if not c.finished]

    def wait_loads(self) -> None:
        """Block until every ``to_device`` copy has read its host pages (they may be freed
        and handed to a writer on another thread meanwhile)."""
        for copy in self._loads:
            copy.wait()
        self._loads = []

    def wait_all(self) -> None:
        for copy in self._in_flight:
            copy.wait()
        self._in_flight = []
        self._loads = []

    # -- CUDA ------------------------------------------------------------------------------
    def _to_host_cuda(self, device_slots: torch.Tensor, host_pages: torch.Tensor) -> Copy:
        assert self._stream is not None
        compute = torch.cuda.current_stream()
        dev_pages = self._pages(device_slots.to(self.device.k_buffer[0].device))
        self._stream.wait_stream(compute)
        gathered, landed = torch.cuda.Event(), torch.cuda.Event()
        with torch.cuda.stream(self._stream):
            block = torch.stack(
                [
                    torch.stack([self._layer_pages(layer, kv)[dev_pages] for kv in (0, 1)], dim=1)
                    for layer in range(self.host.num_layers)
                ],
                dim=1,
            )
            gathered.record()
            for at, first, count in page_runs(host_pages.tolist()):
                self._host_data[first : first + count].copy_(
                    block[at : at + count], non_blocking=True
                )
            landed.record()
        compute.wait_event(gathered)  # the pages may be reused once gathered
        # NOTE: block was allocated on the side stream and is used only there: the caching
        # allocator hands its memory out again only to work queued after these copies
        copy = Copy(landed)
        self._in_flight.append(copy)
        return copy

    def _to_device_cuda(self, host_pages: torch.Tensor, device_slots: torch.Tensor) -> Copy:
        assert self._stream is not None
        compute = torch.cuda.current_stream()
        device = self.device.k_buffer[0].device
        dev_pages = self._pages(device_slots.to(device))
        self._stream.wait_stream(compute)
        landed = torch.cuda.Event()
        with torch.cuda.stream(self._stream):
            block = torch.empty(
                (len(host_pages), *self._host_data.shape[1:]),
                dtype=self._host_data.dtype,
                device=device,
            )
            for at, first, count in page_runs(host_pages.tolist()):
                block[at : at + count].copy_(
                    self._host_data[first : first + count], non_blocking=True
                )
            for layer in range(self.host.num_layers):
                for kv in (0, 1):
                    self._layer_pages(layer, kv)[dev_pages] = block[:, layer, kv]
            landed.record()
        compute.wait_event(landed)  # the prefill that reads them is queued after this
        copy = Copy(landed)
        self._in_flight.append(copy)
        self._loads.append(copy)
        return copy


def page_runs(pages: list[int]) -> list[tuple[int, int, int]]:
    """``(position in pages, first page, count)`` of each run of consecutive pages."""
    runs: list[tuple[int, int, int]] = []
    for at, page in enumerate(pages):
        if runs and runs[-1][1] + runs[-1][2] == page:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((at, page, 1))
    return runs
