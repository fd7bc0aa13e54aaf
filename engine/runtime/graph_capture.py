"""What the captured-graph paths share (decode_graphs.py, chunk_graphs.py): capturing one step,
host tensors that asynchronous copies into their static buffers may read, and the bookkeeping of
one graph per bucket (StepGraphs)."""
from __future__ import annotations

import time

import torch


def capture_step(step, device: torch.device, pool=None):
    """Runs step() twice on a side stream (the first calls compile kernels and settle the
    allocator), then captures a third call into a CUDA graph drawing on the memory pool `pool`
    (a new one when None). Returns (graph, the captured call's output, the pool)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    if pool is None:
        pool = torch.cuda.graph_pool_handle()
    with torch.cuda.graph(graph, pool=pool):
        output = step()
    torch.cuda.synchronize(device)
    return graph, output, pool


def host_tensor(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """values (a list or a host tensor) as a host tensor an asynchronous copy to `device` may
    read after this returns: pinned for a GPU (torch's pinned-memory cache keeps the block until
    the copy has run), plain for the CPU, where copies are immediate."""
    t = values.to(dtype).contiguous() if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    return t.pin_memory() if device.type == "cuda" else t


class StepGraphs:
    """One captured graph per bucket size over static buffers a subclass fills; the subclass
    defines _step(size), the step of a bucket read from those buffers. capture (default: on a
    GPU) False runs the same buffers eagerly, as tests on the CPU do."""

    def __init__(self, device: torch.device, capture: bool | None):
        self.device = device
        self.capture = device.type == "cuda" if capture is None else capture
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.capture_seconds = 0.0
        self.replays = 0

    def _step(self, size: int) -> torch.Tensor:
        raise NotImplementedError

    def _host(self, values, dtype: torch.dtype) -> torch.Tensor:
        return host_tensor(values, dtype, self.device)

    def _capture(self, size: int) -> None:
        t0 = time.perf_counter()
        self.graphs[size], self.outputs[size], self.pool = capture_step(lambda: self._step(size), self.device,
                                                                        self.pool)
        self.capture_seconds += time.perf_counter() - t0

    def _run_loaded(self, size: int, rows: int) -> torch.Tensor:
        """The first `rows` rows of the step now in the buffers of bucket `size`: from its graph
        (captured first if new; a view the next run overwrites), or eagerly without capture."""
        with torch.inference_mode():
            if not self.capture:
                return self._step(size)[:rows]
            if size not in self.graphs:
                self._capture(size)
        self.graphs[size].replay()
        self.replays += 1
        return self.outputs[size][:rows]
