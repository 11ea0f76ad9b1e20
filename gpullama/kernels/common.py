"""Shared pieces of the Triton kernels: the interpreter switch, tile sizes and a `tl.dot` that works everywhere."""

from __future__ import annotations

import functools
import inspect
import os

import torch
import triton
import triton.language as tl

TL_DTYPES: dict[torch.dtype, tl.dtype] = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
}


def interpreting() -> bool:
    """Whether Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _fix_interpreter_scalar_index() -> None:
    """Let triton 3.6's interpreter take runtime scalars as loop bounds under NumPy >= 2.4.

    Its tensors' ``__index__`` (what ``range(0, K, BLOCK_K)`` calls on a scalar argument) is ``int(data)`` of a
    shape-(1,) array, which NumPy 2.4 refuses ("only 0-dimensional arrays can be converted"); later Tritons
    squeeze the array first. Applied only where the installed interpreter still has the old line.
    """
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or "int(self.handle.data)" not in inspect.getsource(patch):
        return

    def patch_lang_tensor(tensor, scope) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_lang_tensor


if interpreting():
    _fix_interpreter_scalar_index()


def tl_dtype(dtype: torch.dtype, what: str = "tensor") -> tl.dtype:
    """The Triton dtype of a float torch dtype; other dtypes raise ValueError naming `what`."""
    if dtype not in TL_DTYPES:
        raise ValueError(f"{what}: dtype {dtype} is not supported by the kernels (float32, float16 or bfloat16)")
    return TL_DTYPES[dtype]


def pow2(n: int, minimum: int = 1) -> int:
    """The smallest power of two that is at least `n` and `minimum`."""
    return max(triton.next_power_of_2(max(int(n), 1)), minimum)


def scan_inputs(name: str, states: torch.Tensor, *rows: torch.Tensor) -> list[torch.Tensor]:
    """A recurrent scan's inputs as its kernel reads them: `states` must be contiguous float32 (they are updated in
    place, so never copied); each of `rows` ``[T, H, D]`` float32 with unit inner strides (as given when it already
    is, a view of a wider projection say, else a contiguous float32 copy)."""
    if states.dtype != torch.float32 or not states.is_contiguous():
        raise ValueError(f"{name}: the states must be contiguous float32")
    return [x if x.dtype == torch.float32 and x.stride(-1) == 1 and x.stride(1) == x.shape[2]
            else x.float().contiguous() for x in rows]


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a small stand-in elsewhere, to keep interpreter grids small)."""
    if device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    """Multiprocessor count of CUDA device `index`, asked once."""
    return torch.cuda.get_device_properties(index).multi_processor_count


@triton.jit
def round_to(x, DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """float32 `x` rounded to DTYPE (to nearest even), returned as float32.

    The interpreter truncates float32 -> bfloat16; with EMULATE set the rounding is done on the bits instead,
    so interpreted kernels round exactly as compiled ones do.
    """
    if EMULATE and DTYPE == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit
def dot(a, b, acc, DOT_DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """``acc + a @ b`` with the inputs rounded to DOT_DTYPE; float32 stays exact (no TF32).

    EMULATE (set under the interpreter, whose bf16 `tl.dot` is wrong) rounds to DOT_DTYPE and multiplies in
    float32, which gives the same products, since a product of two 16-bit floats is exact in float32.
    """
    if EMULATE:
        return tl.dot(round_to(a, DOT_DTYPE, EMULATE), round_to(b, DOT_DTYPE, EMULATE), acc, input_precision="ieee")
    elif DOT_DTYPE == tl.float32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), acc)


@triton.jit
def tanh(x):
    """tanh of float32 `x` from `tl.exp` (no libdevice call, so any Triton version has it): an odd Taylor
    polynomial below |x| = 1/4, ``(1 - e) / (1 + e)`` with ``e = exp(-2|x|)`` above; within a few float32 ulps."""
    a = tl.abs(x)
    a2 = a * a
    # tanh a = a - a^3/3 + 2a^5/15 - 17a^7/315 + 62a^9/2835 - ...; the next term is below 1e-8 * a at a = 1/4
    poly = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0 + a2 * (62.0 / 2835.0)))))
    e = tl.exp(-2.0 * a)
    t = tl.where(a < 0.25, poly, (1.0 - e) / (1.0 + e))
    return tl.where(x < 0, -t, t)
