"""Paged KV blocks: allocation, reference counts and the prefix cache (chained hashes of full blocks)."""

from __future__ import annotations

from collections import OrderedDict

from gpullama.engine.kv_events import BlockRemoved, BlockStored, EventSink, external_hash
from gpullama.engine.sequence import Sequence
from gpullama.engine.state_checkpoints import StateCheckpoints


class Block:
    """One block of the pool: who uses it, and the tokens it caches once full."""

    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "parent", "epoch")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()
        # (block id, epoch) of the block before it when it was filled; for a sequence's first block, the sequence's
        # cache salt (its LoRA adapters; None for the base model)
        self.parent: tuple | None = None
        self.epoch = 0  # bumped each time the block is handed out again

    @property
    def key(self) -> tuple[int, int]:
        """Identity of this block's current contents."""
        return (self.block_id, self.epoch)


def chain_hash(parent: int | None, token_ids: tuple) -> int:
    """Key of a full block: its tokens (and the content hash of any image among them) chained with the key of the
    block before it."""
    return hash((parent, token_ids))


class BlockManager:
    """Hands out pool blocks to sequences; keeps full blocks findable by content until they are reused (LRU). With
    `state_checkpoints` (a model with recurrent layers), a prefix hit ends at the last hit block after which the
    recurrent states were saved too."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 state_checkpoints: StateCheckpoints | None = None):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.state_checkpoints = state_checkpoints
        self.blocks = [Block(i) for i in range(num_blocks)]
        # unreferenced blocks, least recently freed first; cached ones stay findable until taken
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # chain hash -> block id
        self.event_sink: EventSink | None = None  # hears what the prefix cache gains and loses (kv_events)

    @property
    def num_blocks(self) -> int:
        """Size of the pool in blocks."""
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (cached ones included)."""
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def _take_free(self) -> Block:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]
            if self.event_sink is not None:
                self.event_sink(BlockRemoved([external_hash(block.hash)]))
        block.hash, block.token_ids, block.parent = None, (), None
        block.epoch += 1
        block.ref_count = 1
        return block

    def _prefix_hits(self, seq: Sequence) -> list[Block]:
        """Cached blocks that hold the leading full blocks of the sequence (the last token is always recomputed;
        with state checkpoints, up to the last one whose recurrent states were saved).
        A hit needs the same hash, the same token ids and the same block before it, so a hash collision can never
        serve another prefix's k/v."""
        if not self.enable_prefix_caching:
            return []
        hits: list[Block] = []
        salt = seq.cache_salt  # the first block's parent: its LoRA adapters (None: the base model)
        parent = None if salt is None else hash(salt)
        for start in range(0, seq.num_tokens - 1 - self.block_size + 1, self.block_size):
            ids = seq.block_key(start, start + self.block_size)
            parent = chain_hash(parent, ids)
            block_id = self.cached.get(parent)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != ids or block.parent != (hits[-1].key if hits else salt):
                break
            hits.append(block)
        if self.state_checkpoints is not None:  # cut back to a boundary with the recurrent states saved
            while hits and hits[-1].hash not in self.state_checkpoints:
                hits.pop()
        return hits

    def allocate(self, seq: Sequence, num_new_tokens: int, use_prefix_cache: bool = True) -> bool:
        """Give a waiting sequence its blocks: prefix-cache hits first, then fresh blocks for `num_new_tokens` more
        tokens beyond the hits. Returns False (and changes nothing) when the pool is short."""
        assert not seq.block_table
        hits = self._prefix_hits(seq) if use_prefix_cache else []
        cached_tokens = len(hits) * self.block_size
        num_new_tokens = min(num_new_tokens, seq.num_tokens - cached_tokens)
        fresh = self.blocks_needed(cached_tokens + num_new_tokens) - len(hits)
        reused_free = sum(1 for b in hits if b.ref_count == 0)
        if fresh + reused_free > len(self.free):
            return False
        for block in hits:
            if block.ref_count == 0:
                del self.free[block.block_id]
            block.ref_count += 1
            seq.block_table.append(block.block_id)
        for _ in range(fresh):
            seq.block_table.append(self._take_free().block_id)
        seq.num_computed_tokens = cached_tokens
        return True

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether the pool can hold `num_new_tokens` more tokens of a running sequence."""
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return needed <= len(self.free)

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow a running sequence's block table to cover `num_new_tokens` more tokens."""
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for _ in range(needed):
            seq.block_table.append(self._take_free().block_id)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks at the end of a running sequence's table beyond what `num_tokens` tokens need (the
        room of rejected draft tokens; they were taken fresh this step, so no other sequence or cache entry holds
        them)."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            assert block.ref_count == 1 and block.hash is None
            block.ref_count = 0
            self.free[block.block_id] = None

    def commit_full_blocks(self, seq: Sequence, old_num_computed: int) -> None:
        """Register the blocks that this step filled, so later requests with the same prefix find them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        first, last = old_num_computed // bs, seq.num_computed_tokens // bs
        previous = self.blocks[seq.block_table[first - 1]] if first > 0 else None
        salt = seq.cache_salt
        stored: BlockStored | None = None  # the run of blocks that became findable, for the event sink
        for index in range(first, last):
            block = self.blocks[seq.block_table[index]]
            ids = seq.block_key(index * bs, (index + 1) * bs)  # token ids (and the images they show)
            findable = False
            if block.hash is None:
                block.hash = chain_hash(previous.hash if previous else (None if salt is None else hash(salt)), ids)
                block.token_ids = ids
                block.parent = self._findable(previous).key if previous else salt
                findable = self.cached.setdefault(block.hash, block.block_id) == block.block_id
            if self.event_sink is not None:
                if findable:
                    if stored is None:
                        parent = external_hash(previous.hash) if previous and previous.hash is not None else None
                        stored = BlockStored([], parent, [], bs, lora_id=seq.lora[0][0] if seq.lora else None)
                    stored.block_hashes.append(external_hash(block.hash))
                    stored.token_ids.extend(seq.token_ids[index * bs : (index + 1) * bs])
                elif stored is not None:  # a gap: the blocks after it go in an event of their own
                    self.event_sink(stored)
                    stored = None
            previous = block
        if stored is not None:
            self.event_sink(stored)

    def _findable(self, block: Block) -> Block:
        """The block a prefix hit finds for `block`'s contents: itself, or the cached block with its hash, tokens and
        parent (the same k/v computed before, by a sequence whose hit ended earlier). A block's parent is that one,
        so the blocks after a recomputed copy stay findable behind the cached chain."""
        found = self.cached.get(block.hash)
        if found is not None and found != block.block_id:
            other = self.blocks[found]
            if other.token_ids == block.token_ids and other.parent == block.parent:
                return other
        return block

    def free_sequence(self, seq: Sequence) -> None:
        """Release a sequence's blocks; full blocks stay cached until their slot is reused."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
