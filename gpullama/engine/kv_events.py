"""KV-cache events in vLLM's format, for routers that place requests on prefix-cache hits (llm-d, Dynamo, Ray).

The block manager reports what its prefix cache gains and loses: `BlockStored` when full blocks become findable by
content, `BlockRemoved` when a cached block is taken for other tokens, `AllBlocksCleared` when the publisher starts
(a restarted server holds nothing a router may remember). `KVEventPublisher` sends them as vLLM does: a ZMQ PUB
socket, each message three frames ``[topic, sequence number (8 bytes, big-endian), payload]``, the payload a
msgpack array ``[timestamp, [event, ...]]`` (plus the data-parallel rank when one is set), each event an array
``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``,
``["BlockRemoved", block_hashes, medium]`` or ``["AllBlocksCleared"]`` (msgspec's tagged array-like structs of
``vllm.distributed.kv_events``). A ROUTER replay socket answers ``[b"", start sequence (8 bytes)]`` with every
buffered message from that sequence on, each ``[b"", sequence, payload]``, then ``[b"", -1 (8 bytes, signed), b""]``.

Block hashes are our chained block keys as unsigned 64-bit integers. pyzmq and msgpack are the optional extra
``gpullama[kv-events]``; this module imports them only when a publisher is built.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, fields

log = logging.getLogger("gpullama")

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker
_U64 = (1 << 64) - 1


def external_hash(block_hash: int) -> int:
    """A block key as the unsigned 64-bit integer the events carry (routers decode hashes as u64)."""
    return block_hash & _U64


@dataclass
class BlockStored:
    """Full blocks that became findable by content: their hashes in order, the hash of the block before the first
    (None at the start of a sequence) and the tokens of all of them."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None

    def as_array(self) -> list:
        return ["BlockStored", self.block_hashes, self.parent_block_hash, self.token_ids, self.block_size,
                self.lora_id, self.medium]


@dataclass
class BlockRemoved:
    """Cached blocks that are no longer findable (their slot was taken for other tokens)."""

    block_hashes: list[int]
    medium: str | None = None

    def as_array(self) -> list:
        return ["BlockRemoved", self.block_hashes, self.medium]


@dataclass
class AllBlocksCleared:
    """Nothing is cached any more (sent when the publisher starts)."""

    def as_array(self) -> list:
        return ["AllBlocksCleared"]


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` keys (JSON): events on with ``enable_kv_cache_events``, published on
    `endpoint` (bound), replayed on `replay_endpoint` from the last `buffer_steps` batches."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse the flag's JSON; ValueError naming the key and what it must be."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config: not JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ValueError("--kv-events-config: expected a JSON object such as "
                             '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}')
        known = {f.name: f for f in fields(cls)}
        for key, value in data.items():
            if key not in known:
                raise ValueError(f"--kv-events-config: unknown key {key!r} (known: {', '.join(known)})")
            want = {"enable_kv_cache_events": bool, "buffer_steps": int, "hwm": int, "max_queue_size": int}.get(key, str)
            ok = isinstance(value, want) and (want is bool or not isinstance(value, bool))
            if key == "replay_endpoint" and value is None:
                ok = True
            if not ok or (want is int and value < 1):
                kind = {bool: "true or false", int: "an integer >= 1", str: "a string"}[want]
                raise ValueError(f"--kv-events-config: {key} must be {kind}, got {value!r}")
        config = cls(**data)
        if config.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher must be 'zmq' or 'null', got {config.publisher!r}")
        return config

    @property
    def enabled(self) -> bool:
        """Whether a publisher is to be started."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


class KVEventPublisher:
    """Publishes the events handed to `record` (from any thread) on a ZMQ PUB socket, in batches, from its own
    thread; keeps the last `buffer_steps` batches for the replay socket. `close` stops it."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = 100_000, max_queue_size: int = 100_000,
                 data_parallel_rank: int | None = None):
        try:
            import msgpack
            import zmq
        except ImportError as exc:
            raise RuntimeError(f"KV-cache events need pyzmq and msgpack: pip install 'gpullama[kv-events]' ({exc})")\
                from None
        self._zmq, self._packb = zmq, msgpack.packb
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic
        self.data_parallel_rank = data_parallel_rank
        self._hwm = hwm
        self._queue: queue.Queue[KVEvent | None] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self.dropped = 0  # events lost because the queue was full (the publisher fell behind)
        self._bound = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="gpullama-kv-events", daemon=True)
        self._thread.start()
        self._bound.wait()
        if self._error is not None:
            self._thread.join()
            raise RuntimeError(f"KV-cache events: cannot bind {endpoint}"
                               f"{' / ' + replay_endpoint if replay_endpoint else ''}: {self._error}") from None
        self.record(AllBlocksCleared())

    @classmethod
    def from_config(cls, config: KVEventsConfig, data_parallel_rank: int | None = None) -> KVEventPublisher:
        """A publisher as `config` says (which must be `enabled`)."""
        return cls(config.endpoint, config.replay_endpoint, config.topic, config.buffer_steps, config.hwm,
                   config.max_queue_size, data_parallel_rank)

    def record(self, event: KVEvent) -> None:
        """Queue one event (thread-safe, never blocks: when the queue is full the event is counted as dropped)."""
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self.dropped += 1

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then close the sockets."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)

    # -- the publishing thread (owns the sockets: ZMQ sockets are not thread-safe) --------------------------
    def _run(self) -> None:
        zmq = self._zmq
        context = zmq.Context.instance()
        pub = replay = None
        try:
            pub = context.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, self._hwm)
            pub.bind(self.endpoint)
            if self.replay_endpoint:
                replay = context.socket(zmq.ROUTER)
                replay.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            self._error = exc
            for sock in (pub, replay):
                if sock is not None:
                    sock.close(linger=0)
            self._bound.set()
            return
        self._bound.set()
        topic = self.topic.encode()
        try:
            while True:
                if replay is not None and replay.poll(0):
                    self._serve_replay(replay)
                try:
                    first = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                events, stop = [], first is None
                if first is not None:
                    events.append(first)
                while not stop:  # one batch of what is waiting now (about one engine step's events)
                    try:
                        event = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if event is None:
                        stop = True
                    else:
                        events.append(event)
                if events:
                    self._publish(pub, topic, events)
                if stop:
                    return
        finally:
            pub.close(linger=1000)
            if replay is not None:
                replay.close(linger=0)

    def _publish(self, pub, topic: bytes, events: list[KVEvent]) -> None:
        batch = [time.time(), [event.as_array() for event in events]]
        if self.data_parallel_rank is not None:
            batch.append(self.data_parallel_rank)
        payload = self._packb(batch, use_bin_type=True)
        seq = self._next_seq
        self._next_seq += 1
        pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
        self._buffer.append((seq, payload))

    def _serve_replay(self, replay) -> None:
        """Answer one replay request: every buffered batch from the asked sequence on, then the end marker."""
        frames = replay.recv_multipart()
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            log.warning("KV-cache events: malformed replay request (%d frames); ignored", len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                replay.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
        replay.send_multipart([client, b"", END_SEQ, b""])


EventSink = Callable[[KVEvent], None]
