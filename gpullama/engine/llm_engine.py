"""The step loop: schedule -> one batched forward -> sample -> detokenize -> deltas."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from gpullama.engine.block_manager import BlockManager
from gpullama.engine.detokenizer import Detokenizer
from gpullama.engine.sampler import sample_batch
from gpullama.engine.scheduler import Scheduler
from gpullama.engine.sequence import Sequence
from gpullama.model import Decoder
from gpullama.ops import BatchMetadata
from gpullama.plan import StepPlan
from gpullama.outputs import StreamDelta, TokenLogprob, TopLogprob
from gpullama.sampling_params import SamplingParams

log = logging.getLogger("gpullama")


@dataclass
class EngineConfig:
    """Limits of the engine: context, batch, token budget and KV pool."""

    max_model_len: int
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    use_cuda_graphs: bool = True  # capture decode steps as CUDA graphs (CUDA with the Triton ops only)
    static_decode: bool = False  # run decode on the plan's padded static buffers even without graphs


class LLMEngine:
    """Owns the KV pool, the scheduler and the per-request state; `step()` advances every running request."""

    def __init__(self, model: Decoder, tokenizer, config: EngineConfig, kv_dtype: torch.dtype):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.detokenizer = Detokenizer(tokenizer)
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        mc = model.config
        # one block past the managed ones: the scratch block that padded decode rows write into
        shape = (config.num_blocks + 1, config.block_size, mc.num_kv_heads, mc.head_dim)
        device = model.ops.device
        self.k_caches = [torch.zeros(shape, dtype=kv_dtype, device=device) for _ in range(mc.num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=kv_dtype, device=device) for _ in range(mc.num_layers)]
        use_graphs = config.use_cuda_graphs and device.type == "cuda" and model.ops.name == "triton"
        self.plan = StepPlan(
            model,
            self.k_caches,
            self.v_caches,
            max_num_seqs=config.max_num_seqs,
            max_blocks_per_seq=-(-config.max_model_len // config.block_size),
            scratch_block=config.num_blocks,
            use_static_decode=config.static_decode,
            use_graphs=use_graphs,
        )
        self.requests: dict[str, Sequence] = {}
        self.pending: list[StreamDelta] = []  # deltas of aborted requests, sent with the next step
        self.eos_token_ids = set(tokenizer.eos_token_ids)

    @property
    def kv_capacity_tokens(self) -> int:
        """How many tokens the KV pool holds."""
        return self.config.num_blocks * self.config.block_size

    # -- requests --------------------------------------------------------------------------------
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Validate a request against the context and the pool; returns its resolved max_tokens.
        Raises ValueError naming the limit and both numbers when it can never fit."""
        n = len(prompt_token_ids)
        limit = self.config.max_model_len
        if n == 0:
            raise ValueError("the prompt is empty: it needs at least one token")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is out of range: the vocabulary has {vocab} tokens")
        if n >= limit:
            raise ValueError(
                f"the prompt has {n} tokens but the context length is {limit}: at most {limit - 1} prompt tokens"
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - n
        if n + max_tokens > limit:
            raise ValueError(
                f"the prompt has {n} tokens and max_tokens is {max_tokens}: together {n + max_tokens}, "
                f"more than the context length {limit}"
            )
        if self.block_manager.blocks_needed(n + max_tokens) > self.config.num_blocks:
            raise ValueError(
                f"the request needs up to {n + max_tokens} tokens of KV cache but the pool holds "
                f"{self.kv_capacity_tokens}"
            )
        return max_tokens

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Sequence:
        """Validate and queue a request; raises ValueError when it can never fit."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        max_tokens = self.check_request(prompt_token_ids, params)
        seq = Sequence(request_id, prompt_token_ids, params, max_tokens)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> None:
        """Drop a request now: its blocks are freed and its stream ends with finish_reason "abort"."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return
        self.scheduler.finish(seq, "abort")
        self.pending.append(self._delta(seq, "", [], "abort"))

    def has_work(self) -> bool:
        """True while any request waits, runs or has a delta to deliver."""
        return self.scheduler.has_work() or bool(self.pending)

    # -- one step ----------------------------------------------------------------------------------
    def step(self) -> list[StreamDelta]:
        """Run one batched forward for the scheduled tokens and return each request's delta."""
        deltas, self.pending = self.pending, []
        batch = self.scheduler.schedule()
        if not batch:
            return deltas
        token_ids, meta, sampling = self._prepare(batch)
        logits = self.plan.run(token_ids, meta)
        for seq, n in batch:
            old = seq.num_computed_tokens
            seq.num_computed_tokens += n
            self.block_manager.commit_full_blocks(seq, old)
        if sampling:
            tokens, logprobs = sample_batch(logits, sampling, self.model.ops)
            for row, (seq, token) in enumerate(zip(sampling, tokens)):
                deltas.append(self._advance(seq, token, logprobs[row] if logprobs is not None else None))
        return deltas

    def _prepare(self, batch: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, BatchMetadata, list[Sequence]]:
        bs = self.config.block_size
        ids: list[int] = []
        slots: list[int] = []
        positions: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        sampling: list[Sequence] = []
        for seq, n in batch:
            first = seq.num_computed_tokens
            ids.extend(seq.token_ids[first : first + n])
            positions.extend(range(first, first + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(first, first + n))
            starts.append(starts[-1] + n)
            seq_lens.append(first + n)
            if first + n == seq.num_tokens:
                logits_rows.append(starts[-1] - 1)
                sampling.append(seq)
        width = max(len(seq.block_table) for seq, _ in batch)
        tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq, _ in batch]
        device = self.model.ops.device
        meta = BatchMetadata(
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            logits_indices=torch.tensor(logits_rows, dtype=torch.long, device=device),
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
            max_query_len=max(n for _, n in batch),
        )
        return torch.tensor(ids, dtype=torch.long, device=device), meta, sampling

    def _advance(self, seq: Sequence, token: int, logprobs: torch.Tensor | None) -> StreamDelta:
        """Append a sampled token, check the finish conditions and produce the request's delta."""
        seq.append_token(token)
        entries = None
        if logprobs is not None and seq.params.logprobs is not None:
            entries = [self._logprob_entry(token, logprobs, seq.params.logprobs)]
            seq.logprobs.extend(entries)
        p = seq.params
        reason = None
        stop_token = (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids
        if stop_token:
            reason = "stop"
        elif seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.config.max_model_len:
            reason = "length"
        text, stopped = self.detokenizer.update(seq, finishing=reason is not None, drop_last=stop_token)
        if stopped:
            reason = "stop"
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self.requests.pop(seq.request_id, None)
        return self._delta(seq, text, [token], reason, entries)

    def _logprob_entry(self, token: int, logprobs: torch.Tensor, top_n: int) -> TokenLogprob:
        tok = self.tokenizer
        top = []
        if top_n > 0:
            values, ids = torch.topk(logprobs, top_n)
            top = [TopLogprob(int(i), tok.token_to_str(int(i)), float(v)) for v, i in zip(values, ids)]
        return TokenLogprob(token, tok.token_to_str(token), float(logprobs[token]), top)

    def _delta(self, seq: Sequence, text: str, token_ids: list[int], reason: str | None, logprobs=None) -> StreamDelta:
        return StreamDelta(
            request_id=seq.request_id,
            text=text,
            token_ids=token_ids,
            finish_reason=reason,
            logprobs=logprobs,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_generated_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
        )

    # -- scoring -------------------------------------------------------------------------------------
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Next-token logits of every position of `token_ids` from one forward pass, float32 ``[n, vocab]``."""
        if self.scheduler.has_work():
            raise RuntimeError("score() needs an idle engine")
        params = SamplingParams(max_tokens=1)
        seq = Sequence("__score__", token_ids, params, self.check_request(token_ids, params))
        try:
            if not self.block_manager.allocate(seq, len(token_ids), use_prefix_cache=False):
                raise ValueError(f"{len(token_ids)} tokens do not fit the KV pool ({self.kv_capacity_tokens} tokens)")
            ids, meta, _ = self._prepare([(seq, len(token_ids))])
            meta.logits_indices = torch.arange(len(token_ids), device=ids.device)
            return self.model.forward(ids, meta, self.k_caches, self.v_caches).float()
        finally:
            self.block_manager.free_sequence(seq)
