"""`gpullama.LLM`: load a GGUF model and generate, chat, stream or score through the batching engine."""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Generator
from pathlib import Path

import torch

from gpullama.chat.messages import chat_images, check_messages
from gpullama.checks import RequestError
from gpullama.engine.args import EngineArgs
from gpullama.engine.errors import EngineError
from gpullama.engine.llm_engine import LLMEngine
from gpullama.engine.model_spec import ModelSpec, build_model
from gpullama.engine.tp_workers import Rendezvous, TPWorkers
from gpullama.gguf_file import read_gguf
from gpullama.hub import ALIASES, resolve_model
from gpullama.lora import Adapter, load_adapter
from gpullama.lora_request import LoRARequest
from gpullama.outputs import Completion, CompletionOutput, EmbeddingOutput, RerankResult
from gpullama.pooling_params import RANK, PoolingParams
from gpullama.rerank import RerankFormat, score_pairs
from gpullama.sampling_params import SamplingParams
from gpullama.structured.spec import StructuredOutputError
from gpullama.tokenizer import Tokenizer
from gpullama.vision.images import ImageRef
from gpullama.vision.loading import load_vision

log = logging.getLogger("gpullama")

def release_free_memory() -> None:
    """Hand the load's freed scratch buffers back to the OS (glibc keeps them otherwise); a no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def resident_bytes() -> int:
    """This process's resident memory (VmRSS) in bytes; 0 where /proc is not there."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def held_bytes(*roots: object) -> int:
    """Bytes of the tensors reachable from `roots` (through lists, tuples, dicts and the attributes of gpullama's
    objects and torch modules), each storage counted once however many views share it."""
    storages: dict[tuple, int] = {}
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if obj is None or isinstance(obj, (str, bytes, int, float, bool)) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            try:
                storage = obj.untyped_storage()
                key = (str(obj.device), storage.data_ptr())
                storages[key] = max(storages.get(key, 0), storage.nbytes())
            except (RuntimeError, NotImplementedError):  # an opaque (mkldnn) tensor: no storage to share
                storages[("opaque", id(obj))] = obj.nbytes
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif type(obj).__module__.startswith("gpullama") or isinstance(obj, torch.nn.Module):
            stack.extend(getattr(obj, "__dict__", {}).values())
            stack.extend(getattr(obj, name) for name in getattr(type(obj), "__slots__", ()) if hasattr(obj, name))
    return sum(storages.values())


def _samples(params: SamplingParams) -> list[SamplingParams]:
    """The per-sample params of ``params.n`` samples: sample i of a seeded request draws with seed + i (as the
    server's choices do), so the samples differ yet repeat."""
    if params.n == 1:
        return [params]
    return [dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            for i in range(params.n)]


class LLM:
    """A loaded model with its tokenizer and engine: ``LLM("smollm2-135m").generate("Hello")``.

    Keyword arguments are the fields of `gpullama.engine.args.EngineArgs` (device, dtype, threads, max_model_len,
    kv_cache_memory, kv_cache_dtype, max_num_seqs, max_num_batched_tokens, block_size, enable_prefix_caching,
    enforce_eager, tensor_parallel_size), with its defaults. With ``tensor_parallel_size`` > 1 it starts worker processes (see
    `gpullama.engine.tp_workers`): call `shutdown()` (or use ``with LLM(...) as llm:``) to end them before the
    process does, and guard the script's entry point with ``if __name__ == "__main__":`` (they are spawned).

    ``lora`` loads GGUF LoRA adapters (llama.cpp's format, see `gpullama.lora`) with the model: a path, a list of
    paths (each named by its file's stem) or a dict of name to path; a request picks them with ``lora=`` (a name, a
    `LoRARequest`, a list of them, or a dict of name to scale). Adapters and the base model run in the same batch.
    """

    _workers: TPWorkers | None = None
    vision = None  # gpullama.vision.prompt.VisionModel: the mmproj's tower, when the model has one

    def __init__(self, model: str | os.PathLike = EngineArgs.model, lora=None, **engine_args):
        self._load(EngineArgs(model=os.fspath(model), **engine_args))
        if isinstance(lora, (str, os.PathLike)):
            lora = [lora]
        items = lora.items() if isinstance(lora, dict) else [(None, p) for p in (lora or [])]
        for name, path in items:
            self.load_lora(path, name)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, on_progress: Callable[[str], None] | None = None) -> LLM:
        """Load the model and build its engine as `args` say; `on_progress` hears each loading step as it starts
        (such as ``"reading model.gguf (98 MB)"``), for a front end to show."""
        llm = cls.__new__(cls)
        llm._load(args, on_progress)
        return llm

    def _load(self, args: EngineArgs, on_progress: Callable[[str], None] | None = None) -> None:
        started = time.perf_counter()
        step = on_progress or (lambda _: None)
        self.args = args
        self.model_name = args.model if args.model in ALIASES else Path(args.model).stem
        step(f"finding {args.model}")
        self.path = resolve_model(args.model)
        rendezvous = Rendezvous.from_args(args)
        tp_size = max(args.tensor_parallel_size, rendezvous.nnodes)  # torchrun's WORLD_SIZE when it runs us
        if rendezvous.node_rank != 0:
            raise ValueError(f"node_rank {rendezvous.node_rank}: only node 0 loads an LLM and serves; run the other "
                             "nodes with `gpullama-serve --headless` (docs/deploy.md)")
        local_ranks = rendezvous.ranks_per_node(tp_size)
        size = f" ({os.path.getsize(self.path) / 1e6:.0f} MB)" if os.path.isfile(self.path) else ""
        step(f"reading {Path(self.path).name}{size}")
        gguf_model = read_gguf(self.path)
        # a model that cannot be cut into tp_size ranks fails here, before any process starts
        spec = ModelSpec.from_args(args, gguf_model, tp_size, local_ranks)
        self.device, self.dtype, self.max_model_len = torch.device(spec.device), spec.dtype, spec.max_model_len
        self.config = gguf_model.config
        self.metadata = gguf_model.metadata
        if args.chat_template is not None:  # the given template in place of the file's (a copy: the map is shared)
            self.metadata = {**self.metadata, "tokenizer.chat_template": args.chat_template}
        step("building the tokenizer")
        self.tokenizer = Tokenizer.from_metadata(self.metadata)
        self.rerank_format = RerankFormat.from_metadata(self.metadata, self.tokenizer)
        if tp_size > 1:
            step(f"starting {local_ranks - 1} tensor-parallel worker processes"
                 + (f", waiting for {rendezvous.nnodes - 1} other nodes" if rendezvous.multi_node else ""))
            self._workers = TPWorkers.start(spec, tp_size, rendezvous)
        try:
            tp = self._workers.tp if self._workers is not None else None
            self.model = build_model(spec, tp, gguf_model=gguf_model, on_progress=step)
            self.vision = load_vision(args, self.path, self.model, self.tokenizer, tp_size)
            step("reserving the KV cache")
            self.engine = LLMEngine(self.model, self.tokenizer, spec.engine_config)
            if self._workers is not None:
                self._workers.wait_ready()
                # ends the workers when this LLM is collected or the interpreter exits, unless shutdown() did
                self._finalizer = weakref.finalize(self, self._workers.shutdown, self.engine.runner)
        except BaseException as exc:
            if self._workers is None:
                raise
            reason = self._workers.failure()  # a worker's own error explains this rank's better
            self._workers.shutdown()
            if reason is not None:
                raise RuntimeError(reason) from exc
            raise
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.loras: dict[str, int] = {}  # LoRA adapter name -> engine id
        runner = self.engine.runner
        del gguf_model  # the file's memory map goes once nothing else holds a view of it
        release_free_memory()
        log.info(
            "loaded %s (%s, %d layers) on %s%s (ops: %s, %s%s, %d threads) in %.1fs; resident memory %.0f MiB",
            self.model_name, self.config.architecture, self.config.num_layers, self.device,
            f" x {tp_size} tensor-parallel ranks" if tp_size > 1 else "", self.model.ops.name, self.model.ops.mode,
            ", CUDA graphs" if runner.uses_cuda_graphs else "", torch.get_num_threads(), time.perf_counter() - started,
            resident_bytes() / 2**20,
        )
        log.info(
            "KV cache: %d tokens reserved (%d blocks of %d, %.0f MiB %s, sized by %s)%s",
            self.engine.kv_capacity_tokens, runner.num_blocks, args.block_size, runner.kv_cache_bytes / 2**20,
            runner.kv_cache_format, runner.kv_pool_limit,
            "; resident only as requests fill it" if self.device.type == "cpu" else "",
        )
        if runner.states:
            log.info(
                "recurrent states: %.1f KiB a sequence; prefix caching %s", runner.state_bytes / 1024,
                f"keeps {runner.num_checkpoints} state checkpoints ({runner.checkpoint_bytes / 2**20:.1f} MiB, in the "
                f"KV cache's memory)" if runner.num_checkpoints else "is off (no state checkpoints)",
            )

    # -- LoRA adapters ---------------------------------------------------------------------------------
    def load_lora(self, path: str | os.PathLike, name: str | None = None) -> int:
        """Load a GGUF LoRA adapter for this model under `name` (default: the file's stem); its engine id (the id
        llama.cpp's per-request ``lora`` list names). ValueError when the name is taken or the adapter does not fit
        the model (its architecture or a shape)."""
        adapter = load_adapter(self.model, path, name)
        return self.add_lora(adapter)

    def add_lora(self, adapter: Adapter) -> int:
        """Make an adapter prepared for this model (`gpullama.lora.prepare_lora`) available; its engine id."""
        loras = self.loras
        if adapter.name in loras:
            raise ValueError(f"a LoRA adapter named {adapter.name!r} is already loaded")
        with self._lock:
            adapter_id = self.engine.add_lora(adapter)
        loras[adapter.name] = adapter_id
        return adapter_id

    def unload_lora(self, name: str) -> None:
        """Unload the adapter `name` (KeyError when there is none; ValueError while a request uses it)."""
        if name not in self.loras:
            raise KeyError(f"no LoRA adapter named {name!r} is loaded")
        with self._lock:
            self.engine.remove_lora(self.loras[name])
        del self.loras[name]

    @property
    def lora_adapters(self) -> dict[str, Adapter]:
        """The loaded adapters by name."""
        return {name: self.model.adapters[i] for name, i in self.loras.items()}

    def _lora_pairs(self, lora) -> list[tuple[int, float]] | None:
        """A request's ``lora=`` as (engine id, scale) pairs (None: the base model)."""
        if lora is None:
            return None
        if isinstance(lora, (str, LoRARequest)):
            lora = [lora]
        if isinstance(lora, dict):
            lora = [LoRARequest(name, scale=scale) for name, scale in lora.items()]
        pairs = []
        for item in lora:
            req = LoRARequest(item) if isinstance(item, str) else item
            if not isinstance(req, LoRARequest):
                raise ValueError(f"lora= takes adapter names, LoRARequests or a dict of name to scale, got "
                                 f"{type(item).__name__}")
            if req.name not in self.loras:
                if req.path is None:
                    known = ", ".join(self.loras) or "none"
                    raise ValueError(f"no LoRA adapter named {req.name!r} is loaded (loaded: {known})")
                self.load_lora(req.path, req.name)
            pairs.append((self.loras[req.name], float(req.scale)))
        return pairs

    def _with_lora(self, params: SamplingParams | None, lora) -> SamplingParams:
        params = params or SamplingParams()
        pairs = self._lora_pairs(lora)
        return params if pairs is None else dataclasses.replace(params, lora=pairs)

    # -- helpers -------------------------------------------------------------------------------------
    def _encode_prompt(self, prompt: str | list[int] | dict) -> list[int]:
        if isinstance(prompt, dict):  # vLLM's {"prompt": text, "multi_modal_data": {"image": one or a list}}
            return self._encode_multimodal(prompt)
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def _encode_multimodal(self, prompt: dict) -> list[int]:
        """A text prompt with images, each at a marker in the text: the model's own (Gemma 3's
        ``<start_of_image>``, SmolVLM's ``<image>``) or llama.cpp's ``<__media__>``."""
        text, data = prompt.get("prompt"), (prompt.get("multi_modal_data") or {}).get("image")
        if not isinstance(text, str):
            raise ValueError("a prompt dict needs 'prompt', a string")
        images = data if isinstance(data, (list, tuple)) else [] if data is None else [data]
        if not images:
            return self.tokenizer.encode(text, add_special_tokens=True)
        if self.vision is None:
            raise RequestError("this model reads no images: load its vision projector with mmproj=... "
                               "(--mmproj FILE)", "multi_modal_data")
        refs = [ImageRef(image, f"multi_modal_data.image[{i}]") for i, image in enumerate(images)]
        return self.vision.prompt(text.replace("<__media__>", self.vision.media_marker), refs, add_special_tokens=True)

    def _encode_chat(self, messages: list[dict]) -> list[int]:
        check_messages(messages)
        messages, refs = chat_images(messages)
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        if refs:
            if self.vision is None:
                raise RequestError("this model reads no images: load its vision projector with mmproj=... "
                                   "(--mmproj FILE)", "messages")
            return self.vision.prompt(text, refs)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _run(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Run every prompt (`params.n` samples of each) as one continuous batch until all finish."""
        samples = _samples(params)
        with self._lock:
            engine = self.engine
            # all admitted before any runs, so a bad prompt fails the call before anything is queued
            seqs = [[engine.admit(f"llm-{next(self._ids)}", ids, p, images=getattr(ids, "images", None))
                     for p in samples] for ids in prompts]
            try:
                for group in seqs:
                    for seq in group:
                        engine.add(seq)
                while engine.has_work():
                    engine.step()
            finally:  # interrupted (KeyboardInterrupt, an error): leave nothing running
                for group in seqs:
                    for seq in group:
                        engine.abort(seq.request_id, notify=False)
        for group in seqs:  # a request the engine refused while running it (a grammar that did not compile)
            refused = next((seq.error for seq in group if isinstance(seq.error, StructuredOutputError)), None)
            if refused is not None:
                raise refused
        completions = []
        for group in seqs:
            outputs = [CompletionOutput(i, seq.text, seq.output_token_ids, seq.finish_reason, seq.logprobs,
                                        _error_text(seq.error))
                       for i, seq in enumerate(group)]
            first = group[0]
            completions.append(Completion(
                text=first.text,
                token_ids=first.output_token_ids,
                prompt_token_ids=first.prompt_token_ids,
                finish_reason=first.finish_reason,
                logprobs=first.logprobs,
                num_cached_tokens=first.num_cached_tokens,
                error=_error_text(first.error),
                outputs=outputs,
            ))
        return completions

    # -- public API ------------------------------------------------------------------------------------
    def generate(self, prompts: str | list[str], params: SamplingParams | None = None, lora=None) -> list[Completion]:
        """Complete one prompt or many (run together as one continuous batch); one Completion per prompt. A request
        whose step fails ends with finish_reason "error" (its `error` says why) while the others finish. `lora`:
        the adapters to run with (see the class; None: the base model, or what `params.lora` says). A prompt may be
        vLLM's dict ``{"prompt": text, "multi_modal_data": {"image": image or [images]}}`` for a model with an mmproj:
        each image at a marker in the text (Gemma 3's ``<start_of_image>``, or llama.cpp's ``<__media__>``)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run([self._encode_prompt(p) for p in prompts], self._with_lora(params, lora))

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None,
             lora=None) -> list[Completion]:
        """Answer one conversation (a list of {"role", "content"} dicts) or a list of them, via the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self._run([self._encode_chat(m) for m in conversations], self._with_lora(params, lora))

    def stream(
        self, prompt_or_messages: str | list[dict], params: SamplingParams | None = None, lora=None,
    ) -> Generator[str, None, str | None]:
        """Yield the text of one completion piece by piece (never half a UTF-8 character); the generator's return
        value (``StopIteration.value``) is the finish reason ("stop", "length"); raises EngineError if it fails."""
        if isinstance(prompt_or_messages, list) and prompt_or_messages and isinstance(prompt_or_messages[0], dict):
            ids = self._encode_chat(prompt_or_messages)
        else:
            ids = self._encode_prompt(prompt_or_messages)
        params = self._with_lora(params, lora)
        if params.n != 1:
            raise ValueError(f"stream yields one completion: SamplingParams.n must be 1, got {params.n}")
        with self._lock:
            engine = self.engine
            seq = engine.admit(f"llm-{next(self._ids)}", ids, params, images=getattr(ids, "images", None))
            engine.add(seq)
            try:
                while engine.has_work():
                    for delta in engine.step():
                        if delta.request_id == seq.request_id and delta.finish_reason == "error":
                            if isinstance(delta.error, StructuredOutputError):  # the request's own fault (its grammar)
                                raise delta.error
                            raise EngineError(f"generation failed: {_error_text(delta.error)}")
                        if delta.request_id == seq.request_id and delta.text:
                            yield delta.text
            finally:  # the caller stopped iterating early, or the step failed
                engine.abort(seq.request_id, notify=False)
        return seq.finish_reason

    def embed(self, inputs: str | list[str] | list[int] | list[list[int]],
              pooling: PoolingParams | None = None, lora=None) -> list[EmbeddingOutput]:
        """The embedding of each input (a text, or token ids; one or a list), run as one continuous batch: the final
        hidden states pooled as the model says (its GGUF's pooling_type: mean, cls or last; else the last token),
        L2-normalised unless `pooling` says otherwise (`PoolingParams(normalize=False, dimensions=N)`). A text is
        tokenized as a completion prompt is (the model's BOS/EOS rules). `lora`: LoRA adapters, as `generate`'s."""
        if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        if not isinstance(inputs, list) or not inputs:
            raise ValueError("embed() needs a text, a list of token ids, or a non-empty list of them")
        seqs = self._pool([self._encode_prompt(p) for p in inputs], pooling, "embedding", self._lora_pairs(lora))
        return [EmbeddingOutput(seq.embedding, seq.prompt_token_ids) for seq in seqs]

    def _pool(self, prompts: list[list[int]], pooling: PoolingParams | None, what: str,
              lora: list[tuple[int, float]] | None = None) -> list:
        """Run `prompts` as pooled (never sampled) requests in one continuous batch, under the adapters `lora`
        ((id, scale) pairs); their finished sequences."""
        with self._lock:
            engine = self.engine
            seqs = [engine.admit_embedding(f"llm-{next(self._ids)}", ids, pooling, lora) for ids in prompts]
            try:
                for seq in seqs:
                    engine.add(seq)
                while engine.has_work():
                    engine.step()
            finally:  # interrupted: leave nothing running
                for seq in seqs:
                    engine.abort(seq.request_id, notify=False)
        failed = next((seq for seq in seqs if seq.embedding is None), None)
        if failed is not None:
            raise EngineError(f"{what} failed: {_error_text(failed.error)}")
        return seqs

    @property
    def is_reranker(self) -> bool:
        """Whether the model reranks: a GGUF with pooling_type rank and a classification head (`gpullama.rerank`)."""
        return self.engine.limits.reranker

    def rerank_prompt(self, query: str, document: str) -> list[int]:
        """The token ids of one (query, document) pair, as llama.cpp's server builds them (`gpullama.rerank`)."""
        return self.rerank_format.prompt_ids(self.tokenizer, query, document)

    def _pair_scores(self, pairs: list[tuple[str, str]]) -> list[tuple[float, int]]:
        """Each (query, document) pair's score and prompt token count, as one continuous batch."""
        if not self.is_reranker:
            raise ValueError(f"{Path(self.path).name} is not a reranker (a GGUF with pooling_type rank and a "
                             "classification head, cls.output.weight): it cannot rerank or score")
        prompts = [self.rerank_prompt(q, d) for q, d in pairs]
        seqs = self._pool(prompts, PoolingParams(normalize=False, kind=RANK), "scoring")
        return [(float(seq.embedding[0]), len(seq.prompt_token_ids)) for seq in seqs]

    def rerank(self, query: str, documents: list[str], top_n: int | None = None) -> list[RerankResult]:
        """Rank `documents` by their relevance to `query` with a reranker model (llama.cpp's ``/rerank``): the
        results, best first (the first `top_n` of them when given), each with its index in `documents`, its score
        and its prompt's token count. ValueError for a model that is not a reranker or a document too long."""
        if not isinstance(query, str):
            raise ValueError(f"query must be a string, got {type(query).__name__}")
        documents = _texts(documents, "documents")
        if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
            raise ValueError(f"top_n must be an integer >= 1, got {top_n!r}")
        scored = self._pair_scores([(query, d) for d in documents])
        results = [RerankResult(i, score, documents[i], n) for i, (score, n) in enumerate(scored)]
        results.sort(key=lambda r: -r.relevance_score)  # stable: equal scores keep the documents' order
        return results if top_n is None else results[:top_n]

    def score(self, text_1: str | list[str], text_2: str | list[str]) -> list[float]:
        """vLLM's ``LLM.score`` for a reranker: the score of `text_1` (the query) against each text of `text_2`
        (1:N), or of each pair of two lists of one length (N:N), in pair order; each pair is prompted as `rerank`
        prompts a (query, document) pair."""
        return [s for s, _ in self._pair_scores(score_pairs(_texts(text_1, "text_1"), _texts(text_2, "text_2")))]

    def logits(self, token_ids: list[int], lora=None) -> torch.Tensor:
        """Next-token logits at every position of `token_ids`, float32 ``[len(token_ids), vocab]``, one forward pass
        (with the adapters `lora`, as `generate` takes them; the images of a `PromptIds` from `vision.prompt`)."""
        pairs = self._lora_pairs(lora)
        with self._lock:
            return self.engine.score(list(token_ids), pairs, getattr(token_ids, "images", None)).cpu()

    @property
    def memory_bytes(self) -> int:
        """Bytes this model holds in this process: its weights as its ops keep them (LoRA adapters and the vision
        tower included), the KV pool as reserved, the recurrent states (and prefix caching's checkpoints of them)
        and the step buffers."""
        return held_bytes(self.model, self.engine.runner, self.vision)

    # -- lifetime --------------------------------------------------------------------------------------
    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the tensor-parallel workers (ranks 1..N-1; empty with one rank)."""
        return self._workers.pids if self._workers is not None else []

    def shutdown(self) -> None:
        """End the tensor-parallel worker processes and leave their group (a no-op with one rank); the LLM cannot
        run a step afterwards. Also runs at interpreter exit, and the workers end with this process whatever
        happens to it."""
        if self._workers is not None:
            with self._lock:
                self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()


def _texts(value: str | list[str], name: str) -> list[str]:
    """A text or a non-empty list of texts, as a list; ValueError naming `name` otherwise."""
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError(f"{name} must be a string or a non-empty list of strings")
    return texts


def _error_text(error: BaseException | None) -> str | None:
    """A failed request's error as `Completion.error` gives it."""
    return None if error is None else f"{type(error).__name__}: {error}"
