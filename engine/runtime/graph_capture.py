"""What the captured-graph paths share (decode_graphs.py, chunk_graphs.py): capturing one step,
and host tensors that asynchronous copies into their static buffers may read."""
from __future__ import annotations

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
