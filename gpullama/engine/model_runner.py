"""The device side of the engine: the KV pool, each step's inputs, the decode graphs, and scoring.

Built once per loaded model. The scheduler hands it a `ScheduledBatch` that says what it is; the runner turns
it into token ids and `BatchMetadata` on the device and runs the forward: replayed from static buffers (CUDA
graphs where the ops support them) when the batch is a uniform decode, eagerly otherwise.

Under tensor parallelism every rank has a runner over its own KV pool (its heads, the same block ids on each):
rank 0's broadcasts each step's `StepInputs` before running it, the other ranks' `follow` runs what they receive.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import mmap
import threading

import torch

from gpullama.config import ModelConfig
from gpullama.engine.args import EngineConfig
from gpullama.engine.decode_graphs import DecodeGraphs
from gpullama.engine.scheduler import ScheduledBatch
from gpullama.engine.sequence import Sequence
from gpullama.engine.state_checkpoints import CHECKPOINT_MEMORY_SHARE, CHECKPOINTS_PER_SEQ
from gpullama.engine.step_inputs import StepBroadcast, StepInputs, step_buffer_size
from gpullama.model import Decoder
from gpullama.ops import BatchMetadata, TorchOps
from gpullama.ops.metadata import LoraGroup
from gpullama.ops.rope import mrope_axes, mrope_rows

log = logging.getLogger("gpullama")

CPU_KV_CACHE_BYTES = 1 << 30  # default KV pool on the CPU
GPU_MEMORY_FRACTION = 0.85  # share of free GPU memory the KV pool may take after the weights


def kv_row_size(head_dim: int, kv_dtype: torch.dtype) -> int:
    """Elements of one KV cache row (one token, one kv head): `head_dim`, or for a uint8 (Q8_0) pool its int8
    values and then a float16 scale (2 bytes) per 32 of them."""
    return head_dim + head_dim // 16 if kv_dtype == torch.uint8 else head_dim


def kv_pool_dtype(ops: TorchOps, name: str, config: ModelConfig, block_size: int) -> torch.dtype:
    """The one dtype of every KV pool for `kv_cache_dtype` `name`: what the ops pick for each head dim the pools have
    (Gemma 4's sliding and full layers differ), the widest of them; ValueError where one of them is refused."""
    dims = sorted({config.layer_head_dim(i) for i in config.kv_layers} or {config.head_dim})
    return max((ops.kv_cache_dtype(name, d, block_size, latent=config.is_mla) for d in dims), key=lambda t: t.itemsize)


def kv_format_name(kv_dtype: torch.dtype) -> str:
    """The KV cache format of a pool dtype in words: float32, float16, bfloat16 or q8_0."""
    return "q8_0" if kv_dtype == torch.uint8 else str(kv_dtype).removeprefix("torch.")


def kv_block_bytes(config: ModelConfig, block_size: int, kv_dtype: torch.dtype) -> int:
    """Bytes of one KV block: k and v of `block_size` tokens in every layer with a KV pool (the one latent row of
    multi-head latent attention, which has no value pool; none in a short-convolution layer)."""
    pools = 2 if config.separate_values else 1
    rows = sum(config.layer_kv_heads(i) * kv_row_size(config.layer_head_dim(i), kv_dtype) for i in config.kv_layers)
    return pools * block_size * rows * kv_dtype.itemsize


def kv_pool_blocks(
    model_config: ModelConfig, config: EngineConfig, kv_dtype: torch.dtype, device: torch.device
) -> int:
    """How many blocks the KV pool gets: `config.kv_cache_memory` bytes when given, else the device default
    (1 GiB on the CPU, 85% of free GPU memory) capped at what `max_num_seqs` full-length sequences can use; less
    the recurrent-state checkpoints (`checkpoint_count`). Raises ValueError when the pool cannot hold one sequence
    of `max_model_len` tokens."""
    return kv_pool_size(model_config, config, kv_dtype, device)[0]


def checkpoint_count(model_config: ModelConfig, config: EngineConfig, memory: int | None) -> int:
    """How many recurrent-state checkpoints prefix caching keeps (`state_checkpoints`): none for a model without
    recurrent layers or with prefix caching off; `config.state_checkpoints` when given; else 3 per `max_num_seqs`,
    as many as a quarter of the KV cache's `memory` holds (None: no limit)."""
    per = model_config.state_bytes
    if not per or not config.enable_prefix_caching:
        return 0
    if config.state_checkpoints is not None:
        return config.state_checkpoints
    count = CHECKPOINTS_PER_SEQ * config.max_num_seqs
    return count if memory is None else min(count, int(memory * CHECKPOINT_MEMORY_SHARE) // per)


def kv_pool_size(
    model_config: ModelConfig, config: EngineConfig, kv_dtype: torch.dtype, device: torch.device
) -> tuple[int, str, int]:
    """`kv_pool_blocks` with the limit that decided it, in words for the load log, and the number of recurrent-state
    checkpoints whose memory the budget holds too (`checkpoint_count`)."""
    per_block = kv_block_bytes(model_config, config.block_size, kv_dtype)
    per_seq = -(-config.max_model_len // config.block_size)
    memory = config.kv_cache_memory
    if memory is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            memory = int(free * GPU_MEMORY_FRACTION)
            why = f"{GPU_MEMORY_FRACTION:.0%} of free GPU memory"
        else:
            memory = CPU_KV_CACHE_BYTES
            why = f"the CPU default of {CPU_KV_CACHE_BYTES / 2**30:g} GiB"
    else:
        why = "kv_cache_memory"
    checkpoints = checkpoint_count(model_config, config, memory)
    checkpoint_bytes = checkpoints * model_config.state_bytes
    num_blocks = max(0, memory - checkpoint_bytes) // per_block
    if checkpoints:
        why += f", less {checkpoints} state checkpoints of {checkpoint_bytes / 2**20:.1f} MiB"
    usable = config.max_num_seqs * per_seq  # more can never be used
    if config.kv_cache_memory is None and usable <= num_blocks:
        num_blocks = usable
        why = f"max_num_seqs {config.max_num_seqs} x max_model_len {config.max_model_len}"
    if num_blocks < per_seq:
        taken = f" after {checkpoint_bytes} bytes of {checkpoints} state checkpoints (state_checkpoints)" \
            if checkpoints else ""
        raise ValueError(
            f"KV cache of {memory} bytes holds {num_blocks * config.block_size} tokens{taken}, fewer than "
            f"max_model_len {config.max_model_len}: give more kv_cache_memory or a smaller max_model_len"
            + (" or fewer state_checkpoints" if checkpoints else "")
        )
    return int(num_blocks), why, checkpoints


def kv_cache_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV cache tensor. On the CPU it lies in anonymous mapped memory, which the OS hands out as zero pages
    when first written: the pool costs resident memory only as far as requests fill it (`torch.zeros` would write
    every page at load)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    buffer = mmap.mmap(-1, max(1, numel * dtype.itemsize))
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)


@dataclasses.dataclass
class StepOutput:
    """What one step's forward gives back: the logits of the sampling rows (in `ScheduledBatch.sampling` order) and
    the pooled final hidden states of the embedding rows (one row per `ScheduledBatch.pool_rows` entry, one per token
    for pooling none: `ScheduledBatch.pool_counts`; float32; None when the step has none)."""

    logits: torch.Tensor
    pooled: torch.Tensor | None = None


class ModelRunner:
    """Owns the KV pool and the static decode buffers of one model (of this rank's heads under tensor parallelism);
    runs each scheduled batch's forward. The pool is one k and one v tensor a layer with attention, ``[num_blocks +
    1, block_size, kv_heads, head_dim]``; for multi-head latent attention one row a token and layer (rotary |
    latent, ``head_dim`` = rope dims + kv_lora_rank) and no v tensors (`v_caches` is empty). Recurrent layers (LFM2's
    short convolutions) keep `states` instead: one tensor a layer with a slot for each of `max_num_seqs` running
    sequences (`Sequence.state_slot`) and a scratch slot for scoring and padded decode rows."""

    def __init__(self, model: Decoder, config: EngineConfig):
        self.model = model
        self.config = config
        self.tp = model.tp
        ops = model.ops
        self.device = ops.device
        # the ops say what the pool holds: float16 on the CPU fast path by default, float32 on the exact CPU path,
        # the compute dtype on a GPU (uint8: Q8_0 rows)
        mc = model.config
        self.kv_dtype = kv_pool_dtype(ops, config.kv_cache_dtype, mc, config.block_size)
        local = dataclasses.replace(mc, num_kv_heads=model.num_kv_heads)  # this rank's share of each block
        if config.num_blocks:
            self.num_blocks, self.kv_pool_limit = config.num_blocks, "num_blocks"
            self.num_checkpoints = checkpoint_count(mc, config, config.kv_cache_memory)
        else:
            self.num_blocks, self.kv_pool_limit, self.num_checkpoints = kv_pool_size(local, config, self.kv_dtype,
                                                                                     self.device)
        # every rank's pool holds the same block ids: the smallest any rank's memory allows
        agreed = self.tp.agree_min(self.num_blocks)
        if agreed < self.num_blocks:
            self.num_blocks, self.kv_pool_limit = agreed, "the smallest pool of the tensor-parallel ranks"
        max_blocks_per_seq = -(-config.max_model_len // config.block_size)
        self.steps = None
        self._step_lock = threading.Lock()  # a step and the stop broadcast never interleave
        if self.tp.world_size > 1:
            max_tokens = max(config.max_num_batched_tokens, config.max_model_len)  # scoring runs a whole context
            self.steps = StepBroadcast(self.tp, step_buffer_size(config.max_num_seqs, max_tokens, max_blocks_per_seq))
        # one block past the managed ones: the scratch block that padded decode rows write into
        def shape(i: int) -> tuple[int, ...]:  # layer i's pool: this rank's KV heads (Gemma 4: its layer kind's)
            heads = model.num_kv_heads * mc.layer_kv_heads(i) // mc.num_kv_heads
            return (self.num_blocks + 1, config.block_size, heads, kv_row_size(mc.layer_head_dim(i), self.kv_dtype))

        self.k_caches = [kv_cache_tensor(shape(i), self.kv_dtype, self.device) for i in mc.kv_layers]
        # multi-head latent attention keeps no values: they are the latent part of each key row
        self.v_caches = [kv_cache_tensor(shape(i), self.kv_dtype, self.device)
                         for i in (mc.kv_layers if mc.separate_values else ())]
        self.scratch_state_slot = config.max_num_seqs
        self.states = model.new_states(config.max_num_seqs + 1)
        # prefix caching's copies of one sequence's states at block boundaries (`state_checkpoints`), a tensor per
        # state as `states`; on the CPU resident only once written, as the KV pool
        self.checkpoint_states = [kv_cache_tensor((self.num_checkpoints, *s.shape[1:]), s.dtype, self.device)
                                  for s in self.states] if self.num_checkpoints else []
        use_graphs = config.use_cuda_graphs and self.device.type == "cuda" and ops.supports_cuda_graphs
        self.decode_graphs = None
        if use_graphs or config.static_decode:
            self.decode_graphs = DecodeGraphs(
                model, self.k_caches, self.v_caches, states=self.states, scratch_state_slot=self.scratch_state_slot,
                max_num_seqs=config.max_num_seqs,
                max_blocks_per_seq=max_blocks_per_seq,
                scratch_block=self.num_blocks, use_graphs=use_graphs,
            )

    def save_states(self, seqs: list[Sequence]) -> dict[int, list[torch.Tensor]]:
        """Copies of these sequences' slots of the recurrent layers' states ({slot: a copy per layer}; {} without
        such layers), for `restore_states`."""
        slots = [seq.state_slot for seq in seqs if seq.state_slot >= 0] if self.states else []
        if not slots:
            return {}
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        rows = [state.index_select(0, index) for state in self.states]
        return {slot: [r[j] for r in rows] for j, slot in enumerate(slots)}

    def restore_states(self, saved: dict[int, list[torch.Tensor]], seqs: list[Sequence]) -> None:
        """Put these sequences' states back as `save_states` copied them (a step run again starts where it did)."""
        for seq in seqs:
            for state, row in zip(self.states, saved.get(seq.state_slot, ())):
                state[seq.state_slot].copy_(row)

    def save_checkpoints(self, pairs: list[tuple[int, int]]) -> None:
        """Copy sequences' states into checkpoints: (state slot, checkpoint) pairs."""
        self._copy_states(self.states, self.checkpoint_states, pairs)

    def load_checkpoints(self, pairs: list[tuple[int, int]]) -> None:
        """Copy checkpoints into sequences' state slots: (checkpoint, state slot) pairs (a prefix hit's states)."""
        self._copy_states(self.checkpoint_states, self.states, pairs)

    def _copy_states(self, source: list[torch.Tensor], target: list[torch.Tensor], pairs: list[tuple[int, int]]):
        if not pairs:
            return
        src = torch.tensor([a for a, _ in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([b for _, b in pairs], dtype=torch.long, device=self.device)
        for s, t in zip(source, target, strict=True):
            t.index_copy_(0, dst, s.index_select(0, src))

    @property
    def state_bytes(self) -> int:
        """Bytes of one sequence's slot of the recurrent layers' states (0 without such layers)."""
        return sum(s[0].nbytes for s in self.states)

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes of the recurrent-state checkpoints prefix caching keeps (0 without such layers or checkpoints)."""
        return sum(c.nbytes for c in self.checkpoint_states)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the KV pool (k and v of every layer, the scratch block included)."""
        return sum(c.nbytes for c in self.k_caches) + sum(c.nbytes for c in self.v_caches)

    @property
    def kv_cache_format(self) -> str:
        """What the pool holds: float32, float16, bfloat16 or q8_0."""
        return kv_format_name(self.kv_dtype)

    @property
    def uses_cuda_graphs(self) -> bool:
        """Whether decode steps replay captured CUDA graphs."""
        return self.decode_graphs is not None and bool(self.decode_graphs.graphs)

    @property
    def failure(self) -> str | None:
        """Why this runner cannot run another step (a tensor-parallel rank is gone), None while it can."""
        return self.tp.failure

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        """Write the batch's k/v into the pool; the logits of `batch.sampling` (in that order) and the pooled
        hidden states of `batch.pool_rows`."""
        return self._lead(StepInputs.from_batch(batch))

    def score(self, seq: Sequence) -> torch.Tensor:
        """Logits after every token of `seq` (whose blocks are allocated, none computed): ``[num_tokens, vocab]``."""
        return self._lead(StepInputs.for_scoring(seq)).logits

    def follow(self) -> None:
        """Ranks > 0: run each step rank 0 broadcasts, until it stops them (`stop_followers`)."""
        while (step := self.steps.receive()) is not None:
            self._run(step)

    def stop_followers(self, timeout: float = 10.0) -> bool:
        """Rank 0: end the other ranks' `follow` loops after the step in flight, if it ends within `timeout`;
        whether the stop was sent (not with one rank, nor once a rank is gone). No step can run afterwards."""
        if self.steps is None or self.tp.failure is not None or not self._step_lock.acquire(timeout=timeout):
            return False
        try:
            self.steps.send_stop()
            return True
        finally:
            self.tp.failure = "the tensor-parallel workers were shut down"
            self._step_lock.release()

    def _lead(self, step: StepInputs) -> StepOutput:
        """Rank 0: hand `step` to the other ranks, then run it."""
        if self.steps is None:
            return self._run(step)
        with self._step_lock:
            if self.tp.failure is not None:
                raise RuntimeError(f"tensor parallelism is down: {self.tp.failure}")
            try:
                self.steps.send(step)
                return self._run(step)
            except BaseException as exc:  # the ranks are out of step (the others ran on into collectives alone)
                self.tp.failure = f"a step failed on rank 0 ({type(exc).__name__}: {exc}); the ranks are out of step"
                raise

    def _run(self, step: StepInputs) -> StepOutput:
        """The forward of one step on this rank: the static decode buffers for a decode step, else eagerly."""
        if step.decode and self.decode_graphs is not None and not step.loras:  # adapters: the eager forward
            return StepOutput(self._decode(step))
        token_ids, meta = self._prepare(step)
        return StepOutput(*self.model.forward_pooled(token_ids, meta, self.k_caches, self.v_caches, self.states))

    def _decode(self, step: StepInputs) -> torch.Tensor:
        bs = self.config.block_size
        positions = step.num_computed
        tables = step.block_tables
        return self.decode_graphs.run(
            step.token_ids,
            positions,
            [table[p // bs] * bs + p % bs for table, p in zip(tables, positions)],
            tables,
            self._state_slots(step),
        )

    def _state_slots(self, step: StepInputs) -> list[int]:
        """Each sequence's slot of the recurrent layers' states (the scratch slot for scoring); [] without them."""
        if not self.states:
            return []
        return [slot if slot >= 0 else self.scratch_state_slot
                for slot in step.state_slots or [-1] * len(step.num_new)]

    def _lora_groups(self, step: StepInputs, starts: list[int], logits_rows: list[int]) -> list[LoraGroup]:
        """The step's rows grouped by LoRA adapter (a row of a sequence with two adapters is in two groups), with
        their scales, and the same for the logits rows. KeyError naming an adapter that was unloaded."""
        out_of = {row: j for j, row in enumerate(logits_rows)}
        groups: dict[int, tuple[list, list, list, list]] = {}
        for i, pairs in enumerate(step.loras):
            for adapter_id, scale in pairs:
                rows, scales, out_rows, out_scales = groups.setdefault(adapter_id, ([], [], [], []))
                span = range(starts[i], starts[i + 1])
                rows.extend(span)
                scales.extend([scale] * len(span))
                out = [out_of[r] for r in span if r in out_of]
                out_rows.extend(out)
                out_scales.extend([scale] * len(out))
        device, adapters = self.device, self.model.adapters
        result = []
        for adapter_id, (rows, scales, out_rows, out_scales) in groups.items():
            adapter = adapters.get(adapter_id)
            if adapter is None:
                raise KeyError(f"LoRA adapter {adapter_id} is not loaded (it was unloaded)")
            result.append(LoraGroup(
                adapter, torch.tensor(rows, dtype=torch.long, device=device),
                torch.tensor(scales, dtype=torch.float32, device=device),
                torch.tensor(out_rows, dtype=torch.long, device=device),
                torch.tensor(out_scales, dtype=torch.float32, device=device)))
        return result

    def _prepare(self, step: StepInputs) -> tuple[torch.Tensor, BatchMetadata]:
        """Token ids and metadata of a ragged batch; logits rows: each sampling sequence's last token (or every
        token with `every_row`)."""
        bs = self.config.block_size
        slots: list[int] = []
        positions: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        for first, n, table, samples in zip(step.num_computed, step.num_new, step.block_tables, step.samples):
            positions.extend(range(first, first + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(first, first + n))
            starts.append(starts[-1] + n)
            seq_lens.append(first + n)
            if samples and not step.every_row:  # the last token, then any draft tokens after it
                logits_rows.extend(range(starts[-1] - samples, starts[-1]))
        if step.every_row:
            logits_rows = list(range(starts[-1]))
        pool_indices: list[int] = []
        pool_segments: list[int] = []  # which pooled row each index adds to: one per entry, one per row for "each"
        for i, rows in step.pool_rows:
            span = range(starts[i], starts[i + 1]) if rows in ("all", "each") else \
                [starts[i + 1] - 1] if rows == "last" else [starts[i]]
            pool = pool_segments[-1] + 1 if pool_segments else 0
            pool_indices.extend(span)
            pool_segments.extend(range(pool, pool + len(span)) if rows == "each" else [pool] * len(span))
        width = max(len(table) for table in step.block_tables)
        tables = [table + [0] * (width - len(table)) for table in step.block_tables]
        device = self.device
        meta = BatchMetadata(
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            logits_indices=torch.tensor(logits_rows, dtype=torch.long, device=device),
            max_query_len=max(step.num_new),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
        )
        if self.states:
            meta.state_slots = torch.tensor(self._state_slots(step), dtype=torch.long, device=device)
        if step.pool_rows:
            meta.pool_indices = torch.tensor(pool_indices, dtype=torch.long, device=device)
            meta.pool_segments = torch.tensor(pool_segments, dtype=torch.long, device=device)
            meta.num_pools = pool_segments[-1] + 1
        if step.embeds:
            rows = [r for first, values in step.embeds for r in range(first, first + values.shape[0])]
            meta.input_embeds = (torch.tensor(rows, dtype=torch.long, device=device),
                                 torch.cat([values for _, values in step.embeds]).to(device))
        if step.image_rows:
            meta.image_attention = self._image_attention(step, positions, slots, tables)
        if step.rope_positions:  # M-RoPE (Qwen2-VL with an image): each row's angles from its three positions
            meta.rope_table = self._mrope_table(step)
            meta.rope_index = torch.arange(meta.rope_table.shape[0], device=device)
        # per-step tensors the ops read (rotary rows, decode context slots), derived here once, not per layer
        meta = self.model.ops.prepare_step(meta, self.model.cos_sin, bs)
        if step.loras:
            meta.lora = self._lora_groups(step, starts, logits_rows)
        return torch.tensor(step.token_ids, dtype=torch.long, device=device), meta

    def _mrope_table(self, step: StepInputs) -> torch.Tensor:
        """Each row's cos|sin row ``[T, R]`` for a step's M-RoPE positions: each frequency of the head turns by the
        position on its axis (`rope_sections`: how many frequencies time, rows and columns take; in runs, or
        interleaved for Qwen3-VL)."""
        c, table = self.model.config, self.model.cos_sin  # [max_pos, R]: cos of each frequency | sin of each
        positions = torch.tensor(step.rope_positions, dtype=torch.long, device=table.device)  # [3, T]
        return mrope_rows(table, positions, mrope_axes(c.rope_sections, c.mrope_interleaved))

    def _image_attention(self, step: StepInputs, positions: list[int], slots: list[int],
                         tables: list[list[int]]) -> tuple[torch.Tensor, BatchMetadata]:
        """The rows of this step's images and the metadata that lets each attend to its whole image: one query per
        row over its sequence's context up to the image's end (a decode-shaped batch, which every backend's
        attention takes; Gemma 3's image tokens see each other both ways, as transformers' token_type_ids mask and
        llama.cpp's non-causal image batch have it)."""
        rows: list[int] = []
        ends: list[int] = []
        seq_of: list[int] = []
        for i, first, n, end in step.image_rows:
            rows.extend(range(first, first + n))
            ends.extend([end] * n)
            seq_of.extend([i] * n)
        device = self.device
        meta = BatchMetadata(
            positions=torch.tensor([positions[r] for r in rows], dtype=torch.long, device=device),
            slot_mapping=torch.tensor([slots[r] for r in rows], dtype=torch.long, device=device),
            query_start_loc=torch.arange(len(rows) + 1, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(ends, dtype=torch.int32, device=device),
            block_tables=torch.tensor([tables[i] for i in seq_of], dtype=torch.int32, device=device),
            logits_indices=torch.empty(0, dtype=torch.long, device=device),
            max_query_len=1,
            max_seq_len=max(ends),
            query_start_loc_cpu=list(range(len(rows) + 1)),
            seq_lens_cpu=ends,
        )
        meta = self.model.ops.prepare_step(meta, self.model.cos_sin, self.config.block_size)
        return torch.tensor(rows, dtype=torch.long, device=device), meta
