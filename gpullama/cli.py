"""The `gpullama` command: generate, chat, pull and info."""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections import Counter

from gpullama.engine.args import EngineArgs
from gpullama.hub import ALIASES, DEFAULT_MODEL, pull, resolve_model


def _add_sampling(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def _sampling(args):
    from gpullama.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )


def _load(args):
    from gpullama.llm import LLM

    return LLM.from_engine_args(EngineArgs.from_cli_args(args))


def cmd_generate(args) -> int:
    """Stream one completion of --prompt to stdout."""
    params = _sampling(args)
    llm = _load(args)
    for piece in llm.stream(args.prompt, params):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_chat(args) -> int:
    """Interactive chat through the model's template; an empty line or EOF ends it."""
    params = _sampling(args)
    llm = _load(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print(f"chatting with {llm.model_name} (empty line or Ctrl-D to quit)", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        reply = []
        for piece in llm.stream(messages, params):
            reply.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def cmd_pull(args) -> int:
    """Download an aliased model into the cache."""
    print(pull(args.alias))
    return 0


def cmd_info(args) -> int:
    """Print what a GGUF model is: architecture, size, tensor types, context, template."""
    from gpullama.gguf_file import read_gguf

    m = read_gguf(resolve_model(args.model))
    c = m.config
    params = sum(math.prod(t.shape) for t in m.tensors.values())
    types = Counter(t.qtype.name for t in m.tensors.values())
    rows = [
        ("file", m.path),
        ("name", m.metadata.get("general.name", "")),
        ("architecture", c.architecture),
        ("parameters", f"{params / 1e6:.1f}M"),
        ("layers", c.num_layers),
        ("hidden size", c.hidden_size),
        ("heads / kv heads / head dim", f"{c.num_heads} / {c.num_kv_heads} / {c.head_dim}"),
        ("vocabulary", f"{c.vocab_size} ({m.metadata.get('tokenizer.ggml.model')}, pre {m.metadata.get('tokenizer.ggml.pre')})"),
        ("context length", c.context_length),
        ("tensor types", ", ".join(f"{k} x{v}" for k, v in types.most_common())),
        ("chat template", "yes" if m.metadata.get("tokenizer.chat_template") else "no (ChatML fallback)"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `gpullama`."""
    parser = argparse.ArgumentParser(prog="gpullama", description="LLM inference for GGUF models")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("generate", help="complete a prompt, streaming to stdout")
    EngineArgs.add_cli_args(p)
    p.add_argument("--prompt", "-p", required=True)
    _add_sampling(p, max_tokens=128)
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("chat", help="interactive chat")
    EngineArgs.add_cli_args(p)
    p.add_argument("--system", default=None, help="system prompt")
    _add_sampling(p, max_tokens=512)
    p.set_defaults(func=cmd_chat)
    p = sub.add_parser("pull", help="download an aliased model into the cache")
    p.add_argument("alias", choices=sorted(ALIASES))
    p.set_defaults(func=cmd_pull)
    p = sub.add_parser("info", help="describe a GGUF model")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    p.set_defaults(func=cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `gpullama` console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except (ValueError, RuntimeError) as exc:  # bad input: one clear line, no traceback
        print(f"gpullama: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
