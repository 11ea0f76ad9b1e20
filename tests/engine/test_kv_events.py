"""KV-cache events in vLLM's format: a ZMQ subscriber decodes them with vLLM's message types (msgspec structs, as
``vllm.distributed.kv_events`` declares them) and rebuilds the prefix cache the engine holds; the replay socket
resends what a late subscriber missed."""

from __future__ import annotations

import socket
import time

import msgspec
import pytest
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from gpullama import LLM
from gpullama.engine.kv_events import KVEventPublisher, KVEventsConfig
from gpullama.sampling_params import SamplingParams
from tests.engine.helpers import make_engine, random_prompt, run_requests

TINY_VOCAB, TINY_BOS = 700, 700
BLOCK = 16


# -- the reference: vLLM's event types (msgspec tagged, array-like structs; the tag is the class name) --------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subscriber(endpoint: str, topic: bytes = b"kv", timeout: float = 60.0) -> zmq.Socket:
    """A SUB socket on `endpoint`, returned once its connection has shaken hands with the publisher. ZMQ queues
    the subscription at connect and sends it right after the handshake, so what is published from then on reaches
    it: no sleep for ZMQ's slow joiner."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sub.connect(endpoint)
        assert monitor.poll(timeout * 1000), f"no connection to {endpoint} in {timeout}s"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
    finally:
        sub.disable_monitor()
        monitor.close(linger=0)
    return sub


def _receive(sub: zmq.Socket, until_seq: int, timeout: float = 10.0) -> dict[int, KVEventBatch]:
    """Live messages by sequence number until `until_seq` has arrived."""
    got: dict[int, KVEventBatch] = {}
    deadline = time.monotonic() + timeout
    while until_seq not in got:
        assert time.monotonic() < deadline, f"no message {until_seq} (got {sorted(got)})"
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv"
            got[int.from_bytes(seq, "big")] = DECODER.decode(payload)
    return got


def _replay(endpoint: str, start: int) -> dict[int, KVEventBatch]:
    """Every buffered message from `start` on, asked of the replay socket as vLLM's subscriber asks."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        got = {}
        while True:
            assert dealer.poll(5000), "the replay did not end"
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                return got
            got[int.from_bytes(seq, "big")] = DECODER.decode(payload)
    finally:
        dealer.close(linger=0)


def _cache_from_events(batches: list[KVEventBatch]) -> dict[int, tuple[int | None, tuple[int, ...]]]:
    """What a router knows from the events: block hash -> (parent hash, its tokens)."""
    cache: dict[int, tuple[int | None, tuple[int, ...]]] = {}
    for batch in batches:
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                cache.clear()
            elif isinstance(event, BlockStored):
                assert event.block_size == BLOCK and event.lora_id is None
                assert len(event.token_ids) == BLOCK * len(event.block_hashes)
                parent = event.parent_block_hash
                for i, h in enumerate(event.block_hashes):
                    assert h not in cache and 0 <= h < 1 << 64
                    cache[h] = (parent, tuple(event.token_ids[i * BLOCK : (i + 1) * BLOCK]))
                    parent = h
            else:
                for h in event.block_hashes:
                    del cache[h]  # a removal names a block the events stored
    return cache


def _prefix_of(cache, h: int) -> list[int]:
    """The tokens from the start of the sequence through block `h`, following the parent hashes."""
    tokens: list[int] = []
    while h is not None:
        parent, ids = cache[h]
        tokens[:0] = ids
        h = parent
    return tokens


@pytest.fixture()
def publisher():
    port, replay_port = _free_port(), _free_port()
    pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", topic="kv")
    yield pub, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}"
    pub.close()


def test_events_rebuild_the_prefix_cache_and_the_replay_resends_them(tiny_llm: LLM, publisher) -> None:
    """Stored blocks chain to their parents and hold the prompts' tokens; evictions remove them; the router's view
    (events decoded with vLLM's types) equals the engine's prefix cache, live and from the replay."""
    pub, endpoint, replay_endpoint = publisher
    sub = subscriber(endpoint)  # it joins after message 0, AllBlocksCleared (sent as the publisher started)
    engine = make_engine(tiny_llm, num_blocks=20, max_num_seqs=2)
    engine.block_manager.event_sink = pub.record
    gen = torch.Generator().manual_seed(11)
    shared = random_prompt(gen, 2 * BLOCK, TINY_VOCAB, TINY_BOS)
    first = shared + random_prompt(gen, 2 * BLOCK + 5, TINY_VOCAB)  # 4 full blocks
    second = shared + random_prompt(gen, BLOCK + 3, TINY_VOCAB)  # hits 2 blocks, stores 1 more
    params = SamplingParams(temperature=0.0, max_tokens=3)
    run_requests(engine, [first], params)
    run_requests(engine, [second], params)
    bm = engine.block_manager
    stored_before = dict(bm.cached)
    # prompts of 9 blocks each, one at a time, take every free slot in turn: the older cached blocks go
    for _ in range(3):
        run_requests(engine, [random_prompt(gen, 9 * BLOCK + 2, TINY_VOCAB, TINY_BOS)], params)
    engine_view = {h & ((1 << 64) - 1): bm.blocks[b].token_ids for h, b in bm.cached.items()}
    assert set(stored_before) - set(bm.cached), "the test meant to evict cached blocks"

    deadline = time.monotonic() + 60
    while pub._next_seq == 0 or not pub._queue.empty():  # every event taken by the publisher's thread
        assert time.monotonic() < deadline
        time.sleep(0.02)
    # that thread answers a replay only between batches, so an answer means the last batch is sent and counted
    assert _replay(replay_endpoint, 1 << 62) == {}
    last = pub._next_seq - 1
    live = _receive(sub, last)
    sub.close(linger=0)
    replayed = _replay(replay_endpoint, 0)
    assert sorted(replayed) == list(range(last + 1))
    assert isinstance(replayed[0].events[0], AllBlocksCleared)
    for seq, batch in live.items():  # the replay resends the very messages that went out live
        assert batch == replayed[seq]
    removed = [h for b in replayed.values() for e in b.events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed, "evictions were published"

    cache = _cache_from_events([replayed[s] for s in sorted(replayed)])
    assert {h: ids for h, (_, ids) in cache.items()} == engine_view
    stored = [e for b in replayed.values() for e in b.events if isinstance(e, BlockStored)]
    # the first prompt's 4 blocks (one event), then the second's third block, whose parent is the shared block 2
    assert stored[0].parent_block_hash is None and stored[0].token_ids == first[: 4 * BLOCK]
    assert stored[1].token_ids == second[2 * BLOCK : 3 * BLOCK]
    assert stored[1].parent_block_hash == stored[0].block_hashes[1]
    for h in cache:  # every cached block's chain of parents spells a prefix that a request really had
        tokens = _prefix_of(cache, h)
        assert len(tokens) % BLOCK == 0


def test_replay_from_a_later_sequence_and_a_busy_address(publisher) -> None:
    """The replay starts where asked; a second publisher on a taken address fails with the address in its error."""
    pub, endpoint, replay_endpoint = publisher
    from gpullama.engine.kv_events import BlockRemoved as Removed

    for i in range(3):
        pub.record(Removed([i]))
        time.sleep(0.05)
    deadline = time.monotonic() + 5
    while not (everything := _replay(replay_endpoint, 0)) or \
            [h for b in everything.values() for e in b.events if isinstance(e, BlockRemoved) for h in e.block_hashes] \
            != [0, 1, 2]:  # all three published (in one batch or several)
        assert time.monotonic() < deadline, everything
        time.sleep(0.05)
    assert sorted(everything) == list(range(len(everything)))
    last = max(everything)
    got = _replay(replay_endpoint, last)
    assert got == {last: everything[last]}
    assert _replay(replay_endpoint, last + 1) == {}
    with pytest.raises(RuntimeError, match=endpoint.replace("*", r"\*")):
        KVEventPublisher(endpoint)


@pytest.mark.parametrize("text, message", [
    ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "unknown key 'endpont'"),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events must be true or false"),
    ('{"buffer_steps": 0}', "buffer_steps must be an integer >= 1"),
    ('{"publisher": "nats"}', "publisher must be 'zmq' or 'null'"),
    ("[1]", "expected a JSON object"),
])
def test_bad_config_names_the_key(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVEventsConfig.from_json(text)
    config = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "replay_endpoint": "tcp://*:5558"}')
    assert config.enabled and config.endpoint == "tcp://*:5557" and config.replay_endpoint == "tcp://*:5558"
