"""Triton kernels, one module per op, each with its block layout or shape contract at the top; and `cpu_native`,
the C kernels of the CPU fast path (compiled at first use, loaded with ctypes; no triton needed).

Leaf code: the kernels import triton, torch and `gpullama.quants` only; `gpullama.ops.triton_ops.TritonOps`
puts them behind the ops seam. Importing a kernel module needs triton but no GPU: the kernels run on CUDA
tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (how the tests check them).
"""

CPU_MAX_HEAD_DIM = 512
"""The widest attention head the C kernels take (``GL_MAX_HEAD_DIM`` in `cpu_native.c`): kept here, without torch,
for `gpullama info`, which must not import torch."""
