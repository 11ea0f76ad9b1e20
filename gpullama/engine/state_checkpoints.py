"""Prefix caching for models with recurrent layers: copies of a sequence's recurrent states at block boundaries.

A prefix hit skips the tokens a recurrent layer's state is made of, so a hybrid model (LFM2's short convolutions,
Qwen3.5's delta-nets, Granite 4.0-H's Mamba2 layers) can reuse cached KV blocks only up to a boundary where the
state after them was saved too (vLLM and llama.cpp do the same). `StateCheckpoints` is the host-side index of a
bounded pool of such copies (the model runner holds the tensors: `ModelRunner.checkpoint_states`): each is keyed by
the chain hash of the KV block that ends at its boundary (`block_manager.chain_hash`: the tokens before it, their
images and the sequence's LoRA adapters), and the least recently used one is overwritten when the pool is full.

What is saved (`LLMEngine._save_checkpoints`): the state at the last block boundary inside a prompt (the scheduler
ends a prefill chunk exactly there: `last_prompt_boundary`), kept; and after that, each boundary a sequence's
computed tokens reach, the sequence keeping only its latest two (`LATEST_KEPT`: a chat's next turn, whose prompt
holds this answer, continues from them).
"""

from __future__ import annotations

from collections import OrderedDict

CHECKPOINTS_PER_SEQ = 3  # default checkpoints per max_num_seqs (a prompt's and the latest ones of each sequence)
LATEST_KEPT = 2  # checkpoints past its prompt's that a sequence keeps: the latest two (a chat's next turn may differ
# from the answer in its last tokens, retokenized: a longer answer's cut, a template's stripping)
CHECKPOINT_MEMORY_SHARE = 0.25  # by default, checkpoints take at most this share of the KV cache's memory


def last_prompt_boundary(num_prompt_tokens: int, block_size: int) -> int:
    """The last block boundary a prefix hit of this prompt could end at (its last token is always computed): the
    prefill's checkpoint; 0 for a prompt within one block."""
    return (num_prompt_tokens - 1) // block_size * block_size


class StateCheckpoints:
    """Which of `capacity` checkpoint slots holds the recurrent states after which prefix (by the chain hash of the
    prefix's last block), least recently used first."""

    def __init__(self, capacity: int):
        assert capacity > 0
        self.capacity = capacity
        self.slots: OrderedDict[int, int] = OrderedDict()  # block chain hash -> checkpoint slot, LRU first
        self.free = list(range(capacity - 1, -1, -1))  # popped from the end: slot 0 first

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.slots

    def __len__(self) -> int:
        return len(self.slots)

    def lookup(self, block_hash: int) -> int | None:
        """The checkpoint slot of a prefix, marked as just used; None when none is kept."""
        slot = self.slots.get(block_hash)
        if slot is not None:
            self.slots.move_to_end(block_hash)
        return slot

    def reserve(self, block_hash: int) -> int | None:
        """The slot to save a prefix's states into: a free one, else the least recently used one's (its entry
        dropped); None when that prefix already has one (only marked as used: the states are the same)."""
        if block_hash in self.slots:
            self.slots.move_to_end(block_hash)
            return None
        slot = self.free.pop() if self.free else self.slots.popitem(last=False)[1]
        self.slots[block_hash] = slot
        return slot

    def drop(self, block_hash: int) -> None:
        """Forget a prefix's checkpoint (its slot becomes free)."""
        slot = self.slots.pop(block_hash, None)
        if slot is not None:
            self.free.append(slot)
