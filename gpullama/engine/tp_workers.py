"""Tensor-parallel worker processes: ranks 1..N-1 of a model whose rank 0 is this process.

Start-up: rank 0 opens a `TCPStore` on a free loopback port, spawns one process per other rank (torch.multiprocessing,
"spawn"), and every rank joins the group there (gloo on the CPU, NCCL on CUDA, rank r on ``cuda:r``). Each worker
reads the GGUF file itself, keeps its shard of the weights and its own KV pool, reports "ready" and then runs every
step rank 0 broadcasts (`ModelRunner.follow`).

Shut-down and failure: `shutdown` broadcasts a stop, joins the workers and kills any that linger. A worker dies
with its parent: a thread in it waits on a pipe only the parent holds open, and exits the process when it closes
(the parent exited, was killed, or crashed). A worker that fails reports its traceback and exits; a thread in rank
0 notices (the report, or the process's exit) and marks the group failed, which fails the next step at once and
makes the server report itself unhealthy.

Multi-node is not built: the ranks would meet at a store on the first machine (torchrun's rendezvous and its
``MASTER_ADDR``/``MASTER_PORT``) instead of a loopback port, one process per device on every machine; nothing else
in the runner or the model changes.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gpullama.distributed import TensorParallel
from gpullama.engine.args import EngineConfig
from gpullama.engine.model_runner import ModelRunner
from gpullama.gguf_file import read_gguf
from gpullama.model import Decoder
from gpullama.ops import select_ops

log = logging.getLogger("gpullama")

JOIN_TIMEOUT_S = 120.0  # for a spawned worker to import torch and reach the group's store
STOP_TIMEOUT_S = 10.0  # for a worker to leave after the stop broadcast, before it is terminated


@dataclass
class WorkerSpec:
    """What a worker needs to build its rank of the model (sent to it at spawn, so: picklable)."""

    path: str
    device: str  # rank 0's device; rank r runs on the r-th device after it on CUDA, on the CPU on the CPU
    dtype: torch.dtype
    max_model_len: int
    engine_config: EngineConfig
    threads: int | None  # torch intra-op threads of each rank (None: torch's choice)
    quantized_cpu: bool = False  # the CPU fast path (`select_ops`' quantized_cpu), as on rank 0


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device of `rank` when rank 0 runs on `device`: ``cuda:(index + rank)`` on CUDA, else the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def check_devices(device: torch.device, world_size: int) -> None:
    """ValueError when there are not `world_size` CUDA devices from `device` on (one rank per device)."""
    if device.type != "cuda":
        return
    first, count = device.index or 0, torch.cuda.device_count()
    if first + world_size > count:
        raise ValueError(
            f"tensor_parallel_size {world_size} needs CUDA devices {first}..{first + world_size - 1} (one per rank); "
            f"{count} visible"
        )


def threads_per_rank(world_size: int) -> int:
    """The CPU cores this process may use, shared out among the ranks (at least one each)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // world_size)


class TPWorkers:
    """The worker processes of ranks 1..N-1: started with `start`, watched while they run, ended by `shutdown`."""

    def __init__(self, tp: TensorParallel, processes: list, reports: list[Connection], watches: list[Connection]):
        self.tp = tp
        self.processes = processes
        self._reports = reports
        self._watches = watches  # our ends of the pipes each worker watches; closing one ends that worker
        self._reported: dict[str, set[int]] = {"joining": set(), "ready": set()}  # stage -> ranks that reached it
        self._closing = False
        self._monitor: threading.Thread | None = None

    @property
    def pids(self) -> list[int]:
        """The workers' process ids (rank 1 first)."""
        return [p.pid for p in self.processes]

    @classmethod
    def start(cls, spec: WorkerSpec, world_size: int) -> TPWorkers:
        """Spawn ranks 1..N-1 and join the group as rank 0 with them; `tp` is rank 0's place in it."""
        if dist.is_initialized():
            raise RuntimeError(
                "this process already belongs to a torch.distributed group (another tensor-parallel LLM?); "
                "call its shutdown() first"
            )
        device = torch.device(spec.device)
        check_devices(device, world_size)
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
        ctx = mp.get_context("spawn")
        processes, reports, watches = [], [], []
        for rank in range(1, world_size):
            watch_r, watch_w = ctx.Pipe(duplex=False)
            report_r, report_w = ctx.Pipe(duplex=False)
            process = ctx.Process(target=_worker_main, args=(rank, world_size, store.port, spec, watch_r, report_w),
                                  name=f"gpullama-tp{rank}", daemon=True)
            process.start()
            watch_r.close()  # only the worker holds its read end: it sees EOF when we are gone
            report_w.close()
            processes.append(process)
            reports.append(report_r)
            watches.append(watch_w)
        workers = cls(TensorParallel(0, world_size), processes, reports, watches)
        try:
            workers._wait_for("joining", JOIN_TIMEOUT_S)
            workers.tp = TensorParallel.join(0, world_size, store, device)
        except BaseException:
            workers.shutdown()
            raise
        log.info("tensor parallel: %d ranks (%s), worker pids %s", world_size,
                 "NCCL" if device.type == "cuda" else "gloo", workers.pids)
        return workers

    def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until every worker has built its rank (raises RuntimeError with a worker's own error when one
        failed), then watch them for as long as they run."""
        self._wait_for("ready", timeout)
        self._monitor = threading.Thread(target=self._watch, name="gpullama-tp-monitor", daemon=True)
        self._monitor.start()

    def failure(self) -> str | None:
        """A worker's reported error or exit, if one has happened (reads what is waiting, without blocking)."""
        if self.tp.failure is None:
            try:
                self._poll(0)
            except RuntimeError as exc:
                self.tp.failure = str(exc)
        return self.tp.failure

    def shutdown(self, runner: ModelRunner | None = None) -> None:
        """Stop the workers (their step loops first, through `runner`, when it is rank 0's), leave the group and
        make sure no worker process is left."""
        if self._closing:
            return
        self._closing = True
        stopped = False
        if runner is not None:
            try:
                stopped = runner.stop_followers()
            except Exception as exc:  # noqa: BLE001 - a rank is gone already; the processes are ended below
                log.warning("tensor parallel: the stop broadcast failed (%s); ending the workers", exc)
        if stopped:  # they leave their loops and the group, then exit
            for process in self.processes:
                process.join(timeout=STOP_TIMEOUT_S)
        for watch in self._watches:  # a worker still alive exits on its own once its pipe closes
            watch.close()
        for process in self.processes:
            if process.is_alive():
                process.join(timeout=2)
            if process.is_alive():
                log.warning("tensor parallel: worker pid %d did not stop; killing it", process.pid)
                process.kill()
                process.join()
        for report in self._reports:
            report.close()
        try:
            self.tp.leave()
        except Exception as exc:  # noqa: BLE001 - the other ranks are gone whatever the group says
            log.warning("tensor parallel: leaving the group failed: %s", exc)

    # -- watching ------------------------------------------------------------------------------------
    def _wait_for(self, stage: str, timeout: float | None) -> None:
        """Block until every worker reported `stage`; RuntimeError when one fails, exits or the time runs out."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(self._reported[stage]) < len(self.processes):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise RuntimeError(f"tensor parallel: workers not {stage} after {timeout:.0f}s")
            self._poll(left)

    def _poll(self, timeout: float | None) -> None:
        """Wait up to `timeout` for reports (recorded by stage) or exits. RuntimeError naming the rank when one
        reported an error or exited."""
        live = {r.fileno(): i for i, r in enumerate(self._reports) if not r.closed}
        sentinels = {p.sentinel: i for i, p in enumerate(self.processes)}
        for ready in wait([*(r for r in self._reports if not r.closed), *sentinels], timeout):
            if isinstance(ready, Connection):
                index = live[ready.fileno()]
                try:
                    kind, detail = ready.recv()
                except (EOFError, OSError):  # the worker is gone: its sentinel says how
                    ready.close()
                    continue
                if kind == "error":
                    raise RuntimeError(f"tensor-parallel rank {index + 1} failed: {detail}")
                self._reported[kind].add(index + 1)
            else:
                index = sentinels[ready]
                process = self.processes[index]
                process.join(timeout=1)
                if not self._closing:
                    raise RuntimeError(
                        f"tensor-parallel rank {index + 1} (pid {process.pid}) exited with code {process.exitcode}"
                    )

    def _watch(self) -> None:
        """Monitor thread: mark the group failed when a worker reports an error or exits, until `shutdown`."""
        while not self._closing:
            try:
                self._poll(None)
            except RuntimeError as exc:
                if not self._closing:
                    self.tp.failure = self.tp.failure or str(exc)
                    log.error("%s; no further step can run", exc)
                return
            except (OSError, ValueError):  # the pipes were closed by shutdown
                return


def _watch_parent(watch: Connection) -> None:
    """Exit this process as soon as the parent's end of `watch` closes (the parent exited, crashed or was killed)."""

    def run() -> None:
        try:
            while True:
                watch.recv()
        except (EOFError, OSError):
            pass
        os._exit(0)

    threading.Thread(target=run, name="gpullama-tp-parent", daemon=True).start()


def _worker_main(
    rank: int, world_size: int, port: int, spec: WorkerSpec, watch: Connection, report: Connection
) -> None:
    """A worker process: join the group, build this rank's model and KV pool, then follow rank 0's steps."""
    _watch_parent(watch)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 decides
    try:
        if spec.threads:
            torch.set_num_threads(spec.threads)
        device = rank_device(torch.device(spec.device), rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
        report.send(("joining", None))
        tp = TensorParallel.join(rank, world_size, store, device)
        gguf_model = read_gguf(spec.path)
        model = Decoder(gguf_model.config, gguf_model.tensors, select_ops(device, spec.dtype, spec.quantized_cpu), spec.max_model_len, tp)
        del gguf_model
        runner = ModelRunner(model, spec.engine_config)
        report.send(("ready", None))
        runner.follow()
        tp.leave()
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0, then this process ends
        detail = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        try:
            report.send(("error", detail))
        except OSError:
            pass
        os._exit(1)
