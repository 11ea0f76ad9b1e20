"""Does the chat page add to the server's time to first token? The same request, in alternating rounds, sent by
the page (typed in headless Chromium, streamed over its own fetch) and by the openai SDK (stream=True); for each,
the client's time to first token (the page's own measure, read from its stored message; the SDK's from the call to
its first content chunk) and the server's (its access log: arrival to first token). Run the server with
``--no-prefix-caching`` so that no round reuses another's prompt.

Usage: gpullama-serve --port 8091 --no-prefix-caching --log-level info > /tmp/serve.log 2>&1 &
       python benchmarks/bench_webui_ttft.py --url http://127.0.0.1:8091 --log /tmp/serve.log --rounds 8
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import openai
from playwright.sync_api import sync_playwright

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_name  # noqa: E402

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
PROMPT = "In one sentence, what is {topic}?"
TOPICS = ["a river", "a violin", "a glacier", "a comet", "a library", "a volcano", "a lighthouse", "a bridge",
          "a desert", "a forest", "a harbor", "a canyon"]
MAX_TOKENS = 16
READ_TTFT = """async () => {
  const db = await new Promise((ok, no) => { const r = indexedDB.open('gpullama', 1);
    r.onsuccess = () => ok(r.result); r.onerror = () => no(r.error); });
  const all = await new Promise((ok) => { const r = db.transaction('conversations').objectStore('conversations')
    .getAll(); r.onsuccess = () => ok(r.result); });
  all.sort((a, b) => b.updated - a.updated);
  return all[0].messages.at(-1).timings.ttftMs;
}"""


def server_ttfts(log: Path) -> list[float]:
    """Every chat completion's "first token X s" in the access log, in order."""
    return [float(m[1]) * 1000 for m in re.finditer(r'"POST /v1/chat/completions HTTP/1\.1" 200 .*?first token '
                                                    r'([\d.]+)s', log.read_text())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8091")
    parser.add_argument("--log", type=Path, required=True, help="the server's log file (its access lines)")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    results: dict[str, list[tuple[float, float]]] = {"page": [], "sdk": []}
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=shutil.which("chromium"), args=FLAGS)
        context = browser.new_context()
        settings = json.dumps({"temperature": "0", "max_tokens": str(MAX_TOKENS)})
        context.add_init_script(f"localStorage.setItem('gpullama.settings', {json.dumps(settings)})")
        page = context.new_page()
        page.goto(args.url + "/")
        page.wait_for_function("() => document.getElementById('model-meta').textContent.includes('context')")

        def via_page(prompt: str) -> float:
            page.click("#new-chat")
            page.fill("#prompt", prompt)
            page.press("#prompt", "Enter")
            page.wait_for_function("() => !document.querySelector('.message.assistant.streaming') && "
                                   "document.querySelector('.message.assistant .timings').textContent",
                                   timeout=300_000)
            return page.evaluate(READ_TTFT)

        def via_sdk(prompt: str) -> float:
            start = time.perf_counter()
            first = None
            stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                    temperature=0, max_tokens=MAX_TOKENS, stream=True,
                                                    stream_options={"include_usage": True})
            for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = (time.perf_counter() - start) * 1000
            return first

        via_page("Hello")  # warm-up, not counted: the first request compiles and fills caches
        via_sdk("Hello")
        for i in range(args.rounds):
            prompt = PROMPT.format(topic=TOPICS[i % len(TOPICS)])
            order = ("page", "sdk") if i % 2 == 0 else ("sdk", "page")
            for who in order:
                before = len(server_ttfts(args.log))
                client_ms = via_page(prompt) if who == "page" else via_sdk(prompt)
                deadline = time.monotonic() + 10
                while len(server_ttfts(args.log)) == before and time.monotonic() < deadline:
                    time.sleep(0.05)
                results[who].append((client_ms, server_ttfts(args.log)[-1]))
        browser.close()

    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"{datetime.date.today()}, {cpu_name()}, {os.cpu_count()} cores; uptime: {uptime}")
    print(f"{args.rounds} rounds, alternating; the prompt differs per round, the same for both within it; "
          f"max_tokens {MAX_TOKENS}, temperature 0\n")
    print("| client | client TTFT median (ms) | min-max | server TTFT median (ms) | min-max |")
    print("|---|---:|---:|---:|---:|")
    for who, label in (("page", "chat page (Chromium)"), ("sdk", "openai SDK")):
        client_ms = [c for c, _ in results[who]]
        server_ms = [s for _, s in results[who]]
        print(f"| {label} | {statistics.median(client_ms):.0f} | {min(client_ms):.0f}-{max(client_ms):.0f} | "
              f"{statistics.median(server_ms):.0f} | {min(server_ms):.0f}-{max(server_ms):.0f} |")
    print("\nper round (client ms / server ms):")
    for i, (p, s) in enumerate(zip(results["page"], results["sdk"])):
        print(f"  round {i}: page {p[0]:.0f} / {p[1]:.0f}, sdk {s[0]:.0f} / {s[1]:.0f}")


if __name__ == "__main__":
    main()
