"""GPU check: TritonOps against TorchOps on a random Llama-3.2-1B-shaped decoder, and decode timings.

Builds the weights on the device itself (bf16, Q8_0, Q4_K random valid blocks; the moe-* formats a
Qwen3-30B-A3B-shaped mixture-of-experts decoder, 4 layers of its 48, with Q8_0 or MXFP4 experts through the fused
MoE kernel; mla-q8_0 a DeepSeek-V2-Lite-shaped one, 4 layers of its 27: multi-head latent attention over its latent
pool, sigmoid routing, a shared expert; lfm2-q8_0 an LFM2-1.2B-shaped one: short convolutions with their state
slots beside attention layers; qwen35-q8_0 a Qwen3.5-0.8B-shaped one: gated delta-nets beside gated attention;
granitehybrid-q8_0 a Granite-4.0-H-350M-shaped one: Mamba2 layers beside attention without rotary),
compares the logits of a prefill
and a decode step between the Triton kernels and the torch path, then times one decode step at each batch size:
Triton eager, Triton replayed from the CUDA graphs of `gpullama.engine.decode_graphs.DecodeGraphs` (the model
runner's decode path), and
torch eager.
Vision (`--towers gemma3`): a Gemma-3-4B-shaped random vision tower (F16 matrices, as mmproj files are published)
encodes one 896x896 image of random pixels with TritonOps (float32 and bf16) and TorchOps bf16 against TorchOps
float32 on the same device, then the bf16 encode is timed (Triton, torch).
Prints markdown tables last; everything else goes to the log. `--tiny --device cpu` runs the same code at
toy shapes (set TRITON_INTERPRET=1) to check the script itself without a GPU.
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpullama.model import Decoder  # noqa: E402
from gpullama.ops import TorchOps  # noqa: E402
from gpullama.ops.triton_ops import TritonOps  # noqa: E402
from tests.kernel_tests.random_model import (  # noqa: E402
    GEMMA3_4B_TOWER,
    TINY_TOWER,
    batch_metadata,
    deepseek_v2_lite_config,
    gpt_oss_like_config,
    granite_h_350m_config,
    granite_hybrid_like_config,
    lfm2_1b_config,
    lfm2_like_config,
    llama_1b_config,
    mla_like_config,
    qwen3_moe_config,
    qwen35_08b_config,
    qwen35_like_config,
    random_gemma3_tower,
    random_tensors,
    tiny_config,
)

Q = gguf.GGMLQuantizationType
FORMATS = {"bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_k": Q.Q4_K, "moe-q8_0": Q.Q8_0, "moe-mxfp4": Q.MXFP4,
           "mla-q8_0": Q.Q8_0, "lfm2-q8_0": Q.Q8_0, "qwen35-q8_0": Q.Q8_0,
           "granitehybrid-q8_0": Q.Q8_0}
"""Weight formats; moe-*: the MoE decoder, its experts in that type, the other matrices Q8_0; mla-q8_0: the
latent-attention MoE decoder in Q8_0; lfm2-q8_0: the short-convolution hybrid in Q8_0; qwen35-q8_0: the
gated delta-net hybrid in Q8_0; granitehybrid-q8_0: the Mamba2 hybrid in Q8_0 (--tiny: with experts)."""
TOWERS = {"gemma3": (GEMMA3_4B_TOWER, Q.F16)}
"""Vision towers checked (--towers): their shape (--tiny: `TINY_TOWER`) and the type of their block matrices."""
log = logging.getLogger("gpu_check")


@dataclass
class Row:
    """One line of the result table."""

    fmt: str
    batch: int
    path: str
    ms: float
    weight_gb: float
    floor_ms: float
    tok_s: float | None = None  # measured throughput where it is not batch / step time (the served rows)

    def markdown(self) -> str:
        """The row as a markdown table line."""
        tok_s = self.tok_s if self.tok_s is not None else self.batch / (self.ms / 1e3)
        return (f"| {self.fmt} | {self.batch} | {self.path} | {self.ms:.3f} | {tok_s:,.0f} | "
                f"{self.weight_gb:.2f} | {100 * self.floor_ms / self.ms:.0f}% |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line of the check."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda, or cpu with TRITON_INTERPRET=1 and --tiny")
    p.add_argument("--formats", default="bf16,q8_0,q4_k,moe-q8_0,moe-mxfp4,mla-q8_0,lfm2-q8_0,qwen35-q8_0,"
                   "granitehybrid-q8_0",
                   help=f"comma list of {', '.join(FORMATS)}")
    p.add_argument("--moe-layers", type=int, default=4,
                   help="layers of the Qwen3-30B-A3B-shaped and DeepSeek-V2-Lite-shaped MoE decoders")
    p.add_argument("--batches", default="1,8,64", help="decode batch sizes to time")
    p.add_argument("--context", type=int, default=512, help="context length of every sequence while timing")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--iters", type=int, default=50, help="timed decode steps per measurement")
    p.add_argument("--bandwidth", type=float, default=4.3e12, help="copy bandwidth in bytes/s for the floor")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="dense bf16 tensor-core peak in TFLOP/s for the vision encode's floor (H100 SXM, H200: 989)")
    p.add_argument("--towers", default="gemma3", help=f"comma list of vision towers to check ({', '.join(TOWERS)}); "
                   "empty: none")
    p.add_argument("--tiny", action="store_true", help="toy shapes (1 layer, hidden 256) instead of Llama-3.2-1B")
    p.add_argument("--no-torch-timing", action="store_true", help="skip timing the torch eager path")
    p.add_argument("--log", default="gpu_check.log", help="file for the full log")
    args = p.parse_args(argv)
    args.formats = [f.strip().lower() for f in args.formats.split(",") if f.strip()]
    unknown = [f for f in args.formats if f not in FORMATS]
    if unknown:
        p.error(f"unknown format(s) {', '.join(unknown)}; choose from {', '.join(FORMATS)}")
    args.towers = [t.strip().lower() for t in args.towers.split(",") if t.strip()]
    unknown = [t for t in args.towers if t not in TOWERS]
    if unknown:
        p.error(f"unknown tower(s) {', '.join(unknown)}; choose from {', '.join(TOWERS)}")
    args.batches = [int(b) for b in args.batches.split(",")]
    if any(b < 1 for b in args.batches) or args.context < 2 or args.iters < 1:
        p.error("batches, iters must be >= 1 and context >= 2")
    return args


def make_pools(config, num_seqs: int, context: int, block_size: int, device, dtype) -> tuple[list, list]:
    """Random-filled k/v pools (per layer) for `num_seqs` sequences of `context` tokens, plus one scratch block (no
    v pools for latent attention)."""
    blocks = num_seqs * -(-context // block_size) + 1
    shape = (blocks, block_size, config.num_kv_heads, config.head_dim)
    g = torch.Generator(device=device).manual_seed(5)
    k = [torch.randn(shape, device=device, generator=g).to(dtype) for _ in config.kv_layers]
    v = [torch.randn(shape, device=device, generator=g).to(dtype)
         for _ in (config.kv_layers if config.separate_values else ())]
    return k, v


def with_state_slots(meta, decoder):
    """`meta` with sequence i in state slot i when the decoder has recurrent layers (their states: slot count =
    sequences + 1, the last the scratch slot DecodeGraphs pads with)."""
    if decoder.config.has_recurrent_state:
        meta.state_slots = torch.arange(meta.seq_lens.shape[0], device=meta.seq_lens.device)
    return meta


def synchronize(device: torch.device) -> None:
    """Wait for the device."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(step, device: torch.device, iters: int) -> float:
    """Milliseconds per call of `step` after warm-up (CUDA events on the GPU, wall clock elsewhere)."""
    for _ in range(3):
        step()
    synchronize(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            step()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    return (time.perf_counter() - t0) * 1e3 / iters


def run_logits(ops: TorchOps, config, tensors, block_size: int) -> torch.Tensor:
    """Logits of a 2-sequence prefill (16 and 8 tokens) then one decode step, with `ops`, float32."""
    decoder = Decoder(config, tensors, ops, max_positions=64)
    pool_dtype = torch.float32 if ops.dtype == torch.float32 else torch.bfloat16
    k, v = make_pools(config, 2, 40, block_size, ops.device, pool_dtype)
    states = decoder.new_states(3)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, config.vocab_size, (24,), generator=g).to(ops.device)
    step = torch.randint(0, config.vocab_size, (2,), generator=g).to(ops.device)
    first = decoder.forward(prompt, with_state_slots(batch_metadata([16, 8], [16, 8], block_size, ops.device), decoder),
                            k, v, states)
    second = decoder.forward(step, with_state_slots(batch_metadata([17, 9], [1, 1], block_size, ops.device), decoder),
                             k, v, states)
    return torch.cat([first, second]).float()


def compare_logits(config, tensors, device, block_size: int) -> dict[str, float]:
    """Relative errors (max |a - ref| / max |ref|) against the float32 torch path: triton f32, triton and torch bf16."""
    reference = run_logits(TorchOps(device, torch.float32), config, tensors, block_size)
    errors = {}
    for label, ops in (("triton f32", TritonOps(device, torch.float32)), ("triton bf16", TritonOps(device, torch.bfloat16)),
                       ("torch bf16", TorchOps(device, torch.bfloat16))):
        got = run_logits(ops, config, tensors, block_size)
        errors[label] = float((got - reference).abs().max() / reference.abs().max()) if torch.isfinite(got).all() else float("inf")
        gc.collect()
    return errors


def decode_timings(args, config, tensors, fmt: str, device, dtype, rows: list[Row]) -> float:
    """Time one decode step per batch size with each path; appends rows of the table to `rows` as they come.
    Returns the largest relative difference between the DecodeGraphs logits and the eager step's."""
    graph_error = 0.0
    paths = [("triton", TritonOps(device, dtype))]
    if not args.no_torch_timing:
        paths.append(("torch eager", TorchOps(device, dtype)))
    for name, ops in paths:
        decoder = Decoder(config, tensors, ops, max_positions=args.context + 1)
        for batch in args.batches:
            weight_bytes = step_bytes(decoder, batch)
            floor_ms = weight_bytes / args.bandwidth * 1e3
            k, v = make_pools(config, batch, args.context, args.block_size, device, dtype)
            states = decoder.new_states(batch + 1)
            meta = with_state_slots(batch_metadata([args.context] * batch, [1] * batch, args.block_size, device),
                                    decoder)
            ids = torch.randint(0, config.vocab_size, (batch,), device=device)

            def step(decoder=decoder, ids=ids, meta=meta, k=k, v=v, states=states) -> torch.Tensor:
                return decoder.forward(ids, meta, k, v, states)

            ms = time_step(step, device, args.iters)
            rows.append(Row(fmt, batch, f"{name} eager" if name == "triton" else name, ms, weight_bytes / 1e9, floor_ms))
            log.info("%s", rows[-1].markdown())
            if name == "triton":
                label, graph_ms, error = _plan_time(decoder, k, v, states, ids, meta, device, args.iters)
                graph_error = max(graph_error, error)
                rows.append(Row(fmt, batch, label, graph_ms, weight_bytes / 1e9, floor_ms))
                log.info("%s", rows[-1].markdown())
            del k, v
            gc.collect()
        del decoder
    return graph_error


def _plan_time(decoder, k, v, states, ids, meta, device: torch.device, iters: int) -> tuple[str, float, float]:
    """(label, ms, error) of a decode step through `gpullama.engine.decode_graphs.DecodeGraphs`, the model runner's
    decode path (CUDA graphs on CUDA, padded static buffers run eagerly elsewhere), host inputs copied in each step;
    error: max |graph - eager| / max |eager| of the step's logits (the step rewrites the same k/v, so both agree)."""
    from gpullama.engine.decode_graphs import DecodeGraphs

    use_graphs = device.type == "cuda"
    batch = meta.seq_lens.shape[0]
    graphs = DecodeGraphs(decoder, k, v, max_num_seqs=batch, max_blocks_per_seq=meta.block_tables.shape[1],
                          scratch_block=k[0].shape[0] - 1, use_graphs=use_graphs, states=states,
                          scratch_state_slot=batch)
    slots = meta.state_slots.tolist() if meta.state_slots is not None else []
    host = (ids.tolist(), meta.positions.tolist(), meta.slot_mapping.tolist(), meta.block_tables.tolist(), slots)
    label = "triton graph (DecodeGraphs)" if use_graphs else "triton DecodeGraphs eager"
    saved = [s.clone() for s in states]  # the eager step and the graph start from the same states
    want = decoder.forward(ids, meta, k, v, states).float()
    for s, copy in zip(states, saved):
        s.copy_(copy)
    got = graphs.run(*host).float()
    error = float((got - want).abs().max() / want.abs().max()) if torch.isfinite(got).all() else float("inf")
    log.info("batch %d: DecodeGraphs logits vs eager: %.1e", batch, error)
    return label, time_step(lambda: graphs.run(*host), device, iters), error


def check_format(args, config, fmt: str, device: torch.device, dtype: torch.dtype, checks: list[str],
                 rows: list[Row]) -> None:
    """Logits check (a line appended to `checks`) and timing rows (appended to `rows`) of one format."""
    t0 = time.perf_counter()
    if fmt.startswith("moe-"):
        config = gpt_oss_like_config(vocab_size=300) if args.tiny else qwen3_moe_config(args.moe_layers)
        tensors = random_tensors(config, Q.Q8_0, device, seed=0, expert_qtype=FORMATS[fmt])
    elif fmt.startswith("mla-"):
        config = mla_like_config(vocab_size=300) if args.tiny else deepseek_v2_lite_config(args.moe_layers)
        tensors = random_tensors(config, FORMATS[fmt], device, seed=0)
    elif fmt.startswith("lfm2-"):
        config = lfm2_like_config(vocab_size=300) if args.tiny else lfm2_1b_config()
        tensors = random_tensors(config, FORMATS[fmt], device, seed=0)
    elif fmt.startswith("qwen35-"):
        config = qwen35_like_config(vocab_size=300) if args.tiny else qwen35_08b_config()
        tensors = random_tensors(config, FORMATS[fmt], device, seed=0)
    elif fmt.startswith("granitehybrid-"):
        config = granite_hybrid_like_config(vocab_size=300) if args.tiny else granite_h_350m_config()
        tensors = random_tensors(config, FORMATS[fmt], device, seed=0)
    else:
        tensors = random_tensors(config, FORMATS[fmt], device, seed=0)
    log.info("%s: built random weights in %.1f s", fmt, time.perf_counter() - t0)
    errors = compare_logits(config, tensors, device, args.block_size)
    # float32 kernels must match the float32 torch path; bf16 kernels must be no worse than torch in bf16
    ok = errors["triton f32"] < 1e-3 and errors["triton bf16"] <= max(2e-2, 1.5 * errors["torch bf16"])
    line = f"| {fmt} | {errors['triton f32']:.1e} | {errors['triton bf16']:.1e} | {errors['torch bf16']:.1e} | "
    checks.append(line + "not reached | FAIL |")  # kept if the timings fail or are stopped
    log.info("%s: logits errors vs torch float32 %s (%s)", fmt, errors, "ok" if ok else "FAIL")
    graph_error = decode_timings(args, config, tensors, fmt, device, dtype, rows)
    # the same kernels on the same inputs: replayed graphs must give the eager step's logits
    ok = ok and graph_error <= 1e-3
    checks[-1] = line + f"{graph_error:.1e} | {'ok' if ok else 'FAIL'} |"


def tower_flops(c) -> float:
    """Multiply-adds x 2 of one image through a SigLIP tower and its Gemma 3 head (`VisionConfig` `c`): the patch
    embedding, per block q|k|v, out, the MLP and the attention's two products, then the projection."""
    n, d, f = (c.image_size // c.patch_size) ** 2, c.hidden, c.ffn
    block = 2 * n * (4 * d * d + 2 * d * f) + 4 * n * n * d
    return 2 * n * 3 * c.patch_size ** 2 * d + c.layers * block + 2 * c.tokens_per_tile * d * c.projection_dim


def check_tower(args, name: str, device: torch.device, dtype: torch.dtype, checks: list[str], rows: list[Row]) -> None:
    """A random tower of `name`'s shape built on the device: one image's embeddings through TritonOps (float32 and
    `dtype`) and TorchOps `dtype` against TorchOps float32 (a line appended to `checks`), then the `dtype` encode
    timed with TritonOps and TorchOps (rows appended to `rows`)."""
    from gpullama.vision.tower import VisionTower

    shape, qtype = TOWERS[name]
    shape = TINY_TOWER if args.tiny else shape
    t0 = time.perf_counter()
    model = random_gemma3_tower(shape, qtype, device, seed=0)
    side = shape["image_size"]
    g = torch.Generator(device=device).manual_seed(7)
    pixels = torch.rand(1, 3, side, side, device=device, generator=g) * 2 - 1  # fresh, as preprocessed pixels are
    log.info("vision %s: built a random %dx%d-pixel tower in %.1f s", name, side, side, time.perf_counter() - t0)

    def encode(ops) -> torch.Tensor:
        out = VisionTower(f"random {name} tower", ops, model).encode(pixels)
        gc.collect()
        return out

    reference = encode(TorchOps(device, torch.float32))
    errors, absolute = {}, {}
    label = str(dtype).removeprefix("torch.").replace("bfloat16", "bf16")
    for what, ops in (("triton f32", TritonOps(device, torch.float32)), (f"triton {label}", TritonOps(device, dtype)),
                      (f"torch {label}", TorchOps(device, dtype))):
        got = encode(ops)
        finite = bool(torch.isfinite(got).all())
        absolute[what] = float((got - reference).abs().max()) if finite else float("inf")
        errors[what] = absolute[what] / float(reference.abs().max())
    # float32 kernels must match the float32 torch path; 16-bit kernels be no worse than torch in 16 bits
    ok = errors["triton f32"] < 1e-3 and errors[f"triton {label}"] <= max(2e-2, 1.5 * errors[f"torch {label}"])
    log.info("vision %s: max |error| %s, over max |value| %.3g: %s (%s)", name, absolute, float(reference.abs().max()),
             errors, "ok" if ok else "FAIL")
    fmt = f"vision-{name}-{qtype.name.lower()}"
    checks.append(f"| {fmt} | {errors['triton f32']:.1e} | {errors[f'triton {label}']:.1e} | "
                  f"{errors[f'torch {label}']:.1e} | {'ok' if ok else 'FAIL'} |")
    del reference
    paths = [("triton encode", TritonOps(device, dtype))]
    if not args.no_torch_timing:
        paths.append(("torch encode", TorchOps(device, dtype)))
    for what, ops in paths:
        tower = VisionTower(f"random {name} tower", ops, model)
        c = tower.config
        weight_bytes = sum(_nbytes(w) for blk in tower.blocks for w in (blk.qkv, blk.out, blk.up, blk.down))
        ms = time_step(lambda tower=tower: tower.encode(pixels), device, args.iters)
        floor_ms = tower_flops(c) / (args.peak_tflops * 1e12) * 1e3
        rows.append(Row(fmt, 1, f"{what} {side}x{side}", ms, weight_bytes / 1e9, floor_ms,
                        tok_s=c.tokens_per_tile / (ms / 1e3)))
        log.info("%s (%.2f TFLOP an image: %.0f TFLOP/s)", rows[-1].markdown(), tower_flops(c) / 1e12,
                 tower_flops(c) / (ms / 1e3) / 1e12)
        del tower
        gc.collect()


def _nbytes(weight) -> int:
    """Bytes a prepared weight occupies."""
    return weight.nbytes  # a tensor, a QTensor of GGUF blocks, or a CPU path weight (cpu_weights): all have it


def step_bytes(decoder, batch: int) -> int:
    """Weight bytes one decode step of `batch` tokens reads: every dense matrix, and in a MoE layer the router and
    the experts `batch` tokens routed uniformly at random use on average (E * (1 - (1 - k / E)^batch))."""
    c = decoder.config
    total = _nbytes(decoder.output)
    for layer in decoder.layers:
        total += sum(_nbytes(w) for w in (*layer.qkv, layer.o) if w is not None)
        if layer.conv is not None:
            total += sum(_nbytes(w) for w in (layer.conv.in_proj, layer.conv.out_proj))
        if layer.delta is not None:
            total += sum(_nbytes(w) for w in (*layer.delta.in_proj, layer.delta.out))
        if layer.mamba is not None:
            total += sum(_nbytes(w) for w in (layer.mamba.in_proj, layer.mamba.out))
        if layer.mla is not None:
            total += sum(_nbytes(w) for w in (*layer.mla.x_a, layer.mla.k_b, layer.mla.v_b))
            total += _nbytes(layer.mla.q_b) if layer.mla.q_b is not None else 0
        if layer.moe is None:
            total += sum(_nbytes(w) for w in (*layer.gate_up, layer.down))
            continue
        experts = layer.moe.experts
        if layer.moe.shared_down is not None:
            total += sum(_nbytes(w) for w in (*layer.moe.shared_gate_up, layer.moe.shared_down))
        used = c.num_experts * (1 - (1 - c.num_experts_used / c.num_experts) ** batch)
        total += _nbytes(layer.moe.router) + int((_nbytes(experts.gate_up) + _nbytes(experts.down)) * used / c.num_experts)
    return total


def main(argv: list[str] | None = None) -> int:
    """Run the check; returns the exit status (1 when a logits comparison fails)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s",
                        handlers=[logging.FileHandler(args.log, mode="a"), logging.StreamHandler(sys.stderr)])
    device = torch.device(args.device)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    log.info("device %s, torch %s, triton %s", card, torch.__version__, __import__("triton").__version__)
    config = tiny_config(vocab_size=300) if args.tiny else llama_1b_config()
    dtype = torch.bfloat16
    checks: list[str] = []
    vision: list[str] = []
    rows: list[Row] = []
    failed = False
    signal.signal(signal.SIGTERM, _stop)  # `timeout` in gpu_check.sh: still print what was measured
    try:
        for fmt in args.formats:
            try:
                check_format(args, config, fmt, device, dtype, checks, rows)
            except Exception as exc:  # a kernel or capture error in one format: log it, go on with the next
                log.exception("%s: failed", fmt)
                checks.append(f"| {fmt} | {_error(exc)} | | | | FAIL |")
                failed = True
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        for name in args.towers:
            try:
                check_tower(args, name, device, dtype, vision, rows)
            except Exception as exc:
                log.exception("vision %s: failed", name)
                vision.append(f"| vision-{name} | {_error(exc)} | | | FAIL |")
                failed = True
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    except (KeyboardInterrupt, SystemExit) as stop:
        log.error("stopped early (%s): the table holds what was measured", stop)
        failed = True
    failed |= any(line.endswith("FAIL |") for line in checks + vision)
    shape = "tiny" if args.tiny else f"Llama-3.2-1B shapes (moe-*: Qwen3-30B-A3B's, {args.moe_layers} layers)"
    print(f"\n### gpu_check: {card}, {shape}, bf16 compute, context {args.context}\n")
    print("Logits of a prefill + decode step, max |error| / max |value| against the torch float32 path; last, the\n"
          "decode step through DecodeGraphs (replayed CUDA graphs) against the same step run eagerly:\n")
    print("| format | triton f32 | triton bf16 | torch bf16 | graph vs eager | check |\n|---|---|---|---|---|---|")
    print("\n".join(checks))
    if args.towers:
        tower = "toy shapes" if args.tiny else "Gemma-3-4B's shapes"
        print(f"\nVision: one image's embeddings through a random tower ({tower}), max |error| / max |value| against "
              "the torch float32 path:\n")
        print("| tower | triton f32 | triton bf16 | torch bf16 | check |\n|---|---|---|---|---|")
        print("\n".join(vision))
    print("\nFloor: the weight bytes a decode step reads over the copy bandwidth; for an image encode (tok/s: its image "
          "tokens), its FLOPs over the bf16 peak.\n")
    print("| format | batch | path | ms/step | tok/s | weights read GB | % of floor |\n|---|---|---|---|---|---|---|")
    print("\n".join(r.markdown() for r in rows), flush=True)
    return 1 if failed else 0


def _error(exc: Exception) -> str:
    """A table cell naming an exception: its type and the start of its first line."""
    return f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"


def _stop(signum: int, frame: object) -> None:
    """SIGTERM handler: unwind to `main`, which prints the partial table."""
    raise SystemExit(f"signal {signum}")


if __name__ == "__main__":
    sys.exit(main())
