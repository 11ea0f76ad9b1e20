"""`gpullama.LLM`: load a GGUF model and generate, chat, stream or score through the batching engine."""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from gpullama.engine.llm_engine import EngineConfig, LLMEngine
from gpullama.gguf_file import read_gguf
from gpullama.hub import ALIASES, resolve_model
from gpullama.model import Decoder
from gpullama.ops import select_ops
from gpullama.outputs import Completion
from gpullama.sampling_params import SamplingParams
from gpullama.tokenizer import Tokenizer

log = logging.getLogger("gpullama")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_CACHE_BYTES = 1 << 30  # default KV pool on the CPU
GPU_MEMORY_FRACTION = 0.85  # share of free GPU memory the KV pool may take after the weights


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` picks CUDA when present, else the CPU; otherwise ``"cpu"``, ``"cuda"`` or ``"cuda:N"``."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = str(device)
    kind, _, index = name.partition(":")
    if kind not in ("cpu", "cuda") or (index and not (kind == "cuda" and index.isdigit())):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got {name!r}")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA device is available")
    return device


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``"auto"``: bfloat16 on CUDA, float32 on the CPU (where a sequence then gives the same tokens alone or
    batched; bfloat16 rounding of the activations lets near-ties flip with the batch)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


class LLM:
    """A loaded model with its tokenizer and engine: ``LLM("smollm2-135m").generate("Hello")``."""

    def __init__(
        self,
        model: str | os.PathLike = "smollm2-135m",
        device: str | torch.device = "auto",
        max_model_len: int | None = None,
        dtype: str | torch.dtype = "auto",
        kv_cache_memory: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        enforce_eager: bool = False,
    ):
        started = time.perf_counter()
        self.model_name = str(model) if str(model) in ALIASES else Path(model).stem
        self.path = resolve_model(str(model))
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        gguf_model = read_gguf(self.path)
        self.config = gguf_model.config
        self.metadata = gguf_model.metadata
        if max_model_len is None:
            max_model_len = self.config.context_length
        if not isinstance(max_model_len, int) or max_model_len < 2:
            raise ValueError(f"max_model_len must be an integer >= 2, got {max_model_len!r}")
        if max_model_len > self.config.context_length:
            log.warning(
                "max_model_len %d is beyond the model's trained context length %d: output past it may degrade",
                max_model_len, self.config.context_length,
            )
        self.max_model_len = max_model_len
        self.tokenizer = Tokenizer.from_metadata(self.metadata)
        ops = select_ops(self.device, self.dtype)
        self.model = Decoder(self.config, gguf_model.tensors, ops, max_model_len)
        kv_dtype = torch.float32 if self.device.type == "cpu" else self.dtype
        num_blocks = self._num_kv_blocks(kv_cache_memory, kv_dtype, block_size, max_num_seqs)
        self.engine = LLMEngine(
            self.model,
            self.tokenizer,
            EngineConfig(
                max_model_len=max_model_len,
                num_blocks=num_blocks,
                block_size=block_size,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                enable_prefix_caching=enable_prefix_caching,
                use_cuda_graphs=not enforce_eager,
            ),
            kv_dtype,
        )
        self._lock = threading.Lock()
        self._ids = itertools.count()
        log.info(
            "loaded %s (%s, %d layers) on %s in %s (ops: %s) in %.1fs; KV cache: %d tokens in %d blocks of %d",
            self.model_name, self.config.architecture, self.config.num_layers, self.device,
            str(self.dtype).removeprefix("torch."), ops.name, time.perf_counter() - started,
            self.engine.kv_capacity_tokens, num_blocks, block_size,
        )

    def _num_kv_blocks(self, memory: int | None, kv_dtype: torch.dtype, block_size: int, max_num_seqs: int) -> int:
        c = self.config
        per_block = 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * kv_dtype.itemsize
        useful = max_num_seqs * -(-self.max_model_len // block_size)  # more than this can never be used
        if memory is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                memory = int(free * GPU_MEMORY_FRACTION)
            else:
                memory = CPU_KV_CACHE_BYTES
            num_blocks = min(memory // per_block, useful)
        else:
            num_blocks = memory // per_block
        needed = -(-self.max_model_len // block_size)
        if num_blocks < needed:
            raise ValueError(
                f"KV cache of {memory} bytes holds {num_blocks * block_size} tokens, fewer than max_model_len "
                f"{self.max_model_len}: give more kv_cache_memory or a smaller max_model_len"
            )
        return int(num_blocks)

    # -- helpers -------------------------------------------------------------------------------------
    def _encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def _encode_chat(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _run(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Run every prompt as one continuous batch until all finish."""
        with self._lock:
            engine = self.engine
            for ids in prompts:  # validate all before queueing any
                engine.check_request(ids, params)
            request_ids = [f"llm-{next(self._ids)}" for _ in prompts]
            seqs = [engine.add_request(rid, ids, params) for rid, ids in zip(request_ids, prompts)]
            try:
                while engine.has_work():
                    engine.step()
            finally:
                for rid in request_ids:
                    engine.abort(rid)
                engine.pending.clear()
        return [
            Completion(
                text=seq.text,
                token_ids=seq.output_token_ids,
                prompt_token_ids=seq.prompt_token_ids,
                finish_reason=seq.finish_reason,
                logprobs=seq.logprobs,
                num_cached_tokens=seq.num_cached_tokens,
            )
            for seq in seqs
        ]

    # -- public API ------------------------------------------------------------------------------------
    def generate(self, prompts: str | list[str], params: SamplingParams | None = None) -> list[Completion]:
        """Complete one prompt or many (run together as one continuous batch); one Completion per prompt."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run([self._encode_prompt(p) for p in prompts], params or SamplingParams())

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None) -> list[Completion]:
        """Answer one conversation (a list of {"role", "content"} dicts) or a list of them, via the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self._run([self._encode_chat(m) for m in conversations], params or SamplingParams())

    def stream(self, prompt_or_messages: str | list[dict], params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one completion piece by piece (never half a UTF-8 character)."""
        if isinstance(prompt_or_messages, list) and prompt_or_messages and isinstance(prompt_or_messages[0], dict):
            ids = self._encode_chat(prompt_or_messages)
        else:
            ids = self._encode_prompt(prompt_or_messages)
        params = params or SamplingParams()
        with self._lock:
            engine = self.engine
            request_id = f"llm-{next(self._ids)}"
            engine.add_request(request_id, ids, params)
            try:
                while engine.has_work():
                    for delta in engine.step():
                        if delta.request_id == request_id and delta.text:
                            yield delta.text
            finally:
                engine.abort(request_id)
                engine.pending.clear()

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """Next-token logits at every position of `token_ids`, float32 ``[len(token_ids), vocab]``, one forward pass."""
        with self._lock:
            return self.engine.score(list(token_ids)).cpu()
