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

Several machines (`Rendezvous`, vLLM's ``--nnodes/--node-rank/--master-addr/--master-port``, or torchrun's
variables): node n runs global ranks n*L .. n*L+L-1 (L = ranks per node) and they all meet at a `TCPStore` that node 0
hosts on ``master_addr:master_port``. Node 0's process is rank 0 and serves; every other node runs `run_headless`:
its first rank in its main process, the rest spawned as above, all following rank 0's steps. Each node reads the
GGUF file from its own disk. Rank 0 waits for every rank to announce itself in the store and, past the timeout,
fails naming the nodes missing. Each headless node also holds a TCP connection to node 0 (the cross-machine
version of the watch pipe): when either end dies, the other sees the connection close, and node 0 marks the group
failed (as for a dead local worker) while a headless node exits.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import signal
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gpullama.distributed import TensorParallel
from gpullama.engine.args import EngineArgs
from gpullama.engine.model_runner import ModelRunner
from gpullama.engine.model_spec import ModelSpec, build_model
from gpullama.gguf_file import read_gguf
from gpullama.hub import resolve_model

log = logging.getLogger("gpullama")

JOIN_TIMEOUT_S = 120.0  # for a spawned worker to import torch and reach the group's store
STOP_TIMEOUT_S = 10.0  # for a worker to leave after the stop broadcast, before it is terminated


_PREFIX = "gpullama/"  # our keys in a store torchrun's agent may share


@dataclass
class Rendezvous:
    """Where the ranks of a tensor-parallel group meet, and which of them this machine runs: one node (a loopback
    store on a free port) or `nnodes` machines meeting at node 0's `master_addr:master_port`."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port (one node)
    timeout: float = JOIN_TIMEOUT_S
    agent_store: bool = False  # torchrun's agent hosts the store: node 0 connects to it instead of binding

    @classmethod
    def from_args(cls, args: EngineArgs, environ: dict[str, str] | None = None) -> Rendezvous:
        """The rendezvous of `args`; under torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set
        and ``--nnodes`` not given) each process is a node of one rank, rank ``RANK`` of ``WORLD_SIZE``."""
        env = os.environ if environ is None else environ
        timeout = float(args.distributed_timeout_seconds)
        if args.nnodes == 1 and all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
            world = int(env["WORLD_SIZE"])
            if world > 1:
                if args.tensor_parallel_size not in (1, world):
                    raise ValueError(f"tensor_parallel_size {args.tensor_parallel_size} differs from torchrun's "
                                     f"WORLD_SIZE {world}")
                return cls(world, int(env["RANK"]), env["MASTER_ADDR"], int(env["MASTER_PORT"]), timeout,
                           env.get("TORCHELASTIC_USE_AGENT_STORE") == "True")
        if args.nnodes == 1:
            return cls(timeout=timeout)
        return cls(args.nnodes, args.node_rank, args.master_addr, args.master_port, timeout)

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    def ranks_per_node(self, world_size: int) -> int:
        """Local ranks of each node."""
        if world_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size {world_size} must be a multiple of nnodes {self.nnodes}")
        return world_size // self.nnodes

    def first_rank(self, world_size: int) -> int:
        """The global rank of this node's first local rank."""
        return self.node_rank * self.ranks_per_node(world_size)

    def describe_node(self, node: int, world_size: int) -> str:
        per = self.ranks_per_node(world_size)
        ranks = f"rank {node * per}" if per == 1 else f"ranks {node * per}-{node * per + per - 1}"
        return f"node {node} ({ranks})"

    def open_store(self, world_size: int) -> tuple[dist.Store, str, int]:
        """This node's handle on the group's store, with the host and port its local workers connect to."""
        timeout = datetime.timedelta(seconds=self.timeout)
        if not self.multi_node:
            store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                                  timeout=timeout)
            return store, "127.0.0.1", store.port
        host = self.master_addr
        hosting = self.node_rank == 0 and not self.agent_store
        try:
            store = dist.TCPStore(host, self.master_port, None, is_master=hosting, wait_for_workers=False,
                                  timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - torch raises several kinds (DistNetworkError, DistStoreError, ...)
            what = f"host the rendezvous on {host}:{self.master_port}" if hosting else \
                f"reach the rendezvous of node 0 at {host}:{self.master_port} within {self.timeout:g}s"
            raise RuntimeError(f"tensor parallel, node {self.node_rank}: cannot {what} ({type(exc).__name__}: "
                               f"{exc})") from None
        return dist.PrefixStore(_PREFIX, store), host, self.master_port


def _client_store(host: str, port: int, timeout: float, prefixed: bool) -> dist.Store:
    store = dist.TCPStore(host, port, None, is_master=False, timeout=datetime.timedelta(seconds=timeout))
    return dist.PrefixStore(_PREFIX, store) if prefixed else store


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device of local `rank` when local rank 0 runs on `device`: ``cuda:(index + rank)`` on CUDA, else the
    CPU."""
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


class TPWorkers:
    """This node's worker processes (ranks after its first) and, on node 0 of several, its connections to the other
    nodes: started with `start` (node 0) or by `run_headless`, watched while they run, ended by `shutdown`."""

    def __init__(self, tp: TensorParallel, processes: list, reports: list[Connection], watches: list[Connection],
                 first_rank: int = 0):
        self.tp = tp
        self.processes = processes
        self.first_rank = first_rank  # the global rank of this node's first rank (the workers follow it)
        self._reports = reports
        self._watches = watches  # our ends of the pipes each worker watches; closing one ends that worker
        self._nodes: dict[socket.socket, str] = {}  # node 0: a connection per other node -> its description
        self._reported: dict[str, set[int]] = {"joining": set(), "ready": set()}  # stage -> ranks that reached it
        self._closing = False
        self._monitor: threading.Thread | None = None

    @property
    def pids(self) -> list[int]:
        """The workers' process ids (rank 1 first)."""
        return [p.pid for p in self.processes]

    @classmethod
    def spawn(cls, spec: ModelSpec, world_size: int, first_rank: int, count: int, host: str, port: int,
               prefixed: bool) -> TPWorkers:
        """Start local ranks first_rank+1 .. first_rank+count-1, which meet at the store on `host:port`."""
        ctx = mp.get_context("spawn")
        processes, reports, watches = [], [], []
        for local in range(1, count):
            rank = first_rank + local
            watch_r, watch_w = ctx.Pipe(duplex=False)
            report_r, report_w = ctx.Pipe(duplex=False)
            process = ctx.Process(target=_worker_main,
                                  args=(rank, local, world_size, host, port, prefixed, spec, watch_r, report_w),
                                  name=f"gpullama-tp{rank}", daemon=True)
            process.start()
            watch_r.close()  # only the worker holds its read end: it sees EOF when we are gone
            report_w.close()
            processes.append(process)
            reports.append(report_r)
            watches.append(watch_w)
        return cls(TensorParallel(first_rank, world_size), processes, reports, watches, first_rank)

    @classmethod
    def start(cls, spec: ModelSpec, world_size: int, rendezvous: Rendezvous | None = None) -> TPWorkers:
        """Node 0: spawn its ranks after 0, wait for every rank of every node, and join the group as rank 0;
        `tp` is rank 0's place in it."""
        if dist.is_initialized():
            raise RuntimeError(
                "this process already belongs to a torch.distributed group (another tensor-parallel LLM?); "
                "call its shutdown() first"
            )
        rdzv = rendezvous or Rendezvous()
        if rdzv.node_rank != 0:
            raise ValueError(f"node {rdzv.node_rank} does not serve: run it with `gpullama-serve --headless`")
        device = torch.device(spec.device)
        per_node = rdzv.ranks_per_node(world_size)
        check_devices(device, per_node)
        store, host, port = rdzv.open_store(world_size)
        listener = None
        if rdzv.multi_node:
            listener = socket.create_server(("", 0))  # the other nodes' watch connections
            store.set("watch_port", str(listener.getsockname()[1]))
            store.set("settings", json.dumps(_settings(spec, world_size)))
        workers = cls.spawn(spec, world_size, 0, per_node, host, port, rdzv.multi_node)
        try:
            workers.wait_for("joining", rdzv.timeout)
            if listener is not None:
                workers._wait_for_nodes(store, listener, rdzv, world_size)
            workers.tp = TensorParallel.join(0, world_size, store, device)
        except BaseException:
            workers.shutdown()
            raise
        finally:
            if listener is not None:
                listener.close()
        log.info("tensor parallel: %d ranks on %d node%s (%s), local worker pids %s", world_size, rdzv.nnodes,
                 "s" if rdzv.nnodes > 1 else "", "NCCL" if device.type == "cuda" else "gloo", workers.pids)
        return workers

    def _wait_for_nodes(self, store: dist.Store, listener: socket.socket, rdzv: Rendezvous, world_size: int) -> None:
        """Node 0: wait until every other node has connected and announced each of its ranks in the store;
        RuntimeError naming the nodes that did not within the timeout, or the error a node reported."""
        per_node = rdzv.ranks_per_node(world_size)
        pending = {node: rdzv.describe_node(node, world_size) for node in range(1, rdzv.nnodes)}
        connected: set[int] = set()
        listener.settimeout(0.1)
        deadline = time.monotonic() + rdzv.timeout
        while pending:
            self._poll(0)  # a local worker that failed meanwhile
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                conn = None
            if conn is not None:
                conn.settimeout(rdzv.timeout)
                node = int(conn.makefile().readline() or -1)
                conn.settimeout(None)
                if node in pending:
                    self._nodes[conn] = pending[node]
                    connected.add(node)
                else:
                    conn.close()
            for node in list(pending):
                if store.check([f"failed/{node}"]):
                    raise RuntimeError(f"tensor parallel: {pending[node]} failed: {store.get(f'failed/{node}').decode()}")
                ranks = [f"joined/{r}" for r in range(node * per_node, node * per_node + per_node)]
                if node in connected and store.check(ranks):
                    del pending[node]
            if pending and time.monotonic() > deadline:
                raise RuntimeError(
                    f"tensor parallel: {', '.join(pending.values())} did not join the group at "
                    f"{rdzv.master_addr}:{rdzv.master_port} within {rdzv.timeout:g}s (start "
                    f"`gpullama-serve --headless --nnodes {rdzv.nnodes} --node-rank N --master-addr "
                    f"{rdzv.master_addr} --master-port {rdzv.master_port}` there, with the same model and flags)"
                )

    def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until every worker has built its rank (raises RuntimeError with a worker's own error when one
        failed), then watch them for as long as they run."""
        self.wait_for("ready", timeout)
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

    def shutdown(self, runner: ModelRunner | None = None, stopped: bool = False) -> None:
        """Stop the workers (their step loops first, through `runner`, when it is rank 0's; `stopped`: they got
        the stop already, from node 0), leave the group and make sure no worker process is left."""
        if self._closing:
            return
        self._closing = True
        if runner is not None and not stopped:
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
        for conn in self._nodes:  # the other nodes see the connection close (they have left or are leaving)
            conn.close()
        try:
            self.tp.leave()
        except Exception as exc:  # noqa: BLE001 - the other ranks are gone whatever the group says
            log.warning("tensor parallel: leaving the group failed: %s", exc)

    # -- watching ------------------------------------------------------------------------------------
    def wait_for(self, stage: str, timeout: float | None) -> None:
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
        nodes = [conn for conn in self._nodes if conn.fileno() >= 0]
        for ready in wait([*(r for r in self._reports if not r.closed), *sentinels, *nodes], timeout):
            if isinstance(ready, socket.socket):  # another node's connection: it only ever closes
                try:
                    data = ready.recv(64)
                except OSError:
                    data = b""
                if not data and not self._closing:
                    raise RuntimeError(f"tensor-parallel {self._nodes[ready]} is gone (its connection to node 0 "
                                       "closed: the process ended or the network failed)")
                continue
            if isinstance(ready, Connection):
                index = live[ready.fileno()]
                try:
                    kind, detail = ready.recv()
                except (EOFError, OSError):  # the worker is gone: its sentinel says how
                    ready.close()
                    continue
                if kind == "error":
                    raise RuntimeError(f"tensor-parallel rank {self.first_rank + index + 1} failed: {detail}")
                self._reported[kind].add(index + 1)
            else:
                index = sentinels[ready]
                process = self.processes[index]
                process.join(timeout=1)
                if not self._closing:
                    raise RuntimeError(
                        f"tensor-parallel rank {self.first_rank + index + 1} (pid {process.pid}) exited with code "
                        f"{process.exitcode}"
                    )

    def wait_for_failure(self) -> str | None:
        """Block until a worker reports an error or exits, or another node goes (what happened), or until
        `shutdown` (None)."""
        while not self._closing:
            try:
                self._poll(None)
            except RuntimeError as exc:
                return None if self._closing else str(exc)
            except (OSError, ValueError):  # the pipes were closed by shutdown
                return None
        return None

    def _watch(self) -> None:
        """Monitor thread: mark the group failed when a worker reports an error or exits, until `shutdown`."""
        reason = self.wait_for_failure()
        if reason is not None:
            self.tp.failure = self.tp.failure or reason
            log.error("%s; no further step can run", reason)


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


def _settings(spec: ModelSpec, world_size: int) -> dict:
    """What every node must agree on (node 0 publishes its own; the others compare theirs)."""
    config = dataclasses.asdict(spec.engine_config)
    config.pop("num_blocks")  # each rank sizes its pool; the ranks then agree on the smallest
    return {"tensor_parallel_size": world_size, "model_bytes": os.path.getsize(spec.path),
            "dtype": str(spec.dtype), "max_model_len": spec.max_model_len, "cpu_fast_path": spec.quantized_cpu,
            **config}


def _announce(store: dist.Store, rank: int) -> None:
    """Tell node 0 that `rank` is about to join the group."""
    store.set(f"joined/{rank}", f"{socket.gethostname()} pid {os.getpid()}")


def run_headless(args: EngineArgs) -> None:
    """A node other than 0 (``gpullama-serve --headless``): start its ranks (the first in this process), each
    loading its shard from this machine's copy of the model, join node 0's group and follow its steps until node 0
    stops them (returns) or goes away (RuntimeError, or this process exits with status 1)."""
    rdzv = Rendezvous.from_args(args)
    world_size = max(args.tensor_parallel_size, rdzv.nnodes)
    if rdzv.node_rank == 0:
        raise ValueError("--headless is for the nodes other than 0 (--node-rank 1 and up): node 0 serves")
    per_node = rdzv.ranks_per_node(world_size)
    spec = ModelSpec.from_args(args, read_gguf(resolve_model(args.model)), world_size, per_node)
    node = rdzv.node_rank
    device = torch.device(spec.device)
    first = rdzv.first_rank(world_size)
    check_devices(device, per_node)
    store, host, port = rdzv.open_store(world_size)
    try:
        wanted = json.loads(store.get("settings"))
    except Exception as exc:  # noqa: BLE001 - the store times out with its own error kinds
        raise RuntimeError(f"tensor parallel, node {node}: node 0 did not publish its settings at "
                           f"{rdzv.master_addr}:{rdzv.master_port} within {rdzv.timeout:g}s ({exc})") from None
    mine = _settings(spec, world_size)
    differ = [f"{key} {mine.get(key)!r} here, {value!r} on node 0" for key, value in wanted.items()
              if mine.get(key) != value]
    if differ:
        message = f"the settings differ from node 0's: {'; '.join(differ)}"
        store.set(f"failed/{node}", message)
        raise RuntimeError(f"tensor parallel, node {node}: {message}")
    workers = TPWorkers.spawn(spec, world_size, first, per_node, host, port, True)
    stopping = threading.Event()
    try:
        workers.wait_for("joining", rdzv.timeout)
        leader = socket.create_connection((rdzv.master_addr, int(store.get("watch_port"))), timeout=rdzv.timeout)
        leader.settimeout(None)
        leader.sendall(f"{node}\n".encode())
        _announce(store, first)
        tp = TensorParallel.join(first, world_size, store, device)
        workers.tp = tp
        runner = ModelRunner(build_model(spec, tp, device), spec.engine_config)
        workers.wait_for("ready", rdzv.timeout)
    except BaseException as exc:
        try:
            store.set(f"failed/{node}", f"{type(exc).__name__}: {exc}")
        except Exception:  # noqa: BLE001 - node 0 is gone too; nothing to tell
            pass
        workers.shutdown()
        raise

    def watch_leader() -> None:  # node 0 gone (its connection closed): nothing will drive this node again
        try:
            while leader.recv(64):
                pass
        except OSError:
            pass
        if not stopping.is_set():
            log.error("tensor parallel: node 0 is gone; node %d exits", node)
            os._exit(1)

    def watch_workers() -> None:  # a local rank died: end this node, which node 0 sees as this node gone
        reason = workers.wait_for_failure()
        if reason is not None and not stopping.is_set():
            log.error("%s; node %d exits", reason, node)
            os._exit(1)

    threading.Thread(target=watch_leader, name="gpullama-tp-node0", daemon=True).start()
    if workers.processes:
        threading.Thread(target=watch_workers, name="gpullama-tp-monitor", daemon=True).start()
    log.info("tensor parallel: %s of %d ready, following node 0 at %s:%d", rdzv.describe_node(node, world_size),
             rdzv.nnodes, rdzv.master_addr, rdzv.master_port)
    try:
        runner.follow()
    finally:
        stopping.set()
        workers.shutdown(stopped=True)  # they got the same stop and leave on their own
        leader.close()
        tp.leave()  # gloo's threads end here, not in the interpreter's teardown (which can abort the process)
    log.info("tensor parallel: node 0 stopped the group; node %d exits", node)


def _worker_main(
    rank: int, local_rank: int, world_size: int, host: str, port: int, prefixed: bool, spec: ModelSpec,
    watch: Connection, report: Connection
) -> None:
    """A worker process: join the group, build this rank's model and KV pool, then follow rank 0's steps."""
    _watch_parent(watch)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 decides
    try:
        if spec.threads:
            torch.set_num_threads(spec.threads)
        device = rank_device(torch.device(spec.device), local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store = _client_store(host, port, JOIN_TIMEOUT_S, prefixed)
        if prefixed:
            _announce(store, rank)
        report.send(("joining", None))
        tp = TensorParallel.join(rank, world_size, store, device)
        runner = ModelRunner(build_model(spec, tp, device), spec.engine_config)
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
