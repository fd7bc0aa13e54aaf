"""The process of one tensor-parallel rank other than 0.

It joins the process group, then serves rank 0's messages in order: load its slices, allocate
its KV cache (both layer groups, like rank 0's) and decode graphs, and run every step's forward
on the inputs rank 0 sends, or replay its own graph of a decode step, whose collectives meet
rank 0's. Rank 0 samples; here the logits are only computed for the collectives they take part
in. Any exception is sent to rank 0 as text and ends the process; so does rank 0's process
going away (its pipe closes, or, while this rank waits inside a collective, the watchdog sees
the parent exit).
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import threading
import traceback
from datetime import timedelta

import torch

STARTED, READY, LOADED, DONE, ERROR = "started", "ready", "loaded", "done", "error"
EXIT_PARENT_GONE = 3


def send(conn, *message) -> None:
    conn.send_bytes(pickle.dumps(message))


def receive(conn) -> tuple:
    return pickle.loads(conn.recv_bytes())


def _exit_with_parent() -> None:
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch():
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(EXIT_PARENT_GONE)

    threading.Thread(target=watch, name="localchat-parent-watch", daemon=True).start()


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def worker_main(rank: int, world_size: int, port: int, device: str, conn, timeout_s: float, threads: int) -> None:
    _exit_with_parent()
    try:
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        else:
            torch.set_num_threads(threads)
        import torch.distributed as dist

        send(conn, STARTED)
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group(backend_for(dev), store=store, rank=rank, world_size=world_size, timeout=timeout)
        send(conn, READY)
        _serve(conn, rank, world_size, dev)
    except BaseException:  # noqa: BLE001 - whatever it was, rank 0 must hear of it
        try:
            send(conn, ERROR, traceback.format_exc())
        finally:
            os._exit(1)
    _shutdown()


def _serve(conn, rank: int, world_size: int, device: torch.device) -> None:
    import torch.distributed as dist

    from ..runtime.chunk_graphs import ChunkGraphs
    from ..runtime.decode_graphs import DecodeGraphs
    from ..runtime.kv_cache import build_kv_cache
    from ..runtime.step_runner import StepRunner
    from .context import ParallelContext
    from .rank import load_rank

    model = runner = spec = dtype = None
    while True:
        try:
            message = receive(conn)
        except (EOFError, OSError):
            return  # rank 0 is gone
        kind = message[0]
        if kind == "step":
            inputs, image_rows = message[1], message[2]
            if image_rows:  # rank 0 alone places the image features; zeros here sum to them
                inputs.features = torch.zeros(image_rows, spec.hidden_size, dtype=dtype, device=device)
            runner.execute(inputs)
        elif kind == "load":
            path, spec, expert_parallel, dtype, quantize = message[1:]
            ctx = ParallelContext(rank, world_size, expert_parallel, dist.group.WORLD)
            model, report = load_rank(path, spec, ctx, device, dtype, quantize=quantize)
            send(conn, LOADED, report)
        elif kind == "decode":
            runner.graphs.run(*message[1])
        elif kind == "capture":
            runner.capture_graphs()
        elif kind == "cache":
            num_blocks, block_size, num_sliding_blocks, graph_shape, chunk_shape = message[1:]
            cache = build_kv_cache(spec, num_blocks, block_size, model.kv_heads, dtype, device, num_sliding_blocks)
            graphs = None if graph_shape is None else DecodeGraphs(model, cache, dtype, device, **graph_shape)
            chunks = None if chunk_shape is None else ChunkGraphs(model, cache, dtype, device, **chunk_shape)
            runner = StepRunner(model, cache, device, dtype, graphs, chunks)
            runner.fails_together = True
            send(conn, DONE)
        elif kind == "stop":
            return
        else:
            raise ValueError(f"unknown message {kind!r} from rank 0")


def _shutdown() -> None:
    import torch.distributed as dist

    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass
