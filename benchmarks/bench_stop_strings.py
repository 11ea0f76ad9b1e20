"""Cost per token of the detokenizer with stop strings, as the output grows: one table row per output length.

    python benchmarks/bench_stop_strings.py [--compare /path/to/other/checkout] [--rounds 3]

The real default model's tokenizer decodes a long English output token by token through `Detokenizer.update`,
with four stop strings that never match (the common case: every token is checked, nothing stops). The table gives
microseconds per token around each output length (median over the rounds). With --compare, the same measurement
runs in a subprocess for each checkout in turn, alternating, so both see the same machine load.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LENGTHS = (500, 4000, 16000, 32000)  # characters of output at which the cost per token is read
STOPS = ["\n\nUser:", "###", "</answer>", "zzzz"]
WINDOW = 200  # tokens timed around each length


def measure() -> dict[int, float]:
    """Microseconds per `update` call around each output length, for the gpullama on sys.path."""
    from gpullama.engine.detokenizer import Detokenizer
    from gpullama.engine.sequence import Sequence
    from gpullama.gguf_file import read_gguf
    from gpullama.hub import resolve_model
    from gpullama.sampling_params import SamplingParams
    from gpullama.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(read_gguf(resolve_model("smollm2-135m")).metadata)
    sentence = "The old lighthouse stood at the end of a narrow spit of rock, and its lamp turned every night. "
    ids = tok.encode(sentence * (max(LENGTHS) // len(sentence) + 40), add_special_tokens=False)
    detok = Detokenizer(tok)
    seq = Sequence("bench", tok.encode("Tell me a story.", add_special_tokens=True), SamplingParams(stop=STOPS),
                   max_tokens=len(ids))
    out: dict[int, float] = {}
    sent = 0
    pending = list(LENGTHS)
    timing: list[float] = []
    for token in ids:
        seq.append_token(token)
        start = time.perf_counter()
        delta, _ = detok.update(seq, finishing=False)
        elapsed = time.perf_counter() - start
        sent += len(delta)
        if pending and sent >= pending[0]:
            timing.append(elapsed)
            if len(timing) == WINDOW:
                out[pending.pop(0)] = statistics.median(timing) * 1e6
                timing = []
        if not pending:
            break
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--compare", type=Path, default=None, help="another checkout to measure alternately")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--measure-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure_only:
        print(json.dumps(measure()))
        return
    trees = [REPO] + ([args.compare.resolve()] if args.compare else [])
    results: dict[Path, list[dict[str, float]]] = {t: [] for t in trees}
    for _ in range(args.rounds):
        for tree in trees:
            env = dict(os.environ, PYTHONPATH=str(tree))
            run = subprocess.run([sys.executable, __file__, "--measure-only"], env=env, capture_output=True, text=True,
                                 check=True)
            results[tree].append(json.loads(run.stdout))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import cpu_name  # benchmarks/machine.py

    print(f"{datetime.date.today()}, {cpu_name()}, {args.rounds} rounds, stops {STOPS}")
    print("| output chars | " + " | ".join(f"{t.name} us/token" for t in trees) + " |")
    print("|---|" + "---|" * len(trees))
    for length in LENGTHS:
        cells = [f"{statistics.median(r[str(length)] for r in results[t]):.1f}" for t in trees]
        print(f"| {length} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
