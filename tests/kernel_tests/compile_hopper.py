"""Compile the kernels for Hopper (sm_90) without a GPU, through Triton's bundled ptxas.

The interpreter runs kernels as numpy and accepts code the compiler rejects; this catches those failures on a
CPU-only machine. Run as ``python -m tests.kernel_tests.compile_hopper [--all]`` (without TRITON_INTERPRET): the
default set covers every kernel once, ``--all`` every weight format and compute dtype.
"""

from __future__ import annotations

import argparse
import os
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from gpullama.kernels import (
    attention,
    embedding,
    fused_moe,
    gelu,
    layer_norm,
    quant_matmul,
    rms_norm,
    rotary,
    sampling,
    silu_mul,
    soft_cap,
)
from gpullama.kernels.gguf_blocks import sub_block_size

HOPPER = GPUTarget("cuda", 90, 32)
FLOAT_ARGS = {"scale", "eps", "x_scale", "SOFTCAP", "cap"}
WEIGHT_POINTER = {0: "*fp32", 1: "*fp16", 30: "*bf16"}  # quantized formats read bytes


def compile_kernel(fn, pointers: dict[str, str], constexprs: dict, num_warps: int = 4):
    """Compile one kernel for sm_90; arguments not named are i32 scalars (fp32 for scale/eps)."""
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = pointers.get(name, "fp32" if name in FLOAT_ARGS else "i32")
    return triton.compile(ASTSource(fn, signature, constexprs), target=HOPPER, options={"num_warps": num_warps})


def cases(everything: bool) -> list[tuple[str, object, dict, dict, int]]:
    """(label, kernel, pointer types, constexprs, num_warps) of the kernels to compile."""
    formats = [0, 1, 30, 8, 2, 3, 6, 7, 12, 13, 14, 39] if everything else [30, 12, 14, 39]
    dtypes = [tl.float32, tl.bfloat16, tl.float16] if everything else [tl.bfloat16]
    out = []
    for fmt in formats:
        sub = sub_block_size(fmt)
        ptrs = dict(x_ptr="*fp32", w_ptr=WEIGHT_POINTER.get(fmt, "*u8"), h_ptr="*fp16", bias_ptr="*fp32", out_ptr="*fp32")
        for dt in dtypes:
            out.append((f"gemv fmt={fmt} {dt}", quant_matmul._gemv_kernel, ptrs,
                        dict(FMT=fmt, SUB=sub, HAS_BIAS=True, COMPUTE_DTYPE=dt, EMULATE=False, BLOCK_N=4, BLOCK_K=1024), 4))
            out.append((f"matmul fmt={fmt} {dt}", quant_matmul._matmul_kernel, ptrs,
                        dict(FMT=fmt, SUB=sub, HAS_BIAS=False, COMPUTE_DTYPE=dt, EMULATE=False, BLOCK_M=16, BLOCK_N=128,
                             BLOCK_K=128), 4))
        moe = dict(a_ptr="*fp32", w_ptr=WEIGHT_POINTER.get(fmt, "*u8"), h_ptr="*u8" if fmt == 39 else "*fp16",
                   bias_ptr="*fp32", scale_ptr="*fp32", out_ptr="*fp32", sorted_pairs_ptr="*i32",
                   block_experts_ptr="*i32")
        for dt in dtypes:
            out.append((f"grouped gemm (fused MoE) fmt={fmt} {dt}", fused_moe._grouped_gemm_kernel, moe,
                        dict(FMT=fmt, SUB=sub, A_PER_PAIR=True, HAS_BIAS=True, SCALE_ROWS=True, COMPUTE_DTYPE=dt,
                             EMULATE=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64), 4))
        out.append((f"embedding fmt={fmt}", embedding._embedding_kernel,
                    dict(ids_ptr="*i64", w_ptr=WEIGHT_POINTER.get(fmt, "*u8"), h_ptr="*fp16", out_ptr="*fp32"), dict(FMT=fmt, SUB=sub, BLOCK=1024), 4))
    for pool, dt in [("*bf16", tl.bfloat16), ("*fp32", tl.float32)] if everything else [("*bf16", tl.bfloat16)]:
        out.append((f"rope {pool}", rotary._rope_and_cache_kernel,
                    dict(q_ptr="*fp32", k_ptr="*fp32", v_ptr="*fp32", cos_sin_ptr="*fp32", positions_ptr="*i64",
                         slots_ptr="*i64", k_cache_ptr=pool, v_cache_ptr=pool),
                    dict(POOL_DTYPE=dt, EMULATE=False, HAS_REST=True, BLOCK_HQ=32, BLOCK_HK=8, BLOCK_HALF=32,
                         BLOCK_D=128), 4))
        ptrs = dict(q_ptr="*fp32", k_cache_ptr=pool, v_cache_ptr=pool, block_tables_ptr="*i32", seq_lens_ptr="*i32",
                    query_start_ptr="*i32", part_out_ptr="*fp32", part_lse_ptr="*fp32", out_ptr="*fp32",
                    sinks_ptr="*fp32")
        out.append((f"decode attention {pool}", attention._decode_kernel, ptrs,
                    dict(DOT_DTYPE=dt, EMULATE=False, HAS_SOFTCAP=True, BLOCK_G=16, BLOCK_N=64, BLOCK_D=64), 4))
        out.append((f"prefill attention {pool}", attention._prefill_kernel, ptrs,
                    dict(DOT_DTYPE=dt, EMULATE=False, HAS_SOFTCAP=True, HAS_SINKS=True, BLOCK_M=64, BLOCK_N=64,
                         BLOCK_D=64), 4))
    out += [
        ("combine", attention._combine_kernel,
         dict(part_out_ptr="*fp32", part_lse_ptr="*fp32", sinks_ptr="*fp32", out_ptr="*fp32", query_start_ptr="*i32"),
         dict(HAS_SINKS=True, BLOCK_S=16, BLOCK_D=64), 1),
        ("rms_norm", rms_norm._rms_norm_kernel,
         dict(x_ptr="*fp32", residual_ptr="*fp32", weight_ptr="*fp32", out_ptr="*fp32", sum_ptr="*fp32"), dict(HAS_RESIDUAL=True, BLOCK=2048), 4),
        ("silu_mul", silu_mul._silu_mul_kernel, dict(x_ptr="*fp32", out_ptr="*fp32"), dict(BLOCK=1024, GELU=False), 4),
        ("gelu_tanh_mul", silu_mul._silu_mul_kernel, dict(x_ptr="*fp32", out_ptr="*fp32"), dict(BLOCK=1024, GELU=True), 4),
        ("layer_norm", layer_norm._layer_norm_kernel,
         dict(x_ptr="*fp32", weight_ptr="*fp32", bias_ptr="*fp32", out_ptr="*fp32"), dict(BLOCK=2048), 4),
        *((f"gelu form {form}", gelu._gelu_kernel, dict(x_ptr="*fp32", out_ptr="*fp32"), dict(FORM=form, BLOCK=1024), 4)
          for form in gelu.FORMS.values()),
        ("soft_cap", soft_cap._soft_cap_kernel, dict(x_ptr="*fp32", out_ptr="*fp32"), dict(HAS_CAP=True, BLOCK=1024), 4),
        ("sample", sampling._sample_kernel,
         dict(logits_ptr="*fp32", e_ptr="*fp32", out_ptr="*i64", temperature_ptr="*fp32", top_k_ptr="*i32",
              top_p_ptr="*fp32", min_p_ptr="*fp32", uniform_ptr="*fp32"), dict(BLOCK_V=1024), 8),
    ]
    return out


def main(argv: list[str] | None = None) -> int:
    """Compile the chosen kernels; print one line each; exit 1 if any fails."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="every weight format and compute dtype")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: interpreted kernels cannot be compiled", file=sys.stderr)
        return 2
    failed = 0
    for label, fn, pointers, constexprs, num_warps in cases(args.all):
        try:
            compiled = compile_kernel(fn, pointers, constexprs, num_warps)
            print(f"ok   {label} (shared memory {compiled.metadata.shared} B)")
        except Exception as e:  # report every kernel, then fail
            failed += 1
            print(f"FAIL {label}: {type(e).__name__}: {e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
