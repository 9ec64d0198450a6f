"""The decode step's grid and what ``mla bench layer`` counts for it (no GPU needed): the
options and the shapes they select, the floor's bytes and FLOPs, the memory a row needs.

The floor of one layer's step (``floor_us``)::

    floor = max(weight bytes / COPY_BYTES_PER_S, bf16 FLOPs / GEMM_FLOPS_PER_S + FP8 FLOPs / FP8_GEMM_FLOPS_PER_S)
            + the decode kernel's own time

with the ceilings of ``mla.bench.roofline`` (measured once on an H200, not in the run) and
FP8 GEMMs at twice the bf16 peak (Hopper's FP8 tensor cores do twice bf16's work a cycle).
Weight bytes: every parameter and buffer of the layer (FP8 weights with their block scales).
FLOPs: 2 x tokens x the elements of every weight matrix (the fused q_a/kv_a projection,
q_b_proj, kv_b_proj as the absorbed W_UK and W_UV, o_proj), by the weight's dtype.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from .. import quant
from .decode import positive_int
from .roofline import COPY_BYTES_PER_S, GEMM_FLOPS_PER_S
from .timing import copies_past_l2

__all__ = ["PAGE", "KV_FORMATS", "WEIGHTS", "FULL", "QUICK", "FP8_GEMM_FLOPS_PER_S", "HEADROOM", "FILL_ROWS",
           "StepGrid", "context_tokens", "add_step_args", "step_grid", "check_grid", "weight_bytes", "projection_flops",
           "floor_us", "cache_bytes", "row_bytes_needed", "top_kernels"]

PAGE = 64
# cache rows: PagedLatentCache's (dtype, fp8_scaling)
KV_FORMATS = {"bf16": (torch.bfloat16, "tensor"), "fp8": (torch.float8_e4m3fn, "tensor"),
              "fp8_tile": (torch.float8_e4m3fn, "tile")}
WEIGHTS = ("bf16", "fp8")          # fp8: q_b_proj and o_proj kept FP8 (mla.MLA(fp8_weights="always"))
FULL = dict(batch=(1, 8, 32, 128), context=(1024, 4096, 16384), heads=(16, 128))
QUICK = dict(batch=(1, 32), context=(4096,), heads=(16, 128))
FP8_GEMM_FLOPS_PER_S = 2 * GEMM_FLOPS_PER_S
HEADROOM = 1 << 30       # free bytes a row keeps beside its counted tensors: the step's temporaries
FILL_ROWS = 1 << 20      # latent rows quantized at once when a cache is filled (their float32 copies)


@dataclass(frozen=True)
class StepGrid:
    """The resolved options of the decode step: what ``run_step`` measures."""

    heads: tuple
    batch: tuple
    context: tuple
    weights: tuple
    kv: tuple
    layers: int
    profile: int        # kernels listed per profiled row; 0: no profile
    peer: bool


def context_tokens(text: str) -> int:
    """argparse type of a context length: tokens, or kibi-tokens with a k ("4k" = 4096), >= 2
    (a decode step needs a cached token before its new one)."""
    t = text.strip().lower()
    n = positive_int(t[:-1]) * 1024 if t.endswith("k") else positive_int(t)
    if n < 2:
        raise argparse.ArgumentTypeError(f"expected a token count >= 2 such as 4096 or 4k, got {text}")
    return n


def add_step_args(p: argparse.ArgumentParser) -> None:
    """The decode step's options; a shape option left out takes ``--quick``'s value or the full grid."""
    many = dict(type=positive_int, nargs="+", default=None)
    p.add_argument("--batch", **many, help="sequences a step (default 1 8 32 128; --quick 1 32)")
    p.add_argument("--context", type=context_tokens, nargs="+", default=None,
                   help="tokens a sequence, the new one included (default 1k 4k 16k; --quick 4k)")
    p.add_argument("--heads", **many, help="attention heads, DeepSeek-V3's other dimensions (default 16 128)")
    p.add_argument("--weights", nargs="+", choices=WEIGHTS, default=["bf16"],
                   help="bf16, or fp8: q_b_proj and o_proj as block-scaled FP8 GEMMs (default bf16)")
    p.add_argument("--kv", nargs="+", choices=tuple(KV_FORMATS), default=["bf16"],
                   help="cache rows: bf16 (1152 B), fp8 (576 B, one scale), fp8_tile (656 B) (default bf16)")
    p.add_argument("--layers", type=positive_int, default=4,
                   help="layers of the multi-layer row of each shape, one cache and one StepGraph (1: none; "
                        "default 4)")
    p.add_argument("--profile", type=positive_int, nargs="?", const=10, default=0, metavar="N",
                   help="list the N (default 10) kernels of one graphed step that take the most time, for "
                        "every single-layer row (narrow the grid with the options above)")
    p.add_argument("--no-peer", action="store_true", help="leave out transformers' DeepseekV3Attention")


def step_grid(args) -> StepGrid:
    """The options with the defaults of ``--quick`` or of the full grid filled in."""
    base = QUICK if args.quick else FULL

    def pick(name):
        v = getattr(args, name)
        return base[name] if v is None else tuple(dict.fromkeys(v))
    return StepGrid(heads=pick("heads"), batch=pick("batch"), context=pick("context"),
                    weights=tuple(dict.fromkeys(args.weights)), kv=tuple(dict.fromkeys(args.kv)), layers=args.layers,
                    profile=args.profile, peer=not args.no_peer)


def check_grid(g: StepGrid, max_positions: int) -> None:
    """What argparse cannot check: ValueError naming the option."""
    if max(g.context) > max_positions:
        raise ValueError(f"--context: expected at most {max_positions} tokens (DeepSeek-V3's max_position_embeddings), "
                         f"got {max(g.context)}")


# ------------------------------------------------------------------ what is counted

def weight_bytes(layer) -> int:
    """Bytes of every parameter and buffer the layer holds: what one step reads at least once."""
    tensors = list(layer.parameters()) + [b for b in layer.buffers() if b is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


def projection_flops(layer, tokens: int) -> tuple[int, int]:
    """(bf16, FP8) FLOPs of the layer's projections for ``tokens`` new tokens: 2 x tokens x the
    elements of each weight matrix (kv_b_proj's as the absorbed W_UK and W_UV), by its dtype."""
    flops = {False: 0, True: 0}
    for p in layer.parameters():
        if p.dim() == 2:
            flops[p.dtype == quant.FP8] += 2 * tokens * p.numel()
    return flops[False], flops[True]


def floor_us(nbytes: int, flops: int, fp8_flops: int, kernel_us: float) -> float:
    """The least time of a step: its weights read once or its projections computed at the
    ceilings (module docstring), whichever is longer, then the decode kernel's own time."""
    gemm_s = flops / GEMM_FLOPS_PER_S + fp8_flops / FP8_GEMM_FLOPS_PER_S
    return max(nbytes / COPY_BYTES_PER_S, gemm_s) * 1e6 + kernel_us


def cache_bytes(cfg, kv: str, B: int, L: int, layers: int = 1) -> int:
    """Bytes of a cache of ``layers`` layers holding B sequences of L tokens in whole pages."""
    fmt = "plain" if kv == "bf16" else kv
    row = quant.row_width(fmt, cfg.kv_lora_rank, cfg.qk_rope_head_dim) * (2 if fmt == "plain" else 1)
    return layers * B * -(-L // PAGE) * PAGE * row


def row_bytes_needed(cfg, kv: str, B: int, L: int, layers: int = 1) -> int:
    """Free device bytes a row needs: its cache, the copies of one layer's cache the kernel's
    timing rotates through, the quantization's temporaries while the cache is filled (12 bytes
    a value of ``FILL_ROWS`` rows, or of one sequence if longer), and ``HEADROOM``."""
    one = cache_bytes(cfg, kv, B, L)
    fill = 0 if kv == "bf16" else 12 * max(min(B * L, FILL_ROWS), L) * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    return layers * one + (copies_past_l2(one) - 1) * one + fill + HEADROOM


def top_kernels(events, steps: int, top: int) -> list[dict]:
    """The ``top`` device activities (kernels, copies, fills) of a profile of ``steps`` steps by
    time, from torch.profiler's ``key_averages()``: per step their microseconds, calls and share
    of all device time; the others summed in one last row."""
    from torch.autograd import DeviceType

    acts = []
    for e in events:
        us = getattr(e, "self_device_time_total", None)
        us = getattr(e, "self_cuda_time_total", 0.0) if us is None else us
        if getattr(e, "device_type", None) == DeviceType.CUDA and us > 0:
            acts.append((e.key, e.count, us))
    total = sum(a[2] for a in acts)
    acts.sort(key=lambda a: -a[2])
    rows = [dict(kernel=k, calls=c / steps, us=us / steps, share=us / total) for k, c, us in acts[:top]]
    rest = acts[top:]
    if rest:
        us = sum(a[2] for a in rest)
        rows.append(dict(kernel=f"({len(rest)} others)", calls=sum(a[1] for a in rest) / steps, us=us / steps,
                         share=us / total))
    return rows
