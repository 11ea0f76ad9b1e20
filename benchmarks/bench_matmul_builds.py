"""`gl_matmul` of two or more builds of the CPU kernels side by side: GMAC/s at real shapes, the builds alternating
in one process, and whether each build's outputs are the same bits as the first's. A kernel change's A/B on a
noisy machine, where two runs an hour apart differ by more than the change.

    python benchmarks/bench_matmul_builds.py --rev HEAD~1 --rev HEAD --rows 512 --bits 8 \\
        --shapes 2048x2048:Q4_K,8192x2048:Q4_K,2048x8192:Q6_K

Each ``--rev`` is a git revision of `gpullama/kernels/cpu_native.c` (``--source`` a C file instead), compiled with
the flags the library is built with on this machine (`cpu_native.FLAG_SETS`' first, and its warnings) into a
temporary directory. A shape ``NxK:TYPE`` is N output rows of K values of a GGUF type, random valid blocks (the
scales of `tests/kernel_tests/random_model.SCALE_FIELDS`, as `make_random_llama.py` writes them) packed into the
CPU format by the loaded library; x is ``--rows`` random rows. Each round runs every build once, in turn, on the
same x; the table gives each build's best round, in GMAC/s (a multiply-add a weight and row), the time including
the quantization of x as in a model's matmul that does not share it.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.make_random_llama import random_matrix  # noqa: E402
from gpullama.kernels import cpu_native  # noqa: E402
from gpullama.ops.cpu_weights import CpuWeight  # noqa: E402
from gpullama.quants import QTensor  # noqa: E402

SOURCE = "gpullama/kernels/cpu_native.c"


def build(name: str, source: str, out: Path) -> ctypes.CDLL:
    """`source` (C text) compiled as the library is, loaded with gl_matmul's signature."""
    src = out.with_suffix(".c")
    src.write_text(source)
    cmd = cpu_native._command(cpu_native._compiler(), [*cpu_native.FLAG_SETS[0], *cpu_native.WARNINGS], out, src)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{name}: {' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    lib = ctypes.CDLL(str(out))
    lib.gl_matmul.argtypes, lib.gl_matmul.restype = cpu_native._SIGNATURES["gl_matmul"], ctypes.c_int
    return lib


def parse_shape(text: str) -> tuple[int, int, gguf.GGMLQuantizationType]:
    size, qtype = text.split(":")
    n, k = (int(v) for v in size.lower().split("x"))
    return n, k, gguf.GGMLQuantizationType[qtype.upper()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rev", action="append", default=[], help="a git revision of the kernels' source (repeatable)")
    p.add_argument("--source", action="append", default=[], help="a C file (repeatable), after the revisions")
    p.add_argument("--shapes", default="2048x2048:Q4_K,8192x2048:Q4_K,2048x8192:Q6_K")
    p.add_argument("--rows", type=int, default=512, help="rows of x (1: a decode step's matmul)")
    p.add_argument("--bits", type=int, default=8, choices=(16, 8), help="the activations' integers")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args(argv)
    sources = [(rev, subprocess.run(["git", "show", f"{rev}:{SOURCE}"], cwd=ROOT, capture_output=True, text=True,
                                    check=True).stdout) for rev in args.rev]
    sources += [(path, Path(path).read_text()) for path in args.source]
    if len(sources) < 2:
        p.error("give at least two builds (--rev, --source)")
    if cpu_native.library() is None:
        raise SystemExit(f"no CPU kernels to pack the weights with: {cpu_native.build_error()}")
    with tempfile.TemporaryDirectory() as tmp:
        libs = [build(name, text, Path(tmp) / f"build{i}.so") for i, (name, text) in enumerate(sources)]
        print(f"`gl_matmul`, {args.rows} rows, {args.bits}-bit activations, {args.threads} threads, best of "
              f"{args.rounds} rounds, builds alternating; {time.strftime('%Y-%m-%d %H:%M')}\n")
        print("| matrix | " + " | ".join(f"{name} (GMAC/s)" for name, _ in sources) + " | same bits as the first |")
        print("| --- |" + " ---: |" * len(sources) + " --- |")
        rng = np.random.default_rng(0)
        for n, k, qtype in (parse_shape(s) for s in args.shapes.split(",")):
            weight = CpuWeight.from_qtensor(QTensor(torch.from_numpy(random_matrix(qtype, n, k, rng)), qtype, (n, k)))
            x = torch.from_numpy(rng.standard_normal((args.rows, k), dtype=np.float32))
            outs = [torch.empty(args.rows, 16 * weight.blocks.shape[0]) for _ in libs]
            best = [float("inf")] * len(libs)
            for _ in range(args.rounds):
                for i, lib in enumerate(libs):
                    t = time.perf_counter()
                    status = lib.gl_matmul(weight.fmt, x.data_ptr(), args.rows, k, k, weight.blocks.data_ptr(),
                                           outs[i].shape[1], outs[i].data_ptr(), outs[i].shape[1], args.bits,
                                           args.threads)
                    best[i] = min(best[i], time.perf_counter() - t)
                    if status:
                        raise SystemExit(f"{sources[i][0]}: gl_matmul returned {status}")
            same = ", ".join("yes" if torch.equal(o.view(torch.int32), outs[0].view(torch.int32)) else "NO"
                             for o in outs[1:])
            macs = args.rows * n * k
            print(f"| {qtype.name} {n}x{k} | " + " | ".join(f"{macs / b / 1e9:.0f}" for b in best) + f" | {same} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
