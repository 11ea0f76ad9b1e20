"""`EngineArgs`: the one source of defaults for the library, both command lines and the server.

Every engine setting is a field here, with its default and its help text; `LLM(**kwargs)` builds one, and the
CLIs generate their flags from the fields (`add_cli_args`) and read them back (`from_cli_args`). This module
imports no torch, so ``--help`` and argument checks answer before any heavy import.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from gpullama.hub import DEFAULT_MODEL
from gpullama.named_templates import named_template

DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "q8_0")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def _int_at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """An argparse type: an integer >= 0."""
    return _int_at_least(text, 0)


def byte_size(text: str) -> int:
    """An argparse type: a byte count such as 1073741824, 512M or 4G."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    try:
        value = int(float(text[:-1]) * units[text[-1]]) if text and text[-1] in units else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bytes such as 1073741824, 512M or 4G, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def chat_template_text(value: Any) -> str:
    """The text of `EngineArgs.chat_template`: a string holding a Jinja tag (``{{`` or ``{%``) is the template
    itself, a file's path the file's text (as vLLM reads its --chat-template), else one of llama.cpp's built-in
    template names (`gpullama.named_templates`: ``chatml``, ``llama3``, ...); ValueError naming the file or the
    template's syntax error (line and message)."""
    if isinstance(value, str) and not os.path.exists(value) and named_template(value) is not None:
        value = named_template(value)
    if isinstance(value, os.PathLike) or (isinstance(value, str) and "{{" not in value and "{%" not in value):
        path = os.fspath(value)
        try:
            with open(path, encoding="utf-8") as f:
                value = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"chat_template: cannot read the template file {path!r}: "
                             f"{getattr(e, 'strerror', None) or e} (nor is it one of llama.cpp's built-in template "
                             "names, such as chatml or llama3)") from None
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"chat_template must be a template or a file's path holding one, got {value!r:.80}")
    from gpullama.chat_template import ChatTemplate  # jinja2 only when a template is given (--help stays light)

    try:
        ChatTemplate(value, "", "")  # compiled as the tokenizer will compile it
    except ValueError as e:
        raise ValueError(f"chat_template: {e}") from None
    return value


SPECULATIVE_METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding without a draft model (vLLM's ``speculative_config``, method ``"ngram"``): each step,
    a sequence whose last `prompt_lookup_max`..`prompt_lookup_min` tokens occurred earlier in its prompt or output
    proposes the (up to) `num_speculative_tokens` tokens that followed them there; one forward checks them all."""

    method: str = "ngram"
    num_speculative_tokens: int = 2  # of 1-4, the fastest on code edits and JSON (docs/performance.md)
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}; "
                             f"got {self.method!r}")
        for name, top in (("num_speculative_tokens", MAX_SPECULATIVE_TOKENS), ("prompt_lookup_max", 64),
                          ("prompt_lookup_min", 64)):
            value = getattr(self, name)
            if not _is_int(value) or not 1 <= value <= top:
                raise ValueError(f"speculative_config.{name} must be an integer in [1, {top}], got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """A config from a dict of its fields (vLLM's keys), a JSON object text, itself, or None (off)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object such as "
                             f'{{"method": "ngram", "num_speculative_tokens": 2}}, got {value!r}')
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; "
                             f"known: {', '.join(sorted(fields))}")
        if "method" not in value:
            raise ValueError('speculative_config needs "method" (one of: ' + ", ".join(SPECULATIVE_METHODS) + ")")
        if "prompt_lookup_max" in value and "prompt_lookup_min" not in value and _is_int(value["prompt_lookup_max"]):
            value = {**value, "prompt_lookup_min": min(cls.prompt_lookup_min, value["prompt_lookup_max"])}
        return cls(**value)


def speculative_config_arg(text: str) -> SpeculativeConfig:
    """An argparse type: a JSON speculative config."""
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _arg(default: Any, help: str, *, flag: str | None = None, short: str | None = None,
         aliases: tuple[str, ...] = (), **argparse_kwargs: Any):
    """A field with its command-line flag: `flag` overrides ``--field-name``, `aliases` are other names of it (as
    another engine spells it); the rest goes to add_argument."""
    meta = {"help": help, "flag": flag, "short": short, "aliases": aliases, "argparse": argparse_kwargs}
    return field(default=default, metadata=meta)


@dataclass
class EngineArgs:
    """Everything that shapes a loaded model and its engine (the names follow vLLM's engine arguments)."""

    model: str = _arg(DEFAULT_MODEL, f"GGUF path or alias (default: {DEFAULT_MODEL})", short="-m")
    device: str = _arg("auto", "auto, cpu, cuda or cuda:N (default: auto, CUDA when present)")
    dtype: Any = _arg(
        "auto", "compute dtype (default: auto: bfloat16 on CUDA; on the CPU the fast path for a quantized file "
        "(quantized weights, native C kernels, float32 activations; the exact float32 path without a C compiler) "
        "and float32 for an unquantized one; float32 is the exact path)",
        choices=list(DTYPE_NAMES))
    threads: int | None = _arg(None, "torch intra-op threads (default: torch's choice, one per core)",
                               type=positive_int)
    max_model_len: int | None = _arg(None, "context limit in tokens (default: the model's trained context)",
                                     type=positive_int)
    kv_cache_memory: int | None = _arg(
        None, "bytes for the paged KV cache, e.g. 512M or 4G (default: 1 GiB on the CPU, 85%% of free GPU memory, "
        "capped at what max_num_seqs full-length sequences can use)", type=byte_size)
    kv_cache_dtype: str = _arg(
        "auto", "KV cache format (vLLM's flag; default: auto: float16 on the CPU fast path, float32 on the exact "
        "CPU path, the compute dtype on CUDA); q8_0: llama.cpp's 8-bit blocks of 32 with a float16 scale, half "
        "of float16's bytes, CPU fast path only", choices=list(KV_CACHE_DTYPES))
    cpu_activation_bits: int = _arg(
        16, "CPU fast path: the integers each group of 32 activations is rounded to in the quantized matmuls: 16 "
        "(to 1 part in 64516 of the group's largest value) or 8 (1 part in 254, as llama.cpp's Q8 activations, "
        "each 256 values sharing one scale for the K-quants as its Q8_K: a faster prefill; logits further from "
        "the float32 reference) "
        "(default: %(default)s)", type=int, choices=[16, 8])
    max_num_seqs: int = _arg(64, "sequences per batch (default: %(default)s)", type=positive_int)
    max_num_batched_tokens: int = _arg(
        512, "tokens per engine step; longer prompts are prefilled in chunks (default: %(default)s)",
        type=positive_int)
    block_size: int = _arg(16, "tokens per KV cache block (default: %(default)s)", type=positive_int)
    enable_prefix_caching: bool = _arg(True, "do not reuse KV blocks of shared prefixes", flag="--no-prefix-caching")
    state_checkpoints: int | None = _arg(
        None, "models with recurrent layers (LFM2, Qwen3.5, Granite 4.0-H): how many copies of one sequence's "
        "recurrent state prefix caching keeps, at block boundaries (the last one inside each prompt, and the latest "
        "two each sequence reaches after it), least recently used overwritten; each costs a sequence's state "
        "(`gpullama info`), taken from the KV cache's memory; 0: no prefix caching for these models (default: 3 "
        "per max_num_seqs, within a quarter of the KV cache's memory)", type=non_negative_int)
    enforce_eager: bool = _arg(False, "no CUDA graphs for decode steps")
    tensor_parallel_size: int = _arg(
        1, "ranks the model is split across (tensor parallelism over torch.distributed: one process per rank and "
        "device, rank r on cuda:r with NCCL; on the CPU the ranks share the cores, over gloo) (default: %(default)s)",
        short="-tp", type=positive_int)
    speculative_config: Any = _arg(
        None, "speculative decoding without a draft model, as a JSON object (vLLM's): "
        '\'{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
        "drafts the tokens that followed the last n-gram's earlier occurrence in the prompt or output, and checks "
        "them in one forward; greedy output is unchanged, sampled output keeps its distribution (default: off)",
        type=speculative_config_arg)
    chat_template: str | None = _arg(
        None, "a Jinja chat template used instead of the GGUF's tokenizer.chat_template: a file's path, the "
        "template itself, or one of llama.cpp's built-in template names (chatml, llama3, command-r, ...) (vLLM's "
        "--chat-template; llama.cpp's --chat-template-file names the same flag); a missing "
        "file or a template that does not parse is refused before loading (default: the model's)",
        aliases=("--chat-template-file",))
    mmproj: str | None = _arg(
        None, "the vision projector of the model (llama.cpp's --mmproj): an mmproj GGUF written by "
        "convert_hf_to_gguf.py --mmproj (projector type gemma3). Default: an mmproj*.gguf file beside the model, "
        "when the model's folder holds exactly one that fits it")
    no_mmproj: bool = _arg(False, "do not look for an mmproj*.gguf beside the model (text only)")
    # multi-node tensor parallelism (vLLM's flag names): every node runs tensor_parallel_size / nnodes local ranks;
    # they meet at master_addr:master_port, which node 0 hosts (torchrun's variables are read too: docs/deploy.md)
    nnodes: int = _arg(1, "machines the tensor-parallel ranks span (default: %(default)s)", type=positive_int)
    node_rank: int = _arg(0, "this machine's place among them, 0 to nnodes-1; node 0 serves, the others run "
                          "headless (default: %(default)s)", type=int)
    master_addr: str = _arg("127.0.0.1", "address of node 0, where the ranks meet (default: %(default)s)")
    master_port: int = _arg(29501, "port of the rendezvous store on node 0 (default: %(default)s)", type=int)
    distributed_timeout_seconds: int = _arg(
        120, "seconds for every rank of every node to join the group, else the load fails naming the missing node "
        "(default: %(default)s)", type=positive_int)

    def __post_init__(self) -> None:
        self.model = str(self.model)
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.chat_template is not None:
            self.chat_template = chat_template_text(self.chat_template)
        if not isinstance(self.device, str) or not _DEVICE.fullmatch(self.device):
            if not hasattr(self.device, "type"):  # a torch.device is fine as it is
                raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got {self.device!r}")
        if isinstance(self.dtype, str) and self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}; got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}")
        if self.cpu_activation_bits not in (16, 8) or not _is_int(self.cpu_activation_bits):
            raise ValueError(f"cpu_activation_bits must be 16 or 8, got {self.cpu_activation_bits!r}")
        if self.max_model_len is not None and (not _is_int(self.max_model_len) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if self.kv_cache_memory is not None and (not _is_int(self.kv_cache_memory) or self.kv_cache_memory < 1):
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory!r}")
        if self.state_checkpoints is not None and (not _is_int(self.state_checkpoints) or self.state_checkpoints < 0):
            raise ValueError(f"state_checkpoints must be an integer >= 0, got {self.state_checkpoints!r}")
        if self.threads is not None and (not _is_int(self.threads) or self.threads < 1):
            raise ValueError(f"threads must be an integer >= 1, got {self.threads!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size", "nnodes",
                     "distributed_timeout_seconds"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not _is_int(self.node_rank) or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in 0..nnodes-1 ({self.nnodes - 1}), got {self.node_rank!r}")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} must be a multiple of nnodes "
                             f"{self.nnodes} (each node runs the same number of ranks)")
        if not _is_int(self.master_port) or not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in 1..65535, got {self.master_port!r}")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> argparse.ArgumentParser:
        """Add one flag per field (except `skip`), with the field's default and help."""
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            meta = f.metadata
            flag = meta["flag"] or "--" + f.name.replace("_", "-")
            names = [flag, *meta["aliases"]] + ([meta["short"]] if meta["short"] else [])
            if f.default is True:
                parser.add_argument(*names, dest=f.name, action="store_false", help=meta["help"])
            elif f.default is False:
                parser.add_argument(*names, dest=f.name, action="store_true", help=meta["help"])
            else:
                parser.add_argument(*names, dest=f.name, default=f.default, help=meta["help"], **meta["argparse"])
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The engine arguments parsed by a parser that `add_cli_args` set up (fields it skipped keep defaults)."""
        given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        return cls(**given)


@dataclass
class EngineConfig:
    """The engine's resolved limits: `EngineArgs` once the model's context is known (or set directly by tests)."""

    max_model_len: int
    num_blocks: int | None = None  # KV pool size in blocks; None: sized from kv_cache_memory and the device
    kv_cache_memory: int | None = EngineArgs.kv_cache_memory
    kv_cache_dtype: str = EngineArgs.kv_cache_dtype
    block_size: int = EngineArgs.block_size
    max_num_seqs: int = EngineArgs.max_num_seqs
    max_num_batched_tokens: int = EngineArgs.max_num_batched_tokens
    enable_prefix_caching: bool = EngineArgs.enable_prefix_caching
    state_checkpoints: int | None = EngineArgs.state_checkpoints  # None: sized by `model_runner.checkpoint_count`
    use_cuda_graphs: bool = not EngineArgs.enforce_eager  # capture decode steps (when the ops support it)
    static_decode: bool = False  # run decode on the padded static buffers even without graphs (tests)
    speculative: SpeculativeConfig | None = None  # n-gram drafting (off when None)

    @classmethod
    def from_args(cls, args: EngineArgs, max_model_len: int) -> EngineConfig:
        """The config of an engine built from `args` for a context of `max_model_len` tokens."""
        return cls(max_model_len=max_model_len, kv_cache_memory=args.kv_cache_memory,
                   kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size,
                   max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                   enable_prefix_caching=args.enable_prefix_caching, state_checkpoints=args.state_checkpoints,
                   use_cuda_graphs=not args.enforce_eager,
                   speculative=args.speculative_config)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
