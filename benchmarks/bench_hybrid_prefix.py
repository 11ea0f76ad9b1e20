"""A multi-turn chat on a hybrid model (recurrent layers: LFM2, Qwen3.5, Granite 4.0-H): time to first token of each
turn with prefix caching on (recurrent-state checkpoints at block boundaries) and off.

    python benchmarks/bench_hybrid_prefix.py MODEL.gguf --turns 6 --max-tokens 64 --threads 2

One model load, two engines over it (prefix caching on and off). Each runs the same conversation: a system prompt
(a long passage), then each turn a new user question; the prompt of turn k is the chat template over the system
prompt, every earlier question and the answer the engine gave, and the new question, so with prefix caching on a
turn can continue from the checkpoint the previous answer's decode saved. Greedy; each answer stops at EOS or
--max-tokens. The engines alternate turn by turn (on, off, on, ...), so both see the same machine load. Time to
first token: from queueing the request to the step that samples its first token (the prefill, as the server's
access log counts it); each engine first answers a short warm-up request. The table gives, per turn, the prompt
tokens, the tokens served from the cache, and both times; rounds repeat the whole chat on fresh engines and report
medians. (Prefix caching on splits a missed prompt's prefill at its last block boundary to save the state there:
turn 1 shows that cost.)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import statistics
import time

from machine import cpu_name  # benchmarks/machine.py

from gpullama import LLM
from gpullama.engine.llm_engine import LLMEngine
from gpullama.sampling_params import SamplingParams

SYSTEM = (
    "You are a careful assistant for a small maritime museum. The museum keeps the logbooks of a lighthouse that "
    "stood at the end of a narrow spit of rock for more than a century. The keepers wrote down the weather, the "
    "ships that passed, and the repairs that a building facing the open sea always needs. In winter the waves "
    "climbed the walls and salt crusted the windows; in summer the gulls nested in every crack. When the light was "
    "automated, the last keeper packed his books and his barometer into a wooden crate and walked back along the "
    "causeway at low tide. The village turned his cottage into the museum, with the logbooks in glass cases and a "
    "map of every wreck along the coast since records began. Scientists later used the logs to study how the "
    "region's climate changed, because few places had such long and steady records of wind, rain and temperature "
    "taken at the same hour every day. Answer visitors' questions about the lighthouse, the keepers and the coast."
)
QUESTIONS = [
    "What did the keepers write in their logbooks?",
    "Why were the logs useful to scientists?",
    "What happened to the last keeper when the light was automated?",
    "What does the museum show about wrecks along the coast?",
    "What was winter like at the lighthouse?",
    "Could you summarise the lighthouse's history in three sentences?",
    "Which records would help someone study rainfall?",
    "What is in the glass cases today?",
]


def first_token_time(engine: LLMEngine, prompt: list[int], params: SamplingParams, request_id: str):
    """Run one request to its end: (seconds from queueing to its first sampled token, its sequence)."""
    start = time.perf_counter()
    seq = engine.add_request(request_id, prompt, params)
    ttft = None
    while engine.has_work():
        engine.step()
        if ttft is None and seq.num_output_tokens:
            ttft = time.perf_counter() - start
    return ttft, seq


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a GGUF file of a hybrid model")
    parser.add_argument("--turns", type=int, default=6, help=f"turns of the chat (at most {len(QUESTIONS)})")
    parser.add_argument("--max-tokens", type=int, default=64, help="longest answer")
    parser.add_argument("--rounds", type=int, default=1, help="times the whole chat is run on fresh engines")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=4096)
    args = parser.parse_args()
    turns = min(args.turns, len(QUESTIONS))
    llm = LLM(args.model, device=args.device, dtype=args.dtype, threads=args.threads,
              max_model_len=args.max_model_len, max_num_seqs=1)
    if not llm.config.has_recurrent_state:
        raise SystemExit(f"{args.model} has no recurrent layers ({llm.config.architecture}): not a hybrid model")
    tok = llm.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    config = llm.engine.config
    times: dict[str, list[list[float]]] = {"on": [[] for _ in range(turns)], "off": [[] for _ in range(turns)]}
    shape: list[tuple[int, int]] = [(0, 0)] * turns  # prompt tokens, cached tokens (prefix caching on)
    checkpoints = 0
    for r in range(args.rounds):
        engines = {mode: LLMEngine(llm.model, tok, dataclasses.replace(config, enable_prefix_caching=mode == "on"))
                   for mode in ("on", "off")}
        checkpoints = engines["on"].runner.num_checkpoints
        for mode, engine in engines.items():  # a warm-up request that shares nothing with the chat
            first_token_time(engine, tok.encode("Warm up.", add_special_tokens=False), params, f"warm-{mode}-{r}")
        chats = {mode: [{"role": "system", "content": SYSTEM}] for mode in engines}
        for turn in range(turns):
            for mode, engine in engines.items():
                messages = chats[mode] + [{"role": "user", "content": QUESTIONS[turn]}]
                prompt = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
                ttft, seq = first_token_time(engine, prompt, params, f"{mode}-{r}-{turn}")
                times[mode][turn].append(ttft)
                if mode == "on":
                    shape[turn] = (seq.num_prompt_tokens, seq.num_cached_tokens)
                chats[mode] = messages + [{"role": "assistant", "content": seq.text}]
    print(f"# {datetime.date.today()}, {cpu_name()}, {os.path.basename(args.model)} ({llm.config.architecture}), "
          f"{llm.model.ops.mode}, {llm.device}, {torch_threads()} threads; {args.rounds} round(s), medians; "
          f"{checkpoints} state checkpoints of {llm.engine.runner.state_bytes / 1024:.1f} KiB")
    print("| turn | prompt tokens | cached (on) | TTFT on (ms) | TTFT off (ms) | off / on |")
    print("|---:|---:|---:|---:|---:|---:|")
    for turn in range(turns):
        on, off = (statistics.median(times[m][turn]) * 1000 for m in ("on", "off"))
        print(f"| {turn + 1} | {shape[turn][0]} | {shape[turn][1]} | {on:.1f} | {off:.1f} | {off / on:.2f} |")


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


if __name__ == "__main__":
    main()
