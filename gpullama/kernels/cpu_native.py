"""The CPU kernels of `cpu_native.c`, compiled once per machine and called through ctypes on float32 tensors.

The first `library()` call compiles the C file with the system's C compiler (``$CC``, else ``cc``; ``-O3
-march=native -fopenmp -Wall -Wextra``, see `FLAG_SETS`) into a cache directory (``$GPULLAMA_KERNEL_CACHE``, else
``~/.cache/gpullama/kernels``), keyed by the source, the compiler, the flags and the CPU, so later processes load it
in milliseconds; without a working compiler it returns None and `build_error()` says why (the caller falls back to
the torch path). The library links the OpenMP runtime torch has already loaded, so both share one thread pool.

Leaf code: imports torch and the standard library only. Every function takes contiguous float32 CPU tensors
(integer metadata as noted) and writes into the output it is given; shapes are checked by the caller.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from gpullama.kernels import CPU_MAX_HEAD_DIM

log = logging.getLogger("gpullama")

SOURCE = Path(__file__).with_suffix(".c")
FMT_F16, FMT_F32 = 2, 3
FMT_Q4_0, FMT_Q4_1, FMT_Q5_0, FMT_Q5_1, FMT_Q8_0, FMT_Q4_K, FMT_Q5_K, FMT_Q6_K = 4, 5, 6, 7, 8, 9, 10, 11
FMT_MXFP4 = 12
"""Weight formats of `matmul` (see the top of `cpu_native.c`)."""
MAX_HEAD_DIM = CPU_MAX_HEAD_DIM
"""The widest attention head of `attention` (D a multiple of 16, at most this)."""
MAX_CONV_KERNEL = 8
"""The widest short convolution `short_conv` takes (LFM2's is 3, Qwen3.5's 4)."""
MAX_DELTA_KEY_DIM = 256
"""The widest key head `gated_delta_rule` takes (Qwen3.5's are 128)."""
MAX_SSM_STATE = 256
"""The largest state size `ssm_scan` takes (Granite 4.0-H's is 128)."""
"""`attention` needs a head dim that is a multiple of 16 (of 32 for a Q8_0 cache) and at most this, and a block size
a multiple of 16."""
KV_F32, KV_F16, KV_Q8 = 0, 1, 2
"""KV cache formats of `rope_and_cache` and `attention`, told by the pool tensor's dtype (see `kv_format`)."""
KV_DTYPES = {torch.float32: KV_F32, torch.float16: KV_F16, torch.uint8: KV_Q8}
"""The pool dtype of each cache format: a uint8 pool holds Q8_0 rows (D int8 values, then D / 32 float16 scales)."""

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "gl_matmul": [_I32, _P, _I64, _I64, _I64, _P, _I64, _P, _I64, _I32, _I32],
    "gl_rms_norm": [_P, _P, _F32, _P, _F32, _I64, _I64, _P, _I32],
    "gl_rope_and_cache": [_P, _I64, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _I64, _I32, _P, _P,
                          _I32],
    "gl_silu_mul": [_P, _I64, _I64, _P, _I32],
    "gl_gelu_tanh_mul": [_P, _I64, _I64, _P, _I32],
    "gl_soft_cap": [_P, _I64, _I64, _I64, _F32, _F32, _I32],
    "gl_short_conv": [_P, _I64, _I64, _I64, _P, _P, _P, _P, _P, _I64, _P, _I32],
    "gl_gated_delta_rule": [_P, _I64, _P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _I64, _P,
                            _I32],
    "gl_ssm_scan": [_P, _I64, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _I64, _P, _I32],
    "gl_mamba2": [_P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _F32, _P, _P, _P, _P, _P, _I64,
                  _P, _I32],
    "gl_attention": [_I32, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _I64, _F32, _I64, _F32, _P,
                     _I32],
    "gl_attention_sinks": [_I32, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _I64, _F32, _I64, _F32,
                           _P, _P, _I32],
    "gl_embedding": [_I32, _P, _I64, _I64, _P, _I64, _P],
    "gl_argmax": [_P, _I64, _I64, _I64, _P],
    "gl_read_sum": [_P, _I64, _I32],
    "gl_repack": [_I32, _P, _I64, _I64, _P, _I32],
    "gl_unit_bytes": [_I32],
    "gl_moe": [_I32, _P, _I64, _I64, _P, _I32, _P, _I64, _I64, _P,
               _P, _I64, _I64, _I64, _P, _P, _I64, _I64, _I32, _F32, _F32, _P, _I32, _I32],
    "gl_decoder": [_P, _P, _I64, _P, _P, _P, _P, _I64, _P, _P, _P, _I64, _P, _I64, _P, _I32],
}
_RETURNS_STATUS = ("gl_matmul", "gl_mamba2", "gl_attention", "gl_attention_sinks", "gl_embedding", "gl_moe",
                   "gl_decoder", "gl_repack")
ACT_SILU, ACT_SWIGLU_OAI, ACT_GELU_TANH = 0, 1, 2
"""Expert activations of `moe`: SwiGLU, and gpt-oss's clamped SwiGLU."""
FLAG_SETS = (("-O3", "-march=native", "-fopenmp"), ("-O3", "-fopenmp"), ("-O3", "-march=native"), ("-O3",))
"""What `library()` tries in turn, the first that builds and loads winning: -march=native for the vector units this
CPU has, OpenMP for threads (without it the kernels run on one)."""
WARNINGS = ("-Wall", "-Wextra")
"""On every build: the source compiles without a warning under each of `FLAG_SETS` (a test checks the library's
own build, and the other sets with -Werror); a compiler's warnings are logged at info level and kept beside the
library (`build_warnings`)."""



class Mat(ctypes.Structure):
    """A matrix as `matmul` reads it (``gl_mat_t``): format, blocks, rows (a multiple of 16), values a row."""

    _fields_ = [("fmt", _I64), ("data", _P), ("n", _I64), ("k", _I64)]


class Layer(ctypes.Structure):
    """One decoder layer of `decoder` (``gl_layer_t`` in `cpu_native.c`, which says what each field holds)."""

    _fields_ = [
        *[(name, _P) for name in ("attn_norm", "ffn_norm", "post_attn_norm", "post_ffn_norm", "q_norm", "k_norm")],
        ("n_qkv", _I64), ("qkv", Mat * 3), ("qkv_bias", _P), ("o", Mat), ("o_bias", _P), ("cos_sin", _P),
        ("rot_dim", _I64), ("k_cache", _P), ("v_cache", _P), ("window", _I64), ("sinks", _P), ("inter", _I64),
        ("n_gate_up", _I64), ("gate_up", Mat * 2), ("down", Mat), ("router", Mat), ("router_bias", _P),
        ("choice_bias", _P), *[(name, _I64) for name in ("fmt1", "stride1", "n1", "fmt2", "stride2", "n2")],
        ("w1", _P), ("w2", _P), ("b1", _P), ("b2", _P), ("shared_inter", _I64), ("n_shared_gate_up", _I64),
        ("shared_gate_up", Mat * 2), ("shared_down", Mat), ("mamba", _I64), ("ssm_in", Mat), ("ssm_out", Mat),
        *[(name, _P) for name in ("conv_kernel", "conv_bias", "dt_bias", "ssm_a", "ssm_d", "ssm_norm", "conv_states",
                                  "ssm_states")],
    ]


MAX_LORA_RANK = 512
"""The largest LoRA rank `decoder` takes (``GL_MAX_LORA_RANK``)."""


class Lora(ctypes.Structure):
    """A LoRA adapter's pair on one matrix (``gl_lora_t``): adds ``B (A x)`` to output columns off .. off + n (A
    ``[r, k]``, bt = B transposed ``[r, n]``, float32)."""

    _fields_ = [("off", _I64), ("n", _I64), ("k", _I64), ("r", _I64), ("a", _P), ("bt", _P)]


class LoraLayer(ctypes.Structure):
    """An adapter's pairs on one layer (``gl_lora_layer_t``), by site: q|k|v, o, gate|up, down."""

    _fields_ = [("n", _I64 * 4), ("p", (Lora * 3) * 4)]


class LoraGroup(ctypes.Structure):
    """The rows of a step that use one adapter, with their scales (``gl_lora_group_t``)."""

    _fields_ = [("layers", _P), ("R", _I64), ("rows", _P), ("scales", _P)]


class ModelParams(ctypes.Structure):
    """What `decoder`'s layers share (``gl_model_t``)."""

    _fields_ = [
        *[(name, _I64) for name in ("n_layers", "H", "Hq", "Hk", "D", "kvt", "block_size", "act", "E", "top_k",
                                    "gating", "norm_topk", "expert_act")],
        *[(name, _F32) for name in ("eps", "scale", "softcap", "expert_scale", "alpha", "limit")],
        ("bits", _I64), ("residual_scale", _F32),
        *[(name, _I64) for name in ("ssm_inner", "ssm_heads", "ssm_groups", "ssm_n", "conv_L")],
    ]


def decoder(
    model: ModelParams, layers: ctypes.Array, hidden: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor,
    slots: torch.Tensor, query_start: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
    lora: ctypes.Array | None = None, state_slots: torch.Tensor | None = None,
) -> None:
    """Every layer of a step in one call: `hidden` ``[T, H]`` (the embeddings) in; the last layer's output in
    `hidden`, the residual stream in `residual` out. The metadata as `rope_and_cache` and `attention` take it;
    `lora` the step's `LoraGroup`s (None: no adapter); `state_slots` ``[B]`` int64 each sequence's slot of the
    Mamba2 layers' state pools (None without such layers)."""
    if _lib.gl_decoder(ctypes.byref(model), layers, hidden.shape[0], hidden.data_ptr(), residual.data_ptr(),
                       positions.data_ptr(), slots.data_ptr(), seq_lens.shape[0], query_start.data_ptr(),
                       seq_lens.data_ptr(), block_tables.data_ptr(), block_tables.stride(0), lora,
                       len(lora) if lora is not None else 0, _ptr(state_slots), torch.get_num_threads()):
        raise MemoryError(f"no memory for a decoder step of {hidden.shape[0]} tokens")


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None
_tried = False
_built: tuple[tuple[str, ...], Path] | None = None


def cache_dir() -> Path:
    """Where compiled kernels are kept."""
    return Path(os.environ.get("GPULLAMA_KERNEL_CACHE") or Path.home() / ".cache" / "gpullama" / "kernels")


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _cpu_identity() -> bytes:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags", "Features"))})).encode()
    except OSError:
        return f"{platform.machine()} {platform.processor()}".encode()


def _command(cc: str, flags: list[str] | tuple[str, ...], target: Path, source: Path = SOURCE) -> list[str]:
    """The compiler command that builds `source` (the kernels' own by default) into the shared library `target`."""
    return [cc, *flags, "-shared", "-fPIC", "-std=gnu11", str(source), "-o", str(target), "-lm"]


def _warnings_path(library_path: Path) -> Path:
    """Where the compiler's output (its warnings; empty when it had none) is kept beside a built library."""
    return library_path.with_suffix(".warnings")


def _compile(cc: str, flags: list[str] | tuple[str, ...], out: Path) -> None:
    """Compile the source into `out` (atomically: a half-written file is never seen by another process), the
    compiler's stderr into `_warnings_path(out)` first, so every library in the cache has it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        target = Path(tmp) / out.name
        cmd = _command(cc, flags, target)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()[-2000:]}")
        if proc.stderr.strip():
            log.info("the C compiler warned (%s): %s", " ".join(flags), proc.stderr.strip()[-2000:])
        warnings = _warnings_path(target)
        warnings.write_text(proc.stderr)
        os.replace(warnings, _warnings_path(out))
        os.replace(target, out)


def _build() -> tuple[ctypes.CDLL, tuple[str, ...], Path]:
    """The first of `FLAG_SETS` that builds (or is cached) and loads: the library, its flag set, its path."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc or clang)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    errors = []
    for flag_set in FLAG_SETS:
        flags = [*flag_set, *WARNINGS]
        key = hashlib.sha256(SOURCE.read_bytes() + version.encode() + " ".join(flags).encode() + _cpu_identity())
        path = cache_dir() / f"cpu_native-{key.hexdigest()[:16]}.so"
        try:
            if not path.exists():
                log.info("compiling the CPU kernels (%s %s)", cc, " ".join(flags))
                _compile(cc, flags, path)
            lib = ctypes.CDLL(str(path))
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            errors.append(str(e))
            continue
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, (ctypes.c_int if name in _RETURNS_STATUS else None)
        lib.gl_isa.restype = ctypes.c_char_p
        lib.gl_moe_bytes_read.restype = ctypes.c_int64
        lib.gl_matmul_bytes_read.restype = ctypes.c_int64
        lib.gl_read_sum.restype = ctypes.c_float
        lib.gl_unit_bytes.restype = ctypes.c_int64
        return lib, tuple(flag_set), path
    raise RuntimeError("; ".join(errors))


def library() -> ctypes.CDLL | None:
    """The compiled kernels (built on the first call), or None when they cannot be built here."""
    global _lib, _error, _tried, _built
    with _lock:
        if not _tried:
            _tried = True
            try:
                lib, flags, path = _build()
                _lib, _built = lib, (flags, path)
            except Exception as e:  # any failure means: no native kernels, use the torch path
                _error = str(e)
                log.warning("CPU kernels unavailable, using the torch path: %s", _error)
        return _lib


def build_warnings() -> tuple[tuple[str, ...], str | None] | None:
    """The flag set (of `FLAG_SETS`) the loaded library was built with and what the compiler wrote to stderr then
    (None when the cache holds no record of it: a library compiled before these were kept); None without a
    library."""
    library()
    if _built is None:
        return None
    flags, path = _built
    try:
        return flags, _warnings_path(path).read_text()
    except OSError:
        return flags, None


def build_error() -> str | None:
    """Why `library()` returned None (None when it did not)."""
    library()
    return _error


def isa() -> str:
    """The vector instructions the kernels were compiled for: avx512, avx2 or generic."""
    lib = library()
    return lib.gl_isa().decode() if lib is not None else "unavailable"


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


ACTIVATION_BITS = (16, 8)
"""What the quantized formats' matmuls round each group of 32 activations to: 16-bit integers (the default: to 1
part in 64516 of the group's largest value) or 8-bit ones (1 part in 254, as llama.cpp's Q8 activations; half the
integer dot products: a faster prefill)."""


def matmul(fmt: int, x: torch.Tensor, blocks: torch.Tensor, out: torch.Tensor, bits: int = 16) -> torch.Tensor:
    """``out [M, N] = x [M, K] @ W.T`` for W in format `fmt` as `blocks` ``[N / 16, units, unit bytes]`` uint8
    (units of 32 values, of 256 for the K-quants; the format is described at the top of `cpu_native.c`); `out` may
    be a column slice of a wider matrix. `bits`: the activations' integers for the quantized formats (16 or 8)."""
    if _lib.gl_matmul(fmt, x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), blocks.data_ptr(),
                      16 * blocks.shape[0], out.data_ptr(), out.stride(0), bits, torch.get_num_threads()):
        raise MemoryError(f"no memory for the int8 copy of a {tuple(x.shape)} matmul input")
    return out


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux for 2 MiB pages (``madvise(MADV_HUGEPAGE)``) under the whole 2 MiB-aligned stretches of `t`'s
    memory, before it is first written: where transparent huge pages are on only for such regions (``madvise``, a
    common default) its pages are otherwise 4 KiB. False where it is not done (not Linux, no whole 2 MiB stretch, or
    the call refused); the memory and its contents are the same either way. Used for the buffer of
    `gpullama.bench.read_bandwidth`: a plain streaming read, without the matmuls' software prefetch, pays a TLB miss
    every 4 KiB page (docs/performance.md)."""
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    first, last = -(-start // _HUGE_PAGE) * _HUGE_PAGE, end // _HUGE_PAGE * _HUGE_PAGE
    if not platform.system() == "Linux" or last <= first:
        return False
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise(first, last - first, _MADV_HUGEPAGE) == 0


def repack(fmt: int, parts: list[torch.Tensor], k: int) -> torch.Tensor:
    """GGUF rows ``[n, row bytes]`` (uint8, unit column stride) of one or more matrices of ``K = k`` columns and
    quantized format `fmt`, their rows joined in order, as that format's blocks ``[ceil(N / 16), units, unit
    bytes]`` uint8 (N the rows of all parts; rows past N zero), by torch's threads; the parts are read in place."""
    rows = torch.cat([p.data_ptr() + torch.arange(p.shape[0], dtype=torch.int64) * p.stride(0) for p in parts])
    units = k // (256 if fmt in (FMT_Q4_K, FMT_Q5_K, FMT_Q6_K) else 32)
    blocks = torch.empty((-(-rows.shape[0] // 16), units, int(_lib.gl_unit_bytes(fmt))), dtype=torch.uint8)
    if _lib.gl_repack(fmt, rows.data_ptr(), rows.shape[0], k, blocks.data_ptr(), torch.get_num_threads()):
        raise ValueError(f"format {fmt} is not a quantized one")
    return blocks


def matmul_bytes_read() -> int:
    """Weight bytes `matmul` has read in this process so far (every block of the matrix, once a call)."""
    return int(_lib.gl_matmul_bytes_read())


def rms_norm(h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
             out: torch.Tensor, h_scale: float = 1.0) -> torch.Tensor:
    """``h = h * h_scale + residual`` in place (when `residual` is given), then ``out = h * rsqrt(mean(h^2) + eps) *
    weight``; rows ``[T, H]``."""
    _lib.gl_rms_norm(h.data_ptr(), _ptr(residual), h_scale, weight.data_ptr(), eps, h.shape[0], h.shape[1],
                     out.data_ptr(), torch.get_num_threads())
    return out


def rope_and_cache(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor,
    slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
) -> None:
    """Rotate the first R dims of each head of q ``[T, Hq, D]`` and k ``[T, Hk, D]`` in place (NeoX halves;
    `cos_sin` ``[max_pos, R]``, R <= D: partial rotary; int64 `positions`), then write k and v to pool rows `slots`
    (int64) in the pool's format (`KV_DTYPES`: float32, float16 rounded to nearest, or Q8_0 blocks of 32):
    v_cache ``[blocks, block_size, Hk, row]`` as it is, k_cache's memory as ``[blocks, Hk, D, block_size]`` (each
    block transposed, for `attention`; Q8_0: the int8 values, then the scales ``[D / 32, block_size]``). q, k and v
    may be row-strided views (each head contiguous)."""
    t, hq, d = q.shape
    _lib.gl_rope_and_cache(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), t, hq,
                           k.shape[1], d, cos_sin.shape[1], cos_sin.data_ptr(), positions.data_ptr(), slots.data_ptr(),
                           k_cache.shape[1], KV_DTYPES[k_cache.dtype], k_cache.data_ptr(), v_cache.data_ptr(),
                           torch.get_num_threads())


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out [T, I] = silu(gate) * up`` for `gate_up` ``[T, 2I]``."""
    _lib.gl_silu_mul(gate_up.data_ptr(), gate_up.shape[0], out.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


def gelu_tanh_mul(gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out [T, I] = gelu_tanh(gate) * up`` for `gate_up` ``[T, 2I]`` (GeGLU)."""
    _lib.gl_gelu_tanh_mul(gate_up.data_ptr(), gate_up.shape[0], out.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


def soft_cap(x: torch.Tensor, scale: float, cap: float) -> torch.Tensor:
    """In place on x ``[T, n]`` (unit column stride): ``x * scale``, then ``cap * tanh(. / cap)`` when cap > 0."""
    _lib.gl_soft_cap(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), scale, cap, torch.get_num_threads())
    return x


def short_conv(x: torch.Tensor, kernel: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
               positions: torch.Tensor, query_start: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """LFM2's causal depthwise convolution of x ``[T, H]`` (unit column stride) with ``kernel [L, H]`` over each
    sequence's rows (``query_start [B + 1]`` int32), the earlier inputs from ``states [slots, L - 1, H]`` at
    ``slots [B]`` (zeros where the sequence's first row is at position 0), which are then updated; `out` ``[T,
    H]`` float32 (contiguous)."""
    _lib.gl_short_conv(x.data_ptr(), x.stride(0), x.shape[1], kernel.shape[0], kernel.data_ptr(), states.data_ptr(),
                       slots.data_ptr(), positions.data_ptr(), query_start.data_ptr(), slots.shape[0], out.data_ptr(),
                       torch.get_num_threads())
    return out


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
                     states: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, query_start: torch.Tensor,
                     out: torch.Tensor) -> torch.Tensor:
    """The gated delta rule over each sequence's rows (`TorchOps.gated_delta_rule`'s arithmetic, one row after
    another): q, k ``[T, Hk, Dk]`` and v ``[T, Hv, Dv]`` float32 with unit stride inside a row (row-strided views
    allowed), decay and beta ``[T, Hv]`` contiguous, ``states [slots, Hv, Dk, Dv]`` at ``slots [B]`` updated in place
    (zeros where a sequence's first row is at position 0); `out` ``[T, Hv, Dv]`` float32 contiguous."""
    hk, dk = q.shape[1:]
    hv, dv = v.shape[1:]
    _lib.gl_gated_delta_rule(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                             decay.data_ptr(), beta.data_ptr(), hk, hv, dk, dv, states.data_ptr(), slots.data_ptr(),
                             positions.data_ptr(), query_start.data_ptr(), slots.shape[0], out.data_ptr(),
                             torch.get_num_threads())
    return out


def ssm_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
             states: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, query_start: torch.Tensor,
             out: torch.Tensor) -> torch.Tensor:
    """Mamba2's selective scan over each sequence's rows (`TorchOps.ssm_scan`'s arithmetic, one row after another):
    x ``[T, H, P]``, b and c ``[T, G, N]`` float32 with each head's (group's) values contiguous (row-strided views
    allowed), dt ``[T, H]`` and a ``[H]`` contiguous, ``states [slots, H, N, P]`` at ``slots [B]`` updated in place
    (zeros where a sequence's first row is at position 0); `out` ``[T, H, P]`` float32 contiguous."""
    heads, p = x.shape[1:]
    groups, n = b.shape[1:]
    _lib.gl_ssm_scan(x.data_ptr(), x.stride(0), dt.data_ptr(), a.data_ptr(), b.data_ptr(), b.stride(0), c.data_ptr(),
                     c.stride(0), heads, groups, p, n, states.data_ptr(), slots.data_ptr(), positions.data_ptr(),
                     query_start.data_ptr(), slots.shape[0], out.data_ptr(), torch.get_num_threads())
    return out


def mamba2(zxbcdt: torch.Tensor, inner: int, heads: int, groups: int, n: int, kernel: torch.Tensor,
           conv_bias: torch.Tensor, dt_bias: torch.Tensor, a: torch.Tensor, d: torch.Tensor, norm: torch.Tensor,
           eps: float, conv_states: torch.Tensor, ssm_states: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
           query_start: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Mamba2's mixer between its matrices (`TorchOps.mamba2`'s arithmetic, in one call): zxbcdt ``[T, inner + C +
    heads]`` (unit column stride; C = inner + 2 groups n) as in_proj writes it, the convolution's ``kernel [L, C]``
    and ``conv_states [slots, L - 1, C]``, the scan's ``ssm_states [slots, heads, n, inner / heads]`` at ``slots
    [B]``, updated in place (zeros where a sequence's first row is at position 0); every vector float32 contiguous
    (`norm` ``[inner]``); `out` ``[T, inner]`` float32 contiguous: the input of out_proj."""
    if _lib.gl_mamba2(zxbcdt.data_ptr(), zxbcdt.stride(0), zxbcdt.shape[0], inner, heads, groups, n, kernel.shape[0],
                      kernel.data_ptr(), conv_bias.data_ptr(), dt_bias.data_ptr(), a.data_ptr(), d.data_ptr(),
                      norm.data_ptr(), eps, conv_states.data_ptr(), ssm_states.data_ptr(), slots.data_ptr(),
                      positions.data_ptr(), query_start.data_ptr(), slots.shape[0], out.data_ptr(),
                      torch.get_num_threads()):
        raise MemoryError(f"no memory for a Mamba2 mixer's buffers ({zxbcdt.shape[0]} rows)")
    return out


def attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start: torch.Tensor, seq_lens: torch.Tensor,
    block_tables: torch.Tensor, scale: float, out: torch.Tensor, window: int = 0, softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of q ``[T, Hq, D]`` (row-strided view allowed) over the paged pool as `rope_and_cache`
    writes it: sequence b's rows are ``query_start[b]:query_start[b + 1]``, its context ``seq_lens[b]`` tokens in
    the blocks of ``block_tables[b]`` (int32 all three); `out` ``[T, Hq, D]``. `window` > 0: a query at position p
    sees positions above ``p - window`` only; `softcap` > 0: scores become ``softcap * tanh(scores / softcap)``.
    Each row's keys are cut into chunks of 256 and the chunks merged in order (flash-decoding: a decode step of one
    sequence keeps every thread busy), the same whatever the batch."""
    _, hq, d = q.shape
    if _lib.gl_attention(KV_DTYPES[k_cache.dtype], q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                         k_cache.shape[1], hq, k_cache.shape[2], d, seq_lens.shape[0], query_start.data_ptr(),
                         seq_lens.data_ptr(), block_tables.data_ptr(), block_tables.stride(0), scale, window, softcap,
                         out.data_ptr(), torch.get_num_threads()):
        raise MemoryError("no memory for the attention scores")
    return out


def attention_sinks(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start: torch.Tensor, seq_lens: torch.Tensor,
    block_tables: torch.Tensor, scale: float, out: torch.Tensor, window: int, softcap: float, sinks: torch.Tensor,
) -> torch.Tensor:
    """`attention` where head h's softmax also counts ``exp(sinks[h])`` (float32 ``[Hq]``), a key with no value
    (gpt-oss's attention sinks)."""
    _, hq, d = q.shape
    if _lib.gl_attention_sinks(KV_DTYPES[k_cache.dtype], q.data_ptr(), q.stride(0), k_cache.data_ptr(),
                               v_cache.data_ptr(), k_cache.shape[1], hq, k_cache.shape[2], d, seq_lens.shape[0],
                               query_start.data_ptr(), seq_lens.data_ptr(), block_tables.data_ptr(),
                               block_tables.stride(0), scale, window, softcap, sinks.data_ptr(), out.data_ptr(),
                               torch.get_num_threads()):
        raise MemoryError("no memory for the attention scores")
    return out


def embedding(fmt: int, blocks: torch.Tensor, n_rows: int, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (int64, each in [0, n_rows)) of a matrix in the blocks of `matmul`, dequantized exactly: `out`
    ``[T, K]``."""
    if _lib.gl_embedding(fmt, blocks.data_ptr(), n_rows, out.shape[1], ids.data_ptr(),
                         ids.shape[0], out.data_ptr()):
        raise ValueError(f"token id out of range [0, {n_rows})")
    return out


def moe(
    gate_up: tuple[int, torch.Tensor], gate_up_bias: torch.Tensor | None,
    down: tuple[int, torch.Tensor], down_bias: torch.Tensor | None,
    x: torch.Tensor, intermediate: int, ids: torch.Tensor, weights: torch.Tensor, act: int, alpha: float,
    limit: float, out: torch.Tensor, bits: int = 16,
) -> torch.Tensor:
    """A MoE block: ``out [T, H]`` = for each row t, the sum over j (in order) of ``weights[t, j]`` times expert
    ``ids[t, j]`` (int64 ``[T, k]``) applied to ``x[t]``. `gate_up` and `down` are (fmt,
    blocks ``[E, N / 16, units, unit bytes]``) as `matmul` reads them: expert e's gate rows 0 .. I-1 and up rows
    I .. 2I-1 (`intermediate` = I) of K = H values, its down rows of I values; biases float32 ``[E, 2I]`` and
    ``[E, H]`` or None; `act` ACT_SILU, ACT_SWIGLU_OAI (with `alpha`, `limit`) or ACT_GELU_TANH; `bits` as
    `matmul`'s."""
    (f1, w1), (f2, w2) = gate_up, down
    t, k = ids.shape
    status = _lib.gl_moe(f1, w1.data_ptr(), w1[0].numel(), 16 * w1.shape[1], _ptr(gate_up_bias),
                         f2, w2.data_ptr(), w2[0].numel(), 16 * w2.shape[1], _ptr(down_bias),
                         x.data_ptr(), t, x.shape[1], intermediate, ids.data_ptr(), weights.data_ptr(), k,
                         w1.shape[0], act, alpha, limit, out.data_ptr(), bits, torch.get_num_threads())
    if status == -2:
        raise ValueError(f"expert id out of range [0, {w1.shape[0]})")
    if status:
        raise MemoryError(f"no memory for a MoE block of {t} x {k} rows")
    return out


def moe_bytes_read() -> int:
    """Expert weight bytes `moe` has read in this process so far (each active expert's gate|up and down blocks)."""
    return int(_lib.gl_moe_bytes_read())


def argmax(x: torch.Tensor) -> torch.Tensor:
    """The first index of the largest value of each row of x ``[rows, n]`` (unit column stride), int64 ``[rows]``."""
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _lib.gl_argmax(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
    return out


def read_sum(x: torch.Tensor, threads: int | None = None) -> float:
    """The sum of a contiguous float32 tensor, read once by `threads` (default torch's) threads as a streaming read:
    what `gpullama.bench.read_bandwidth` times."""
    assert x.dtype == torch.float32 and x.is_contiguous()
    return float(_lib.gl_read_sum(x.data_ptr(), x.numel(), threads or torch.get_num_threads()))
