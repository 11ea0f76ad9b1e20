"""`cpu_native.c` builds without a warning: every build has -Wall -Wextra (`cpu_native.WARNINGS`); here they are
errors (-Werror), so a warning added back fails."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import pytest

from gpullama.kernels import cpu_native

CC = cpu_native._compiler()
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler")
X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")

ISA_BRANCHES = {
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "avx2-no-fma": ("-mavx2",),
    "avx512": ("-mavx512f", "-mfma", "-mf16c"),
    "avx512-bw": ("-mavx512f", "-mavx512bw", "-mfma", "-mf16c"),
    "avx512-vnni": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mfma", "-mf16c"),
    "f16c-only": ("-mavx", "-mf16c"),
}
"""The vector branches the source picks by the compiler's macros (#if __AVX512F__, __AVX512BW__, __AVX512VNNI__,
__AVX2__ and __FMA__, __F16C__), named for any x86 CPU: -march=native only reaches this machine's (AVX2 without FMA: plain C vectors, AVX2 dot
products; F16C without AVX2: plain C with F16C's half conversions)."""


def _compile(flags: list[str], target: Path, *, may_fail: bool = False) -> None:
    """Build with `flags` (-Werror among them): no error, nothing on stderr. `may_fail`: a flag set `library()` may
    pass over (this compiler has no OpenMP, say) is skipped when it fails for another reason than a warning."""
    proc = subprocess.run(cpu_native._command(CC, flags, target), capture_output=True, text=True, timeout=600)
    if may_fail and proc.returncode != 0 and "-Werror" not in proc.stderr:  # gcc [-Werror=x], clang [-Werror,-Wx]
        pytest.skip(f"{CC} cannot build with {' '.join(flags)} here: {proc.stderr.strip()[-500:]}")
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr


def _has_openmp(tmp_path: Path) -> bool:
    source = tmp_path / "omp.c"
    source.write_text("#include <omp.h>\nint f(void) { return omp_get_max_threads(); }\n")
    return subprocess.run([CC, "-fopenmp", "-fsyntax-only", str(source)], capture_output=True).returncode == 0


@needs_cc
@pytest.mark.parametrize("flags", cpu_native.FLAG_SETS, ids=" ".join)
def test_each_flag_set_compiles_without_a_warning(flags: tuple[str, ...], tmp_path: Path) -> None:
    """Each flag set `library()` tries, as it builds it, the front end only (-fsyntax-only, under a second): unused
    parameters, sign compares, OpenMP pragmas without -fopenmp and the like, in the branches it picks here."""
    _compile([*flags, *cpu_native.WARNINGS, "-Werror", "-fsyntax-only"], tmp_path / "lib.so", may_fail=True)


@needs_cc
@pytest.mark.skipif(not X86, reason="x86 vector branches")
@pytest.mark.parametrize("isa", ISA_BRANCHES)
@pytest.mark.parametrize("openmp", [True, False], ids=["openmp", "no-openmp"])
def test_each_vector_branch_compiles_without_a_warning(isa: str, openmp: bool, tmp_path: Path) -> None:
    """Every x86 vector branch, whatever this CPU has, with and without OpenMP (front end only)."""
    if openmp and not _has_openmp(tmp_path):
        pytest.skip(f"{CC} has no OpenMP")
    flags = ["-O3", *ISA_BRANCHES[isa], *(["-fopenmp"] if openmp else []), *cpu_native.WARNINGS]
    _compile([*flags, "-Werror", "-fsyntax-only"], tmp_path / "lib.so")


@needs_cc
def test_the_library_builds_without_a_warning(tmp_path: Path) -> None:
    """The library as `library()` builds it with the first flag set (-O3 -march=native -fopenmp), whole: the
    warnings the optimizer finds (-Wmaybe-uninitialized, -Warray-bounds, ...) too. An -O3 build takes 45 s of one
    core, so the compiler's output kept beside the library the suite already loaded is read when it was built with
    that set (the cache key holds the source, compiler, flags and CPU: it is this source's build); only without
    that record is the build run here, with -Werror. The other flag sets are checked by the front end only."""
    built = cpu_native.build_warnings()
    if built is not None and built[0] == cpu_native.FLAG_SETS[0] and built[1] is not None:
        assert not built[1].strip(), built[1]
        return
    _compile([*cpu_native.FLAG_SETS[0], *cpu_native.WARNINGS, "-Werror"], tmp_path / "lib.so", may_fail=True)
