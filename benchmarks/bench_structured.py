"""Per-token cost of grammar-constrained decoding next to free decoding, at several batch sizes.

    python benchmarks/bench_structured.py --model smollm2-135m --batch 1,16 --output-len 64 --repeats 3

Each batch runs `--output-len` decode tokens per request in three modes, alternated within every repeat (each
mode first in turn): free
(EOS ignored), a JSON array of integers and a JSON array of strings. Both schemas need more items than the run
has tokens (`minItems`), so every constrained row also decodes exactly `--output-len` tokens and the modes do the
same work apart from the grammar. The first step (prefill and first token) is left out: the table is decode only.
"Mask" is the time spent filling and applying the token bitmask (`StructuredOutputManager.mask`). The grammars
are compiled (and the grammar engine imported) before timing. Printed first, cold: the backend's build (importing
the engine, indexing the vocabulary), and for each schema (also a pydantic-style schema with $defs and a tool-call
grammar of three functions) its compile time and its first bitmask fill on a fresh matcher (an engine that builds
lexer states lazily pays there). Runs with any gpullama checkout's backend (xgrammar before issue 20).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import statistics
import time

import torch
from machine import cpu_name  # benchmarks/machine.py

from gpullama import LLM, SamplingParams, StructuredOutput
from gpullama.structured import get_backend, tool_call_grammar

SCHEMAS = {
    "json: integers": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100000},
                       "minItems": 1000},
    "json: strings": {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 1000},
}
PROMPT = "List as many numbers or words as you can, as JSON."
ADDRESS = {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"anyOf": [{"type": "string"},
                                                                                           {"type": "null"}]}},
           "required": ["street", "zip"]}
COMPILE_ONLY = {  # compiled (cold) for the compile times only
    "json: person ($defs)": StructuredOutput(json_schema={
        "$defs": {"Address": ADDRESS}, "type": "object", "required": ["name", "age", "role", "tags", "address"],
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                       "role": {"enum": ["admin", "user"]}, "tags": {"type": "array", "items": {"type": "string"}},
                       "address": {"$ref": "#/$defs/Address"}}}),
    "tools: 3 functions (hermes)": tool_call_grammar([
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"]}}},
        {"type": "function", "function": {"name": "add", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"]}}},
        {"type": "function", "function": {"name": "now"}}], "required", format="hermes"),
}


class Timer:
    """Wraps a method of `owner` to add up the seconds its calls take."""

    def __init__(self, owner, name: str) -> None:
        self.seconds = 0.0
        self._method = getattr(owner, name)
        setattr(owner, name, self)

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self._method(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


class MaskTimer(Timer):
    """`StructuredOutputManager.mask` (fill and apply) timed, and within it the backend's fill and apply."""

    def __init__(self, manager, backend) -> None:
        super().__init__(manager, "mask")
        self.fill = Timer(backend, "fill_bitmask")
        self.apply = Timer(backend, "apply_bitmask")

    def reset(self) -> None:
        """Start counting from zero."""
        self.seconds = self.fill.seconds = self.apply.seconds = 0.0


def run(llm: LLM, batch: int, params: SamplingParams, timer: MaskTimer,
        tag: str) -> tuple[float, float, int, float, float]:
    """(decode seconds, mask seconds, decode tokens, fill seconds, apply seconds) of one batch: every step after
    the first."""
    engine = llm.engine
    ids = llm._encode_chat([{"role": "user", "content": PROMPT}])
    seqs = [engine.add_request(f"{tag}-{i}", ids, params) for i in range(batch)]
    engine.step()  # prefill and first token, not timed
    timer.reset()
    start = time.perf_counter()
    while engine.has_work():
        engine.step()
    elapsed = time.perf_counter() - start
    tokens = sum(s.num_output_tokens for s in seqs) - batch
    assert all(s.num_output_tokens == params.max_tokens for s in seqs), "a row ended early"
    return elapsed, timer.seconds, tokens, timer.fill.seconds, timer.apply.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", default="1,16", help="comma-separated batch sizes")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 (default): greedy, so that only the grammar differs between the modes")
    args = parser.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    llm = LLM(args.model, device="cpu", dtype=args.dtype, max_num_seqs=max(batches))
    tok = llm.tokenizer
    specs = {name: StructuredOutput(json_schema=s) for name, s in SCHEMAS.items()}
    start = time.perf_counter()
    backend = get_backend(tok, llm.config.vocab_size)
    build_ms = (time.perf_counter() - start) * 1000
    cold = {}  # name -> (compile ms, first fill ms)
    for name, spec in {**specs, **COMPILE_ONLY}.items():
        compiled = backend.compile(spec)
        matcher, bitmask = backend.matcher(compiled), backend.allocate_bitmask(1)
        start = time.perf_counter()
        backend.fill_bitmask([matcher], bitmask, threads=1)
        cold[name] = (compiled.compile_s * 1000, (time.perf_counter() - start) * 1000)
    t = args.temperature
    modes = {"free": SamplingParams(temperature=t, seed=0, max_tokens=args.output_len, ignore_eos=True)}
    modes.update({name: SamplingParams(temperature=t, seed=0, max_tokens=args.output_len, structured_output=spec)
                  for name, spec in specs.items()})
    timer = MaskTimer(llm.engine.structured_output, backend)
    for batch in batches:  # warm-up
        for name, params in modes.items():
            run(llm, batch, params, timer, f"warm-{name}")
    results: dict[tuple[int, str], list[tuple[float, float, int, float, float]]] = {}
    names = list(modes)
    for r in range(args.repeats):
        for batch in batches:
            for name in names[r % len(names):] + names[:r % len(names)]:  # each mode goes first in turn
                results.setdefault((batch, name), []).append(run(llm, batch, modes[name], timer, f"{r}-{name}"))

    print(f"machine: {cpu_name()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}; "
          f"model {llm.model_name} ({llm.model.ops.name}, {llm.model.ops.mode}, {llm.dtype}); vocabulary "
          f"{llm.config.vocab_size}; {datetime.date.today()}")
    engine = type(backend).__module__.rsplit(".", 1)[-1].replace("_backend", "")
    version = importlib.metadata.version(engine)
    print(f"grammar engine {engine} {version}; backend build (import, vocabulary) {build_ms:.0f} ms")
    print("cold: " + "; ".join(f"{n}: compile {c:.1f} ms, first fill {f:.2f} ms" for n, (c, f) in cold.items()))
    print(f"decode only, {args.output_len} tokens per request, temperature {t}, median of {args.repeats} "
          "alternated runs\n")
    print("| batch | mode | ms / token | tokens/s | mask ms / step | vs free |")
    print("|---:|---|---:|---:|---:|---:|")
    for batch in batches:
        free = None
        for name in modes:
            runs = results[(batch, name)]
            per_token = statistics.median(r[0] / r[2] for r in runs) * 1000
            steps = args.output_len - 1
            mask_step = statistics.median(r[1] for r in runs) / steps * 1000
            free = per_token if name == "free" else free
            ratio = "1.00" if name == "free" else f"{per_token / free:.2f}"
            print(f"| {batch} | {name} | {per_token:.2f} | {1000 / per_token:.0f} | {mask_step:.2f} | {ratio} |")

    print("\nThe mask split (median ms per step): filling the bitmask, applying it to the logits\n")
    print("| batch | mode | fill ms / step | apply ms / step |")
    print("|---:|---|---:|---:|")
    for batch in batches:
        for name in list(modes)[1:]:
            runs = results[(batch, name)]
            fill = statistics.median(r[3] for r in runs) / (args.output_len - 1) * 1000
            apply = statistics.median(r[4] for r in runs) / (args.output_len - 1) * 1000
            print(f"| {batch} | {name} | {fill:.2f} | {apply:.2f} |")


if __name__ == "__main__":
    main()
