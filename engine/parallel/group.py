"""A tensor-parallel group seen from rank 0: this process is rank 0 (it runs the engine's
scheduler and samples); ranks 1..N-1 are spawned processes (worker.py), one per GPU.

Rank 0 talks to each worker over a pipe: a few request/reply messages while starting (load,
allocate the KV cache), then one message a step with that step's inputs and no reply; the
ranks meet only inside the model's collectives. A monitor thread watches the workers: when one
exits, its error is recorded, NCCL communicators are aborted so that no rank waits forever in a
collective, and every later step raises WorkerFailed with that error.

The workers are started with the spawn method, so a script that builds a tensor-parallel Engine
at import time must do it under `if __name__ == "__main__":` (the `localchat` command does).
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing.connection
import os
import pickle
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch

from ..spec import ModelSpec
from .context import ParallelContext
from .rank import LoadReport, load_rank
from .slicing import shard_plan
from .worker import DONE, ERROR, LOADED, READY, STARTED, backend_for, receive, send, worker_main

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 600.0  # a first step may compile kernels on every rank; longer is a hang


class WorkerFailed(RuntimeError):
    """A rank of the tensor-parallel group failed; the group cannot run any more."""


def parallel_devices(device: torch.device, tp: int, gpus: list[int] | None) -> list[torch.device]:
    """One device per rank: the listed GPUs (the first tp of them), GPUs 0..tp-1, or tp CPUs."""
    if tp < 1:
        raise ValueError(f"the tensor-parallel size must be at least 1 (got {tp})")
    if device.type != "cuda":
        if gpus:
            raise ValueError("GPUs were listed but the device is the CPU; drop --gpus or use --device cuda")
        return [torch.device("cpu")] * tp
    gpus = list(gpus) if gpus else list(range(tp))
    if len(gpus) < tp:
        raise ValueError(f"tensor parallel over {tp} GPUs needs {tp} GPU indices, but only {len(gpus)} were listed "
                         f"({','.join(map(str, gpus))}); list more with --gpus or lower --tp")
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"--gpus lists a GPU twice ({','.join(map(str, gpus))})")
    visible = torch.cuda.device_count()
    missing = [g for g in gpus[:tp] if not 0 <= g < visible]
    if missing:
        raise ValueError(f"GPU {missing[0]} is not visible: this machine shows {visible} GPU(s) "
                         f"(0..{visible - 1}); check --gpus and CUDA_VISIBLE_DEVICES")
    return [torch.device("cuda", g) for g in gpus[:tp]]


class WorkerGroup:
    """Start with `start`, then `load`, then `step_runner`; `close` ends the workers."""

    def __init__(self, devices: list[torch.device], expert_parallel: bool = False,
                 timeout_s: float = COLLECTIVE_TIMEOUT_S):
        self.devices, self.expert_parallel, self.timeout_s = devices, expert_parallel, timeout_s
        self.world_size = len(devices)
        self.device = devices[0]
        self.procs, self.conns, self.locks = [], [], []
        self.reports: list[LoadReport] = []
        self.model = None
        self.failure: str | None = None
        self._failed = threading.Event()
        self._closing = False
        self._wake_r, self._wake_w = multiprocessing.Pipe(duplex=False)
        self._monitor: threading.Thread | None = None
        self.ctx: ParallelContext | None = None

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self) -> "WorkerGroup":
        """Spawns ranks 1..N-1 and joins them in a process group; this process becomes rank 0."""
        import torch.distributed as dist
        import torch.multiprocessing as mp

        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group (another tensor-parallel "
                               "engine is running here); shut that engine down first")
        timeout = timedelta(seconds=self.timeout_s)
        store = dist.TCPStore("127.0.0.1", 0, self.world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        spawn = mp.get_context("spawn")
        threads = max(1, (os.cpu_count() or 1) // self.world_size)
        for rank in range(1, self.world_size):
            ours, theirs = spawn.Pipe()
            proc = spawn.Process(target=worker_main, name=f"localchat-tp{rank}", daemon=True,
                                 args=(rank, self.world_size, store.port, str(self.devices[rank]), theirs,
                                       self.timeout_s, threads))
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.conns.append(ours)
            self.locks.append(threading.Lock())
        atexit.register(self.close)
        self._monitor = threading.Thread(target=self._watch, name="localchat-tp-monitor", daemon=True)
        self._monitor.start()
        try:
            self._replies(STARTED)
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            self._join(store, timeout)
            self._replies(READY)
        except BaseException:
            self.close()
            raise
        self.ctx = ParallelContext(0, self.world_size, self.expert_parallel, dist.group.WORLD)
        return self

    def _join(self, store, timeout) -> None:
        """init_process_group for rank 0, given up as soon as a worker dies instead of waiting out
        the timeout (it blocks until every rank has joined)."""
        import torch.distributed as dist

        errors: list[BaseException] = []

        def init():
            try:
                dist.init_process_group(backend_for(self.device), store=store, rank=0, world_size=self.world_size,
                                        timeout=timeout)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                errors.append(e)

        joiner = threading.Thread(target=init, name="localchat-tp-join", daemon=True)
        joiner.start()
        while joiner.is_alive():
            joiner.join(0.1)
            self.check()
        if errors:
            raise errors[0]

    def load(self, path: str | Path, spec: ModelSpec, dtype: torch.dtype, on_progress=None,
             expert_parallel: bool | None = None, quantize: str | None = None):
        """Every rank reads its slices of the checkpoint at `path` and builds its model (replacing
        any model loaded before); returns rank 0's model. on_progress(done, total, file) follows
        rank 0's reading. expert_parallel: change the split of the experts from the group's.
        quantize: as load_weights'."""
        if expert_parallel is not None:
            self.expert_parallel = expert_parallel
            self.ctx = dataclasses.replace(self.ctx, expert_parallel=expert_parallel)
        for rank in range(self.world_size):  # refuse an impossible split before any rank reads
            shard_plan(spec, self.world_size, rank, self.expert_parallel)
        try:
            self._broadcast("load", str(path), spec, self.expert_parallel, dtype, quantize)
            model, report = load_rank(path, spec, self.ctx, self.device, dtype, on_progress, quantize)
            self.reports = [report] + [r[1] for r in self._replies(LOADED)]
        except BaseException:
            self.close()
            raise
        self.model = model
        return model

    @property
    def weights_bytes(self) -> int:
        return sum(r.bytes_held for r in self.reports)

    @property
    def mem_info(self) -> tuple[int, int] | None:
        """(free, total) bytes of the GPU with the least free memory after loading; None on CPU."""
        if self.device.type != "cuda":
            return None
        low = min(self.reports, key=lambda r: r.free_bytes)
        return low.free_bytes, low.total_bytes

    @property
    def placement(self) -> str:
        kind = "tensor + expert parallel" if self.expert_parallel else "tensor parallel"
        return f"{', '.join(str(d) for d in self.devices)} ({kind}, {self.world_size} ranks)"

    def step_runner(self, model, cache, device: torch.device, dtype: torch.dtype, graphs=None, chunks=None):
        """Allocates every worker's KV cache like rank 0's `cache` (and decode and chunk graphs
        like `graphs` and `chunks`, a DecodeGraphs and a ChunkGraphs or None); returns rank 0's runner."""
        from .runner import ParallelStepRunner

        try:
            self._broadcast("cache", cache.num_blocks, cache.block_size, cache.num_sliding_blocks,
                            None if graphs is None else graphs.shape, None if chunks is None else chunks.shape)
            self._replies(DONE)
        except BaseException:
            self.close()
            raise
        return ParallelStepRunner(model, cache, device, dtype, self, graphs, chunks)

    def close(self, timeout: float = 10.0) -> None:
        """Stops the workers (killing those that do not stop) and leaves the process group."""
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.close)
        self._wake_w.send_bytes(b"")
        for conn in self.conns:
            try:
                send(conn, "stop")
            except (OSError, ValueError):
                pass
        for proc in self.procs:
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout)
        for conn in self.conns:
            conn.close()
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a peer already gone; leaving anyway
                log.debug("destroying the process group failed", exc_info=True)

    # ---- steps ------------------------------------------------------------------------------

    def send_step(self, inputs) -> None:
        """Hands a step's inputs to every worker. Image features stay here: the workers are told
        how many rows they have (see Glm4vMoeModel)."""
        features = inputs.features
        inputs.features = None
        try:
            payload = pickle.dumps(("step", inputs, 0 if features is None else features.shape[0]))
        finally:
            inputs.features = features
        self._send_all(payload)

    def send_decode(self, inputs) -> None:
        """Hands a decode step (DecodeInputs) to every worker: each replays its own graph."""
        self._send_all(pickle.dumps(("decode", inputs)))

    def send_capture(self) -> None:
        """Every worker captures all its decode and chunk graphs, in the order rank 0 does."""
        self._send_all(pickle.dumps(("capture",)))

    def _send_all(self, payload: bytes) -> None:
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send_bytes(payload)
            except (OSError, ValueError) as e:
                self.wait_for_failure()
                self.fail(self.failure or f"tensor-parallel rank {rank} cannot be reached ({e})")
                self.check()

    def check(self) -> None:
        """Raises WorkerFailed once any rank has failed."""
        if self.failure is not None:
            raise WorkerFailed(self.failure)

    def wait_for_failure(self, timeout: float = 2.0) -> bool:
        """After a collective raised: give the monitor a moment to name the worker that died."""
        return self._failed.wait(timeout)

    def fail(self, reason: str) -> None:
        """Marks the group broken: the ranks are out of step and cannot run another step."""
        if self.failure is None:
            self.failure = (f"{reason}. The model is split over {self.world_size} processes and cannot run "
                            "without all of them: restart localchat")
            log.error("%s", self.failure)
        self._failed.set()
        self._abort()
        for proc in self.procs:  # the survivors wait in a collective that will never complete
            if proc.is_alive():
                proc.kill()

    # ---- internals --------------------------------------------------------------------------

    def _broadcast(self, *message) -> None:
        for conn in self.conns:
            send(conn, *message)

    def _replies(self, expected: str) -> list[tuple]:
        """Waits for `expected` from every worker; raises WorkerFailed if one fails instead."""
        out = []
        for rank, (conn, lock) in enumerate(zip(self.conns, self.locks), start=1):
            while True:
                self.check()
                with lock:
                    message = receive(conn) if conn.poll(0.1) else None
                if message is None:
                    continue
                if message[0] == ERROR:
                    self._record(rank, message[1])
                    self.check()
                if message[0] != expected:
                    raise RuntimeError(f"rank {rank} answered {message[0]!r} where {expected!r} was expected")
                out.append(message)
                break
        return out

    def _record(self, rank: int, error: str | None, exitcode: int | None = None) -> None:
        what = str(self.devices[rank])
        if error:
            log.error("tensor-parallel rank %d (%s) failed:\n%s", rank, what, error)
            last = error.strip().splitlines()[-1]
            self.fail(f"tensor-parallel rank {rank} ({what}) failed: {last}")
        elif exitcode is not None and exitcode < 0:
            self.fail(f"tensor-parallel rank {rank} ({what}) was killed by signal {-exitcode}")
        else:
            self.fail(f"tensor-parallel rank {rank} ({what}) exited unexpectedly (exit code {exitcode})")

    def _watch(self) -> None:
        alive = {proc.sentinel: rank for rank, proc in enumerate(self.procs, start=1)}
        while alive and not self._closing:
            ready = multiprocessing.connection.wait([*alive, self._wake_r])
            if self._closing:
                return
            for sentinel in ready:
                if sentinel is self._wake_r:
                    continue
                rank = alive.pop(sentinel)
                proc, conn, lock = self.procs[rank - 1], self.conns[rank - 1], self.locks[rank - 1]
                proc.join(1.0)
                # Another thread joining the same process may reap it first; its exit code then
                # appears on the shared record a moment later.
                deadline = time.monotonic() + 2.0
                while proc.exitcode is None and time.monotonic() < deadline:
                    time.sleep(0.01)
                error = None
                with lock:
                    try:
                        while conn.poll(0.2):
                            message = receive(conn)
                            if message[0] == ERROR:
                                error = message[1]
                    except (EOFError, OSError):
                        pass
                self._record(rank, error, proc.exitcode)

    def _abort(self) -> None:
        """Lets NCCL collectives that wait for a dead rank fail instead of hang (gloo fails them
        by itself when a peer's connection closes)."""
        if self.device.type != "cuda":
            return
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.group.WORLD.abort()
        except Exception:  # noqa: BLE001 - best effort; the collective timeout remains
            log.warning("aborting the NCCL communicators failed", exc_info=True)


def start_parallel(path: str | Path, spec: ModelSpec, device: torch.device, dtype: torch.dtype, *, tp: int,
                   ep: bool = False, gpus: list[int] | None = None, on_progress=None,
                   quantize: str | None = None) -> WorkerGroup:
    """A started and loaded group for the checkpoint at `path`: group.model is rank 0's model."""
    devices = parallel_devices(device, tp, gpus)
    for rank in range(tp):  # an impossible split is refused before any process starts
        shard_plan(spec, tp, rank, ep)
    group = WorkerGroup(devices, ep).start()
    group.load(path, spec, dtype, on_progress, quantize=quantize)
    return group
