"""The step loop: schedule -> model runner (one batched forward) -> sample -> detokenize -> deltas."""

from __future__ import annotations

import dataclasses
import logging

import torch

from gpullama.checks import RequestError
from gpullama.engine.admission import AdmissionLimits, check_embedding_request, check_images, check_request
from gpullama.engine.args import EngineConfig
from gpullama.engine.block_manager import BlockManager
from gpullama.engine.detokenizer import Detokenizer
from gpullama.engine.model_runner import ModelRunner
from gpullama.engine.ngram_proposer import NgramProposer, TokenBuffer
from gpullama.engine.sampler import needs_penalties, sample_batch, verify_drafts
from gpullama.engine.scheduler import ScheduledBatch, Scheduler
from gpullama.engine.sequence import Sequence
from gpullama.engine.state_checkpoints import LATEST_KEPT, StateCheckpoints, last_prompt_boundary
from gpullama.engine.stats import EngineStats
from gpullama.engine.structured_output import StructuredOutputManager
from gpullama.model import Decoder
from gpullama.outputs import StreamDelta, TokenLogprob, TopLogprob
from gpullama.pooling_params import RANK, PoolingParams
from gpullama.sampling_params import SamplingParams
from gpullama.vision import ImageSpan

log = logging.getLogger("gpullama")
GRAMMAR_WAIT_S = 0.05  # longest idle wait for a compiling grammar before the step loop looks at its commands again


class LLMEngine:
    """The scheduler, the model runner and the per-request state; `step()` advances every running request."""

    def __init__(self, model: Decoder, tokenizer, config: EngineConfig):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        if model.config.has_recurrent_state and config.speculative is not None:
            raise ValueError(f"speculative decoding is not supported for {model.config.architecture}: its recurrent "
                             f"layers' state cannot be rolled back past rejected draft tokens")
        self.runner = ModelRunner(model, config)
        self.detokenizer = Detokenizer(tokenizer)
        # a prefix hit skips the tokens a recurrent layer's state is made of: it is restored from a checkpoint
        # saved at a block boundary (`state_checkpoints`), and without any the prefix cache is off
        prefix_caching = config.enable_prefix_caching
        self.state_checkpoints = None
        if prefix_caching and model.config.has_recurrent_state:
            if self.runner.num_checkpoints:
                self.state_checkpoints = StateCheckpoints(self.runner.num_checkpoints)
            else:
                prefix_caching = False
                log.info("prefix caching is off: %s keeps a recurrent state and state_checkpoints is 0",
                         model.config.architecture)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, prefix_caching,
                                          self.state_checkpoints)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.limits = AdmissionLimits(model.config.vocab_size, config.max_model_len, self.kv_capacity_tokens,
                                      model.config.hidden_size, model.config.pooling_type,
                                      model.config.pooling_type == RANK and model.rank_head is not None,
                                      model.config.input_embedding_size)
        self.requests: dict[str, Sequence] = {}
        self._aborted: list[StreamDelta] = []  # last deltas of aborted requests, delivered by the next step
        self.eos_token_ids = set(tokenizer.eos_token_ids)
        self.stats = EngineStats()  # token counters for the status line
        self.structured_output = StructuredOutputManager(tokenizer, model.config.vocab_size, model.ops.device)
        self.proposer = NgramProposer(config.speculative) if config.speculative is not None else None
        self._next_lora_id = max(model.adapters, default=-1) + 1

    @property
    def kv_capacity_tokens(self) -> int:
        """How many tokens the KV pool holds."""
        return self.runner.num_blocks * self.config.block_size

    # -- requests --------------------------------------------------------------------------------
    def admit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
              images: list[ImageSpan] | None = None) -> Sequence:
        """Check a request once (see `gpullama.engine.admission`) and build its sequence, without queueing it.
        Reads only fixed limits, so any thread may call it; raises RequestError (a ValueError) naming the field.
        `images`: embeddings in place of prompt tokens (`gpullama.vision.ImageSpan`)."""
        max_tokens = check_request(prompt_token_ids, params, self.limits)
        if images:
            check_images(images, len(prompt_token_ids), self.limits, self.config.max_num_batched_tokens)
        seq = Sequence(request_id, prompt_token_ids, params, max_tokens, images=images)
        if params.lora:
            seq.lora = self._lora_of(params.lora)
        if params.structured_output is not None:  # compiles off this thread while the prompt waits and prefills
            seq.grammar = self.structured_output.submit(params.structured_output)
        return seq

    def _lora_of(self, pairs: list[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
        """A request's LoRA adapters as the sequence keeps them: each loaded id once (the last scale given), zero
        scales left out, sorted by id; RequestError (param "lora") naming an id that is not loaded."""
        chosen: dict[int, float] = {}
        for adapter_id, scale in pairs:
            if adapter_id not in self.model.adapters:
                loaded = ", ".join(str(i) for i in sorted(self.model.adapters)) or "none"
                raise RequestError(f"LoRA adapter id {adapter_id} is not loaded (loaded ids: {loaded})", "lora")
            chosen[adapter_id] = float(scale)
        return tuple(sorted((i, s) for i, s in chosen.items() if s != 0))

    def add_lora(self, adapter) -> int:
        """Make a prepared adapter (`gpullama.lora.Adapter`, of this engine's model) available to requests; its id
        (never reused after `remove_lora`)."""
        adapter_id = self._next_lora_id
        self._next_lora_id += 1
        self.model.adapters[adapter_id] = adapter
        return adapter_id

    def remove_lora(self, adapter_id: int) -> None:
        """Unload adapter `adapter_id`; ValueError while a request that uses it is queued or running (abort it, or
        wait for it to finish), KeyError when no such adapter is loaded."""
        if adapter_id not in self.model.adapters:
            raise KeyError(f"LoRA adapter {adapter_id} is not loaded")
        users = [rid for rid, seq in list(self.requests.items()) if any(i == adapter_id for i, _ in seq.lora)]
        if users:
            raise ValueError(f"LoRA adapter {adapter_id} is in use by {len(users)} request(s), e.g. {users[0]!r}")
        del self.model.adapters[adapter_id]

    def admit_embedding(self, request_id: str, prompt_token_ids: list[int],
                        pooling: PoolingParams | None = None,
                        lora: list[tuple[int, float]] | None = None) -> Sequence:
        """Check an embedding request (`gpullama.engine.admission.check_embedding_request`) and build its sequence:
        prefill only, pooled as `pooling.kind` says (None: the model's pooling type), its KV blocks not kept, under
        the LoRA adapters `lora` ((id, scale) pairs, as `SamplingParams.lora`); queue it with `add`. A reranker's
        request (kind `RANK`) ends with the classification head's outputs as its embedding, the first being its
        score."""
        pooling = pooling or PoolingParams()
        model_kind = self.limits.pooling_type
        # a reranker's own pooling gives scores, not an embedding: only a request that asks for RANK gets them
        pooling = dataclasses.replace(pooling, kind=pooling.kind or (None if model_kind == RANK else model_kind))
        check_embedding_request(prompt_token_ids, pooling, self.limits)
        seq = Sequence(request_id, prompt_token_ids, SamplingParams(max_tokens=1), 0, pooling=pooling)
        if lora:
            seq.lora = self._lora_of(lora)
        return seq

    def add(self, seq: Sequence) -> None:
        """Queue an admitted sequence; it joins the batch at the next step with room."""
        if seq.request_id in self.requests:
            raise ValueError(f"request id {seq.request_id!r} is already running")
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Sequence:
        """Admit and queue a request; raises ValueError when it can never run."""
        seq = self.admit(request_id, prompt_token_ids, params)
        self.add(seq)
        return seq

    def abort(self, request_id: str, notify: bool = True) -> None:
        """Drop a request now: its blocks are freed; with `notify` the next step delivers its last delta (finish
        reason "abort"), without it the request just ends (its caller already told whoever was listening)."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return
        self.scheduler.finish(seq, "abort")
        if notify:
            self._aborted.append(self._delta(seq, "", [], "abort"))

    def has_work(self) -> bool:
        """True while any request waits, runs or has a delta to deliver."""
        return self.scheduler.has_work() or bool(self._aborted)

    # -- one step ----------------------------------------------------------------------------------
    def step(self) -> list[StreamDelta]:
        """Run one batched forward for the scheduled tokens and return each request's delta.

        If the step fails, only the request that caused it fails: its rows are found by running the step's halves
        again (their k/v are rewritten with the same values, the seeded generators are rewound), the request gets
        a last delta with finish reason "error", and every other request goes on with the tokens it would have had.
        """
        deltas, self._aborted = self._aborted, []
        batch = self.scheduler.schedule()
        self.runner.load_checkpoints(batch.state_loads)  # the states of this step's prefix hits, before any save
        if not batch:
            if self.scheduler.running or self.scheduler.waiting:  # only grammars being compiled hold them back
                self.structured_output.wait(self.scheduler.running + list(self.scheduler.waiting), GRAMMAR_WAIT_S)
            return deltas
        self.stats.observe(batch)
        prefilling = [seq for seq in batch.seqs if seq.params.return_progress and seq.pooling is None
                      and not seq.num_output_tokens and seq.num_computed_tokens < seq.num_prompt_tokens]
        deltas += [self._progress(seq) for seq in prefilling if seq.num_computed_tokens == seq.num_cached_tokens]
        sampled, failed, pooled = self._run_isolated(batch)
        for seq, n, drafts in zip(batch.seqs, batch.num_new_tokens, batch.drafts):
            if seq not in failed:
                old = seq.num_computed_tokens
                seq.num_computed_tokens += n - len(drafts)  # accepted drafts count once they are appended
                if seq.pooling is None:  # an embedding's blocks are not kept for the prefix cache
                    self.block_manager.commit_full_blocks(seq, old)
        self._save_checkpoints(batch, failed)
        deltas += [self._progress(seq) for seq in prefilling if seq not in failed]
        for seq in batch.pooling:
            if seq in failed:
                continue
            if seq in pooled:  # summed over the steps; per token (pooling none): one row more for each token
                part = pooled[seq]
                seq.pooled = part if seq.pooled is None else torch.cat([seq.pooled, part]) \
                    if seq.pooling.kind == "none" else seq.pooled + part
            if seq.num_computed_tokens == seq.num_tokens:
                deltas.append(self._finish_embedding(seq))
        drafts_of = {seq: drafts for seq, drafts in zip(batch.seqs, batch.drafts) if drafts}
        for seq in batch.sampling:
            if seq in failed:
                continue
            tokens, logprobs = sampled[seq]
            drafts = drafts_of.get(seq)
            try:
                delta = self._advance(seq, tokens, logprobs)
                deltas.append(delta)
                if drafts is not None:
                    self.stats.observe_drafts(len(drafts), len(tokens) - 1, len(delta.token_ids))
                    self._settle_drafts(seq, len(tokens) - 1)
                if self.proposer is not None and not seq.is_finished:
                    self._propose(seq)
            except Exception as exc:  # noqa: BLE001 - this request alone fails (detokenizer, logprobs)
                log.exception("request %s failed after its token was sampled", seq.request_id)
                failed[seq] = exc
        for seq, exc in failed.items():
            deltas.append(self._fail(seq, exc))
        return deltas

    def _save_checkpoints(self, batch: ScheduledBatch, failed: dict) -> None:
        """Save the recurrent states of the sequences whose computed tokens just reached a block boundary (after
        the step's blocks are committed): the last one inside the prompt (kept), or one past it (each sequence
        keeps only its latest `LATEST_KEPT` such checkpoints, from which a chat's next turn continues)."""
        checkpoints = self.state_checkpoints
        if checkpoints is None:
            return
        bs = self.config.block_size
        sources: dict[int, int] = {}  # checkpoint -> state slot; a checkpoint taken again in this loop: the last one
        for seq in batch.seqs:
            done = seq.num_computed_tokens
            prompt_boundary = last_prompt_boundary(seq.num_prompt_tokens, bs)
            if seq in failed or seq.pooling is not None or not done or done % bs or done < prompt_boundary:
                continue
            block_hash = self.block_manager.blocks[seq.block_table[done // bs - 1]].hash
            assert block_hash is not None  # a full block the step committed
            if done > prompt_boundary and block_hash not in seq.state_checkpoints:
                seq.state_checkpoints.append(block_hash)
                if len(seq.state_checkpoints) > LATEST_KEPT:
                    checkpoints.drop(seq.state_checkpoints.pop(0))
            slot = checkpoints.reserve(block_hash)
            if slot is not None:
                sources[slot] = seq.state_slot
        self.runner.save_checkpoints([(state_slot, slot) for slot, state_slot in sources.items()])

    def _forward_and_sample(self, batch: ScheduledBatch):
        """One forward over `batch`, then the next tokens (and log-probabilities when asked) of each sampling
        sequence: one token, its grammar's mask applied first; or, for a sequence with drafts, the drafts it
        accepts and one more (`verify_drafts`). Changes nothing but the rows' k/v and their generators. Returns
        (sampled sequences: (tokens, their logprob rows or None), the sequences whose grammar failed to compile
        (not sampled: that request alone fails), the pooled hidden states of the embedding sequences that have rows
        in this step)."""
        out = self.runner.execute(batch)
        pooled, row = {}, 0
        for (i, _), count in zip(batch.pool_rows, batch.pool_counts):  # each entry's rows of `out.pooled`
            pooled[batch.seqs[i]] = out.pooled[row] if count is None else out.pooled[row : row + count]
            row += 1 if count is None else count
        if not batch.sampling:
            return {}, {}, pooled
        logits = out.logits
        drafts_of = {seq: drafts for seq, drafts in zip(batch.seqs, batch.drafts) if drafts}
        plain, plain_rows, checked, row = [], [], [], 0
        for seq in batch.sampling:  # logits rows: each sequence's last token, then its drafts
            drafts = drafts_of.get(seq, [])
            if drafts:
                checked.append((seq, row, drafts))
            else:
                plain.append(seq)
                plain_rows.append(row)
            row += 1 + len(drafts)
        assert row == logits.shape[0]
        logits_plain = logits[plain_rows] if checked else logits
        sampled, failed = {}, {}
        if plain:
            failed = self.structured_output.mask(logits_plain, plain)  # constrained rows only, in place
            tokens, logprobs = sample_batch(logits_plain, plain, self.model.ops)
            sampled = {seq: ([token], logprobs[i : i + 1] if logprobs is not None else None)
                       for i, (seq, token) in enumerate(zip(plain, tokens)) if i not in failed}
        for seq, first, drafts in checked:
            sampled[seq] = verify_drafts(logits[first : first + 1 + len(drafts)], drafts, seq, self.model.ops)
        return sampled, {plain[i]: exc for i, exc in failed.items()}, pooled

    def _run_isolated(self, batch: ScheduledBatch):
        """`_forward_and_sample` over the batch; when it raises, over halves of it, down to the rows at fault.
        Returns (sampled rows, {failed sequence: exception}, pooled rows). A re-run starts from the same state: the
        same generators, and the recurrent layers' states of its rows as they were before the step (copied only for
        a step of several requests: a step of one is never run again, and a hybrid model's states are megabytes a
        sequence, as much memory traffic a step as a fifth of a 350M model's weights)."""
        rng = {seq: seq.generator.get_state() for seq in batch.sampling if seq.generator is not None}
        states = self.runner.save_states(batch.seqs) if len(batch) > 1 else {}
        try:
            return self._forward_and_sample(batch)
        except Exception as exc:  # noqa: BLE001 - isolated below
            if len(batch) == 1:
                log.error("step failed for request %s: %s: %s", batch.seqs[0].request_id, type(exc).__name__, exc,
                          exc_info=exc)
                return {}, {batch.seqs[0]: exc}, {}
            log.warning("a step of %d requests failed (%s: %s); running its rows again to find the request at fault",
                        len(batch), type(exc).__name__, exc)
        sampled: dict[Sequence, tuple[list[int], torch.Tensor | None]] = {}
        failed: dict[Sequence, Exception] = {}
        pooled: dict[Sequence, torch.Tensor] = {}
        pending = [list(range(len(batch)))]
        while pending:
            rows = pending.pop()
            part = ScheduledBatch()
            for i in rows:
                drafts = batch.drafts[i]
                part.add(batch.seqs[i], batch.num_new_tokens[i] - len(drafts), drafts)
            for seq in part.sampling:
                if seq in rng:
                    seq.generator.set_state(rng[seq])  # the same draws as in the full step
            self.runner.restore_states(states, [batch.seqs[i] for i in rows])
            try:
                part_sampled, part_failed, part_pooled = self._forward_and_sample(part)
                sampled.update(part_sampled)
                failed.update(part_failed)
                pooled.update(part_pooled)
            except Exception as exc:  # noqa: BLE001 - narrowed further, or this row's request fails
                if len(rows) == 1:
                    log.error("step failed for request %s: %s: %s", part.seqs[0].request_id, type(exc).__name__, exc,
                              exc_info=exc)
                    failed[part.seqs[0]] = exc
                else:
                    half = len(rows) // 2
                    pending += [rows[half:], rows[:half]]
        return sampled, failed, pooled

    def _fail(self, seq: Sequence, exc: BaseException) -> StreamDelta:
        """End one request whose step failed (or whose grammar did not compile): free its blocks; its last delta
        has finish reason "error" and the exception; the others go on."""
        self.requests.pop(seq.request_id, None)
        self.scheduler.finish(seq, "error")
        seq.error = exc
        delta = self._delta(seq, "", [], "error")
        delta.error = exc
        return delta

    def _finish_embedding(self, seq: Sequence) -> StreamDelta:
        """An embedding request whose whole prompt is computed: its pooled vector (mean: the sum over its tokens
        divided by their count), cut to `dimensions`, L2-normalised when asked; or, pooled by none, one vector per
        token, as computed; or, pooled by rank, the reranker head's outputs; it leaves the engine."""
        pooling = seq.pooling
        vector = seq.pooled.float().cpu()
        if pooling.kind == RANK:  # a reranker: its head's outputs (the first is the score)
            return self._end_embedding(seq, self.model.rank_head(vector).tolist())
        if pooling.kind == "none":
            return self._end_embedding(seq, (vector[:, : pooling.dimensions] if pooling.dimensions else vector).tolist())
        if pooling.kind == "mean":
            vector = vector / seq.num_tokens
        if pooling.dimensions is not None:
            vector = vector[: pooling.dimensions]
        if pooling.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return self._end_embedding(seq, vector.tolist())

    def _end_embedding(self, seq: Sequence, embedding: list) -> StreamDelta:
        seq.embedding = embedding
        seq.pooled = None
        self.scheduler.finish(seq, "stop")
        self.requests.pop(seq.request_id, None)
        delta = self._delta(seq, "", [], "stop")
        delta.embedding = seq.embedding
        return delta

    def _advance(self, seq: Sequence, tokens: list[int], logprobs: torch.Tensor | None) -> StreamDelta:
        """Append the step's tokens one by one (one, or accepted drafts and one more), checking the finish
        conditions after each as plain decoding would (tokens after the one that finishes are dropped), and
        produce the request's delta. `logprobs` holds one log-softmax row per token, or is None."""
        p = seq.params
        texts: list[str] = []
        entries = [] if logprobs is not None and p.logprobs is not None else None
        reason = None
        emitted: list[int] = []
        for i, token in enumerate(tokens):
            seq.append_token(token)
            emitted.append(token)
            if entries is not None:
                entry = self._logprob_entry(token, logprobs[i], p.logprobs)
                entries.append(entry)
                seq.logprobs.append(entry)
            stop_token = (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids
            if token in p.stop_token_ids:
                seq.stop_reason = token
            if seq.grammar is not None:
                terminated = self.structured_output.accept(seq, token)
                if terminated is None:
                    return self._fail(seq, RuntimeError(f"token {token} was sampled against the grammar"))
                stop_token = stop_token or terminated  # a grammar terminates on an end-of-sequence token
            if stop_token:
                reason = "stop"
            elif seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.config.max_model_len:
                reason = "length"
            text, stopped = self.detokenizer.update(seq, finishing=reason is not None, drop_last=stop_token)
            texts.append(text)
            if stopped:
                reason = "stop"
            if reason is not None:
                self.scheduler.finish(seq, reason)
                self.requests.pop(seq.request_id, None)
                break
        return self._delta(seq, "".join(texts), emitted, reason, entries)

    def _settle_drafts(self, seq: Sequence, accepted: int) -> None:
        """After a step that checked a sequence's drafts: count the `accepted` ones, whose k/v are now valid, as
        computed, and give back the blocks that only the rejected ones needed (their k/v are overwritten later)."""
        if seq.is_finished:
            return
        old = seq.num_computed_tokens
        seq.num_computed_tokens += accepted
        assert seq.num_computed_tokens == seq.num_tokens - 1
        self.block_manager.commit_full_blocks(seq, old)
        self.block_manager.trim(seq, seq.num_tokens)

    def _propose(self, seq: Sequence) -> None:
        """Draft tokens for a running sequence's next step (n-gram lookup), within its max_tokens and the context.
        Sequences with a grammar, penalties or logit bias decode one token a step."""
        if seq.grammar is not None or seq.pooling is not None or needs_penalties(seq):
            return
        room = min(seq.max_tokens - seq.num_output_tokens, self.config.max_model_len - seq.num_tokens) - 1
        if seq.ngram_tokens is None:
            seq.ngram_tokens = TokenBuffer()
        seq.spec_token_ids = self.proposer.propose(seq.ngram_tokens.view(seq.token_ids), room)

    def _logprob_entry(self, token: int, logprobs: torch.Tensor, top_n: int) -> TokenLogprob:
        tok = self.tokenizer
        top = []
        if top_n > 0:
            values, ids = torch.topk(logprobs, top_n)
            top = [TopLogprob(int(i), tok.token_to_str(int(i)), float(v)) for v, i in zip(values, ids)]
        return TokenLogprob(token, tok.token_to_str(token), float(logprobs[token]), top)

    def _progress(self, seq: Sequence) -> StreamDelta:
        """A progress delta of a prefilling request (`SamplingParams.return_progress`): its prompt tokens processed
        so far; before its first chunk, its prefix-cache hits."""
        delta = self._delta(seq, "", [], None)
        delta.num_computed_prompt_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
        return delta

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
            stop_reason=seq.stop_reason if reason == "stop" else None,
        )

    # -- scoring -------------------------------------------------------------------------------------
    def score(self, token_ids: list[int], lora: list[tuple[int, float]] | None = None,
              images: list[ImageSpan] | None = None) -> torch.Tensor:
        """Next-token logits of every position of `token_ids` from one forward pass, float32 ``[n, vocab]`` (with
        the LoRA adapters `lora`, (id, scale) pairs, as `SamplingParams.lora`; `images` in place of some tokens)."""
        if self.scheduler.has_work():
            raise RuntimeError("score() needs an idle engine")
        seq = self.admit("__score__", token_ids, SamplingParams(max_tokens=1, lora=lora), images=images)
        if not self.block_manager.allocate(seq, len(token_ids), use_prefix_cache=False):
            raise ValueError(f"{len(token_ids)} tokens do not fit the KV pool ({self.kv_capacity_tokens} tokens)")
        try:
            return self.runner.score(seq).float()
        finally:
            self.block_manager.free_sequence(seq)
