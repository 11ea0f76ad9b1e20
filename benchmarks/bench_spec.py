"""n-gram speculative decoding against plain decoding at batch 1: tokens/s, acceptance, identical greedy output.

    python benchmarks/bench_spec.py --model smollm2-135m --threads 2 --rounds 2 \\
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 2}'

One model load (the CPU fast path for a quantized file), two engines over it: plain, and with the speculative
config. Each task is a chat: editing code it was given, extracting JSON from a document, summarising with quotes,
and free text. The rounds alternate the engines task by task (plain, speculative, plain, ...), so both see the same
machine load. Decode tokens/s is (output tokens - 1) / (time from the first output token to the last): the
prompt's prefill is the same for both and left out. Greedy, EOS kept (each task ends where the model ends it or at
--max-tokens). The table gives medians over the rounds, the acceptance rate (accepted / checked drafts), the mean
tokens per step of the speculative engine, and whether its output equals plain decoding's token for token.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import statistics
import time

import torch
from machine import cpu_name  # benchmarks/machine.py

from gpullama import LLM
from gpullama.engine.args import SpeculativeConfig
from gpullama.engine.llm_engine import LLMEngine
from gpullama.sampling_params import SamplingParams

CODE = '''import json
from dataclasses import dataclass


@dataclass
class Order:
    order_id: str
    customer: str
    items: list
    total: float


def load_orders(path):
    with open(path) as f:
        data = json.load(f)
    orders = []
    for entry in data:
        order = Order(entry["id"], entry["customer"], entry["items"], entry["total"])
        orders.append(order)
    return orders


def total_by_customer(orders):
    totals = {}
    for order in orders:
        if order.customer not in totals:
            totals[order.customer] = 0.0
        totals[order.customer] += order.total
    return totals


def print_report(orders):
    totals = total_by_customer(orders)
    for customer, total in sorted(totals.items()):
        print(f"{customer}: {total:.2f}")
'''

DOCUMENT = """From: Maria Lopez <maria.lopez@northwind-supplies.com>
To: Accounts Payable <ap@harborview-clinic.org>
Date: 14 March 2025
Subject: Invoice INV-20931 for the February delivery

Dear Accounts Payable team,

Please find below the details of invoice INV-20931 for the medical supplies delivered to Harborview Clinic,
12 Dock Street, Portsmouth, on 27 February 2025. The order was placed by Dr. James Whitfield under purchase
order PO-7781.

- 40 boxes of nitrile gloves (size M) at 12.50 each
- 15 packs of sterile gauze pads at 8.20 each
- 6 digital thermometers at 24.99 each

The total amount due is 772.94, payable within 30 days to account GB29 NWBK 6016 1331 9268 19.
If you have any questions, please call me on +44 23 9287 4410.

Kind regards,
Maria Lopez
Northwind Supplies Ltd.
"""

ARTICLE = """The town council of Millbrook voted on Tuesday to turn the old railway station into a public library.
"This building has been empty for eleven years, and it deserves a second life," said councillor Anne Price, who
proposed the plan. The project will cost 2.4 million pounds, of which the county will pay half. Some residents
were against it. "We need a car park more than we need another library," said shop owner Tom Hughes. Work is
planned to start in September and to end within eighteen months. The station's original clock, which stopped in
1987, will be repaired and put back above the main entrance. "People still meet under that clock, even though it
has not worked for decades," said Price."""

TASKS = {
    "code edit": f"Rename the function `total_by_customer` to `sum_by_customer` (its call too) in this module. "
                 f"Return the whole module, otherwise unchanged.\n\n```python\n{CODE}```",
    "code edit + hints": f"Rename the class `Order` to `PurchaseOrder` everywhere in this module and add type hints "
                         f"to every function. Return the whole module.\n\n```python\n{CODE}```",
    "JSON extraction": f"Extract from this email a JSON object with the keys invoice_number, date, sender_name, "
                       f"sender_email, customer, address, purchase_order, items (a list of objects with "
                       f"quantity, description and unit_price), total and phone. Copy the values exactly.\n\n"
                       f"{DOCUMENT}",
    "summary with quotes": f"Summarise this article in a few sentences, quoting each person's words exactly.\n\n"
                           f"{ARTICLE}",
    "free text": "Write a story about a lighthouse keeper who finds a message in a bottle.",
}


def run_one(engine: LLMEngine, prompt: list[int], params: SamplingParams, request_id: str):
    """Run one request alone: (output token ids, decode seconds after the first token, steps taken after it)."""
    seq = engine.add_request(request_id, prompt, params)
    first_at = None
    steps = 0
    while engine.has_work():
        engine.step()
        if seq.num_output_tokens and first_at is None:
            first_at = time.perf_counter()
        elif first_at is not None:
            steps += 1
    return seq.output_token_ids, time.perf_counter() - first_at, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--speculative-config", default='{"method": "ngram"}')
    ap.add_argument("--tasks", default=",".join(TASKS), help="comma-separated task names (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = SpeculativeConfig.parse(args.speculative_config)
    llm = LLM(args.model, max_model_len=2048, enable_prefix_caching=False)
    engines = {"plain": llm.engine,
               "ngram": LLMEngine(llm.model, llm.tokenizer, dataclasses.replace(llm.engine.config, speculative=spec))}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    tasks = [t for t in args.tasks.split(",") if t]
    prompts = {t: llm._encode_chat([{"role": "user", "content": TASKS[t]}]) for t in tasks}
    print(f"# {datetime.date.today()}, {cpu_name()}, {args.threads} threads, {os.path.basename(str(llm.path))}, "
          f"{llm.engine.model.ops.mode}; {spec}")
    times: dict[tuple[str, str], list[float]] = {}
    outputs: dict[tuple[str, str], list[int]] = {}
    steps: dict[str, int] = {}
    drafts: dict[str, tuple[int, int]] = {}
    for r in range(args.rounds):
        for task in tasks:
            for name, engine in engines.items():
                before = (engine.stats.draft_tokens, engine.stats.accepted_tokens)
                ids, seconds, n_steps = run_one(engine, prompts[task], params, f"{name}-{task}-{r}")
                times.setdefault((task, name), []).append((len(ids) - 1) / seconds)
                outputs[(task, name)] = ids
                if name == "ngram":
                    steps[task] = n_steps
                    drafts[task] = (engine.stats.draft_tokens - before[0], engine.stats.accepted_tokens - before[1])
    print("| task | prompt tokens | output tokens | plain tok/s | ngram tok/s | speed-up | acceptance | "
          "tokens/step | same output |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for task in tasks:
        plain, ngram = (statistics.median(times[(task, n)]) for n in ("plain", "ngram"))
        spread = "/".join(f"{x:.0f}" for x in times[(task, "ngram")])
        checked, accepted = drafts[task]
        n_out = len(outputs[(task, "ngram")])
        print(f"| {task} | {len(prompts[task])} | {n_out} | {plain:.1f} | {ngram:.1f} ({spread}) | "
              f"{ngram / plain:.2f}x | {accepted}/{checked} = {accepted / max(checked, 1):.0%} | "
              f"{(n_out - 1) / max(steps[task], 1):.2f} | "
              f"{'yes' if outputs[(task, 'plain')] == outputs[(task, 'ngram')] else 'NO'} |")


if __name__ == "__main__":
    main()
