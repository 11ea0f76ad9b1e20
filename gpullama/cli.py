"""The `gpullama` command: generate, chat, serve, pull, list and info.

Arguments that can be checked without the model are checked before it loads (one-line errors, exit status 2);
torch is imported only by the commands that load a model, so ``--help``, ``info`` and ``list`` answer at once.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from gpullama import __version__
from gpullama.engine.args import EngineArgs, positive_int
from gpullama.hub import ALIASES, DEFAULT_MODEL, cached_models, pull, resolve_model

CHAT_HELP = """commands:
  /help           this text
  /system TEXT    set the system prompt (kept by /reset)
  /image PATH     attach an image to your next message (a model with an mmproj)
  /reset          forget the conversation
  /exit           leave (also Ctrl-D, or Ctrl-C at an empty prompt)
Ctrl-C while the model answers stops that answer; the conversation is kept."""


def _add_sampling(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=positive_int, default=max_tokens, help=f"(default {max_tokens})")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop before this text (repeat the flag for several)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--system", default=None, help="system prompt (generate: render the prompt as a chat)")


def _checked(args: argparse.Namespace):
    """The engine arguments and sampling parameters, checked before anything loads."""
    from gpullama.sampling_params import SamplingParams

    engine_args = EngineArgs.from_cli_args(args)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, stop=args.stop, ignore_eos=args.ignore_eos,
        seed=args.seed,
    )
    if engine_args.max_model_len is not None and args.max_tokens >= engine_args.max_model_len:
        raise ValueError(f"--max-tokens {args.max_tokens} leaves no room for a prompt within --max-model-len "
                         f"{engine_args.max_model_len}")
    return engine_args, params


class LoadingLine:
    """``loading MODEL: STEP ... Ns`` on one terminal line, shown at once, redrawn as each loading step starts and
    every second; nothing when stderr is not a terminal. `progress` is the loader's ``on_progress``."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.step = "starting"
        self.started = time.perf_counter()
        self.shown = sys.stderr.isatty()
        self._done = threading.Event()
        self._lock = threading.Lock()

    def __enter__(self) -> LoadingLine:
        if self.shown:
            self._draw()
            threading.Thread(target=self._tick, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self.shown:
            with self._lock:
                sys.stderr.write("\r\033[K")
                sys.stderr.flush()

    def progress(self, step: str) -> None:
        """A new loading step began."""
        self.step = step
        if self.shown:
            self._draw()

    def _draw(self) -> None:
        with self._lock:
            if not self._done.is_set():
                elapsed = time.perf_counter() - self.started
                sys.stderr.write(f"\r\033[Kloading {self.model}: {self.step} ... {elapsed:.0f}s")
                sys.stderr.flush()

    def _tick(self) -> None:
        while not self._done.wait(1.0):
            self._draw()


def _load(engine_args: EngineArgs):
    """Load the model, showing its loading steps and the seconds on a terminal."""
    from gpullama.llm import LLM

    with LoadingLine(engine_args.model) as line:
        llm = LLM.from_engine_args(engine_args, on_progress=line.progress)
    if line.shown:
        print(f"loaded {llm.model_name} on {llm.device} in {time.perf_counter() - line.started:.1f}s", file=sys.stderr)
    return llm


def _say_why_it_stopped(reason: str | None, max_tokens: int) -> None:
    if reason == "length":
        print(f"[cut at --max-tokens {max_tokens} or the context limit]", file=sys.stderr)


def _stream(llm, prompt, params) -> str | None:
    """Write one completion to stdout as it comes; returns its finish reason."""
    pieces = llm.stream(prompt, params)
    while True:
        try:
            piece = next(pieces)
        except StopIteration as stop:
            return stop.value
        sys.stdout.write(piece)
        sys.stdout.flush()


def cmd_generate(args) -> int:
    """Stream one completion of --prompt to stdout."""
    engine_args, params = _checked(args)
    llm = _load(engine_args)
    prompt = args.prompt
    if args.system is not None or args.image:
        content = [*({"type": "image", "image": Path(p)} for p in args.image), {"type": "text", "text": args.prompt}]
        prompt = [*([{"role": "system", "content": args.system}] if args.system is not None else []),
                  {"role": "user", "content": content if args.image else args.prompt}]
    reason = _stream(llm, prompt, params)
    sys.stdout.write("\n")
    _say_why_it_stopped(reason, params.max_tokens)
    return 0


class ChatSession:
    """An interactive conversation: slash commands, Ctrl-C handling, and the messages sent to the model."""

    def __init__(self, llm, params, system: str | None):
        self.llm = llm
        self.params = params
        self.system = system
        self.messages: list[dict] = []
        self.images: list[Path] = []  # attached to the next user message (--image, /image PATH)

    def conversation(self) -> list[dict[str, str]]:
        """What the model sees: the system prompt, then the turns so far."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages

    def command(self, line: str) -> bool:
        """Run a slash command; False when it asks to leave."""
        name, _, rest = line.partition(" ")
        if name in ("/exit", "/quit", "/bye"):
            return False
        if name == "/reset":
            self.messages = []
            print("(conversation cleared)", file=sys.stderr)
        elif name == "/system":
            self.system = rest.strip() or None
            print(f"(system prompt {'set' if self.system else 'cleared'})", file=sys.stderr)
        elif name == "/image":
            path = Path(rest.strip()).expanduser()
            if not path.is_file():
                print(f"no such file: {path}", file=sys.stderr)
            else:
                self.images.append(path)
                print(f"(image {path.name} goes with your next message)", file=sys.stderr)
        elif name == "/help":
            print(CHAT_HELP, file=sys.stderr)
        else:
            print(f"unknown command {name}; /help lists them", file=sys.stderr)
        return True

    def answer(self, text: str) -> None:
        """Send one user turn and stream the reply; Ctrl-C stops the reply and keeps what came so far."""
        images, self.images = self.images, []
        content = [*({"type": "image", "image": p} for p in images), {"type": "text", "text": text}]
        self.messages.append({"role": "user", "content": content if images else text})
        reply: list[str] = []
        reason = None
        pieces = self.llm.stream(self.conversation(), self.params)
        try:
            while True:
                try:
                    piece = next(pieces)
                except StopIteration as stop:
                    reason = stop.value
                    break
                except ValueError as exc:  # the turn cannot run (an unreadable image, no mmproj): say so, drop it
                    print(f"error: {exc}", file=sys.stderr)
                    self.messages.pop()
                    return
                reply.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            pieces.close()  # frees the request in the engine
            reason = "interrupted"
        sys.stdout.write("\n")
        if reason == "interrupted":
            print("[stopped]", file=sys.stderr)
        _say_why_it_stopped(reason, self.params.max_tokens)
        self.messages.append({"role": "assistant", "content": "".join(reply)})

    def run(self) -> None:
        """Read lines until /exit, Ctrl-D, or Ctrl-C at the prompt."""
        try:
            import readline  # noqa: F401 - line editing and history for input()
        except ImportError:
            pass
        print(f"chatting with {self.llm.model_name}; /help for commands, Ctrl-D to quit", file=sys.stderr)
        while True:
            try:
                line = input("> ")
            except (EOFError, KeyboardInterrupt):
                sys.stdout.write("\n")
                return
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                if not self.command(text):
                    return
                continue
            self.answer(text)


def cmd_chat(args) -> int:
    """Interactive chat through the model's template."""
    engine_args, params = _checked(args)
    session = ChatSession(_load(engine_args), params, args.system)
    session.images = [Path(p) for p in args.image]
    session.run()
    return 0


def int_list(text: str) -> list[int]:
    """An argparse type: comma-separated integers >= 0, such as ``128,512``."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 0 separated by commas, got {text!r}")
    return values


BENCH_SETS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching")  # bench's own


def cmd_bench(args) -> int:
    """Time prefill (pp) and decode (tg) and print llama-bench's table."""
    engine_args = EngineArgs.from_cli_args(args)
    if not any(args.n_prompt) and not any(args.n_gen):
        raise ValueError("nothing to time: -p and -n are both 0")
    from gpullama.bench import PpTg, copy_bandwidth, read_bandwidth, run, table

    kwargs = {name: getattr(engine_args, name)
              for name in ("kv_cache_memory", "kv_cache_dtype", "block_size", "enforce_eager", "cpu_activation_bits")}
    with LoadingLine(engine_args.model) as line:
        bench = PpTg(engine_args.model, engine_args.dtype, engine_args.device, max(args.n_prompt),
                     max(args.n_gen), engine_args.threads, on_progress=line.progress, n_depth=max(args.n_depth),
                     **kwargs)
    rows = run(bench, args.n_prompt, args.n_gen, args.repetitions, args.n_depth)
    bandwidth = read_bandwidth() if bench.llm.device.type == "cpu" else None
    print(table(bench, rows, bandwidth))
    if bandwidth:
        print(f"\nmemory bandwidth: read {bandwidth / 1e9:.1f} GB/s (a streaming read of 512 MiB by "
              f"{torch_threads()} threads, best of 5), copy {copy_bandwidth() / 1e9:.1f} GB/s; "
              f"% read BW: the bytes a tg token reads (matrices {decode_mb(bench):.1f} MB, KV "
              f"{bench.kv_bytes_per_position() / 1024:.1f} KiB a context position) x t/s over the read bandwidth")
    return 0


def torch_threads() -> int:
    """torch's intra-op threads (what the model was loaded with)."""
    import torch

    return torch.get_num_threads()


def decode_mb(bench) -> float:
    """MB of weights one decode token of `bench`'s model reads."""
    from gpullama.bench import decode_weight_bytes

    return decode_weight_bytes(bench.llm.path) / 1e6


def cmd_pull(args) -> int:
    """Download an aliased model into the cache."""
    print(pull(args.alias))
    return 0


def cmd_list(args) -> int:
    """The GGUF models in the local caches: name, size, main weight type, path."""
    from gpullama.gguf_file import ModelFileError, read_header

    rows = []
    for name, path in cached_models():
        try:
            header = read_header(str(path))
            kind = Counter(t.qtype.name for t in header.tensors if len(t.shape) == 2).most_common(1)[0][0]
        except (ModelFileError, IndexError):
            kind = "?"
        rows.append((name, f"{path.stat().st_size / 1e6:.0f} MB", kind, str(path)))
    if not rows:
        print("no models in the cache yet: `gpullama pull smollm2-135m`", file=sys.stderr)
        return 0
    widths = [max(len(r[i]) for r in rows + [("NAME", "SIZE", "TYPE", "PATH")]) for i in range(3)]
    for row in [("NAME", "SIZE", "TYPE", "PATH"), *rows]:
        print("  ".join(f"{v:<{w}}" for v, w in zip(row[:3], widths)) + "  " + row[3])
    return 0


def kv_per_token(c) -> str:
    """KV cache bytes of one token of model config `c` in each cache format (k and v of every layer with attention;
    multi-head latent attention: its one row a layer, rotary part and latent)."""
    if c.is_mla:
        values = c.num_layers * c.head_dim
        return (f"{values * 4 / 1024:.1f} KiB float32, {values * 2 / 1024:.1f} KiB float16 (latent attention: "
                f"{c.kv_lora_rank} latent + {c.rotary_dim} rope values a layer, no values cached)")
    from gpullama.kernels import CPU_MAX_HEAD_DIM as MAX_HEAD_DIM  # no torch: cpu_native imports it

    values = c.kv_values_per_token
    dims = {c.layer_head_dim(i) for i in c.kv_layers}
    kernel = all(d % 16 == 0 and d <= MAX_HEAD_DIM for d in dims)  # the C attention takes every pool: float16 default
    sizes = [f"{values * 2 / 1024:.1f} KiB float16" + (" (the CPU fast path's default)" if kernel else ""),
             f"{values * 4 / 1024:.1f} KiB float32" + ("" if kernel else " (the CPU fast path's default)")]
    if kernel and all(d % 32 == 0 for d in dims):
        sizes.insert(1, f"{values * 34 / 32 / 1024:.1f} KiB q8_0")
    return ", ".join(sizes)


def state_per_sequence(c) -> int:
    """Bytes of one sequence's recurrent states (float32; `ModelConfig.state_shapes` of every layer)."""
    return 4 * sum(math.prod(shape) for i in range(c.num_layers) for shape in c.state_shapes(i))


def checkpoints_line(c) -> str:
    """What prefix caching's recurrent-state checkpoints cost for this model, in words."""
    from gpullama.engine.state_checkpoints import CHECKPOINT_MEMORY_SHARE, CHECKPOINTS_PER_SEQ

    seqs = EngineArgs.max_num_seqs
    count = CHECKPOINTS_PER_SEQ * seqs
    return (f"prefix caching keeps copies of a sequence's state at block boundaries, {state_per_sequence(c) / 1024:.1f}"
            f" KiB each, taken from the KV cache's memory: --state-checkpoints N (default {CHECKPOINTS_PER_SEQ} per "
            f"--max-num-seqs, {count} = {count * state_per_sequence(c) / 2**20:.1f} MiB at {seqs}, within "
            f"{CHECKPOINT_MEMORY_SHARE:.0%} of the KV cache's memory; 0: no prefix caching)")


def state_contents(c) -> str:
    """What a sequence's recurrent state holds, in words."""
    parts = []
    if any(c.conv_layers):
        parts.append(f"the last {c.conv_kernel - 1} inputs of each short convolution")
    if any(c.delta_layers):
        parts.append(f"each delta-net's last {c.conv_kernel - 1} convolution inputs and {c.ssm_heads} state matrices "
                     f"of {c.ssm_state_size} x {c.ssm_inner_size // c.ssm_heads}")
    if any(c.mamba_layers):
        parts.append(f"each Mamba2 layer's last {c.conv_kernel - 1} convolution inputs and {c.ssm_heads} state "
                     f"matrices of {c.ssm_state_size} x {c.ssm_inner_size // c.ssm_heads}")
    return ", ".join(parts)


def modalities(model_path: str, config, mmproj: str | None = None) -> str:
    """What a model reads: text, and images when its mmproj (named, or the one beside it) fits it."""
    from gpullama.gguf_file import ModelFileError, read_header
    from gpullama.vision.loading import ARCHITECTURES, EXPECTS_MMPROJ, find_mmproj
    from gpullama.vision.projectors import PROJECTORS, describe_projector, projector_type

    path = mmproj or find_mmproj(model_path)
    if path is None:
        return "text (no mmproj file beside it)" if config.architecture in EXPECTS_MMPROJ else "text"
    try:
        meta = read_header(path, text_model=False).metadata
    except ModelFileError as exc:
        return f"text ({Path(path).name}: {exc})"
    projector, dim = projector_type(meta), meta.get("clip.vision.projection_dim")
    if projector not in PROJECTORS:
        return (f"text ({Path(path).name}: projector {projector} is not supported; gpullama reads "
                f"{', '.join(PROJECTORS)})")
    if projector not in ARCHITECTURES.get(config.architecture, ()) or dim != config.hidden_size:
        return f"text ({Path(path).name}: projector {projector} does not fit this model)"
    return f"text, image ({Path(path).name}: {describe_projector(meta)})"


def cmd_info(args) -> int:
    """Print what a GGUF model is (from its header only): architecture, size, tensor types, context, template."""
    from gpullama.gguf_file import model_size, read_header

    h = read_header(resolve_model(args.model, download=False))
    c, meta = h.config, h.metadata
    size = model_size(h)
    types = Counter(t.qtype.name for t in h.tensors)
    vocab = f"{c.vocab_size} ({meta.get('tokenizer.ggml.model')}, pre {meta.get('tokenizer.ggml.pre')})"
    rows = [
        ("file", h.path),
        ("name", meta.get("general.name", "")),
        ("architecture", c.architecture),
        ("parameters", f"{size.parameters / 1e6:.1f}M"),
    ]
    if c.is_moe:
        shared = f", a shared expert of {c.shared_expert_intermediate_size} rows" if c.shared_expert_intermediate_size else ""
        rows += [
            ("experts", f"{c.num_experts}, {c.num_experts_used} a token, {c.expert_intermediate_size} rows each{shared} "
                        f"({size.expert_parameters / 1e6:.1f}M parameters)"),
            ("active parameters", f"{size.active_parameters / 1e6:.1f}M a token"),
        ]
    rows += [
        ("weights", f"{size.bytes / 1e6:.1f} MB, {size.active_bytes / 1e6:.1f} MB read a token"),
        ("layers", c.num_layers),
        ("hidden size", c.hidden_size),
        ("heads / kv heads / head dim", f"{c.num_heads} / {c.num_kv_heads} / {c.head_dim}" + (
            f" (sliding layers: {c.num_kv_heads_swa or c.num_kv_heads} kv heads of {c.head_dim_swa})"
            if c.head_dim_swa else "")) if not c.is_mla else
        ("latent attention", f"{c.num_heads} heads of {c.qk_nope_dim} + {c.rotary_dim} rope key dims and "
                             f"{c.v_head_dim} value dims, over one cached row of {c.kv_lora_rank} latent + "
                             f"{c.rotary_dim} rope values" + (f"; queries through rank {c.q_lora_rank}"
                                                              if c.q_lora_rank else "")),
        ("vocabulary", vocab),
        ("context length", c.context_length),
        ("KV cache a token", kv_per_token(c) + (f" ({len(c.kv_layers)} of the {c.num_layers} layers" + (
            f"; the last {c.kv_shared_layers} reuse earlier layers' K/V" if c.kv_shared_layers else "") + ")"
            if len(c.kv_layers) < c.num_layers else "")),
        *([("recurrent state", f"{state_per_sequence(c) / 1024:.1f} KiB a sequence, float32 (in "
                               f"{c.recurrent_layers_named}: {state_contents(c)})"),
           ("state checkpoints", checkpoints_line(c))] if c.has_recurrent_state else []),
        ("tensor types", ", ".join(f"{k} x{v}" for k, v in types.most_common())),
        ("chat template", "yes" if meta.get("tokenizer.chat_template") else "no (ChatML fallback)"),
        ("modalities", modalities(h.path, c, args.mmproj)),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `gpullama`."""
    parser = argparse.ArgumentParser(prog="gpullama", description="LLM inference for GGUF models")
    parser.add_argument("--version", action="version", version=f"gpullama {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("generate", help="complete a prompt, streaming to stdout")
    EngineArgs.add_cli_args(p)
    p.add_argument("--prompt", "-p", required=True)
    _add_sampling(p, max_tokens=128)
    p.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="an image before the prompt (a model with an mmproj; repeat for more)")
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("chat", help="interactive chat (/help inside for its commands)")
    EngineArgs.add_cli_args(p)
    _add_sampling(p, max_tokens=512)
    p.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="an image to go with your first message (a model with an mmproj; /image PATH later)")
    p.set_defaults(func=cmd_chat)
    p = sub.add_parser("serve", help="the OpenAI-compatible server (gpullama-serve; `serve --help` for its flags)",
                       add_help=False)
    p = sub.add_parser("bench", help="prefill and decode tokens/s in llama-bench's table")
    EngineArgs.add_cli_args(p, skip=BENCH_SETS)
    p.add_argument("-p", "--n-prompt", type=int_list, default=[512], metavar="N[,N...]",
                   help="prompt lengths to prefill, each a pp row (default 512; 0 for none)")
    p.add_argument("-n", "--n-gen", type=int_list, default=[128], metavar="N[,N...]",
                   help="tokens to generate, each a tg row (default 128; 0 for none)")
    p.add_argument("-d", "--n-depth", type=int_list, default=[0], metavar="N[,N...]",
                   help="tokens of context before each test, each depth a set of rows (default 0; llama-bench's -d)")
    p.add_argument("-r", "--repetitions", type=positive_int, default=5, help="timed runs of each test (default 5)")
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("pull", help="download an aliased model into the cache")
    p.add_argument("alias", choices=sorted(ALIASES))
    p.set_defaults(func=cmd_pull)
    p = sub.add_parser("list", help="models in the local cache")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("info", help="describe a GGUF model (reads its header only)")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    p.add_argument("--mmproj", default=None, help="the model's vision projector (default: the mmproj*.gguf beside it)")
    p.set_defaults(func=cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `gpullama` console script."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # every flag after it is gpullama-serve's, --help included
        from gpullama.server.cli import main as serve_main

        return serve_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per HTTP request is not news to a person
    try:
        return args.func(args)
    except (ValueError, RuntimeError) as exc:  # bad input: one clear line, no traceback
        print(f"gpullama: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
