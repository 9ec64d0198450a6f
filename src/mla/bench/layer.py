"""``mla bench layer``: the whole MLA layer on the GPU: its context phase (also the last part
of ``mla bench prefill``) and a decode step, eager against CUDA-graphed.

    mla bench layer [--phase all|context|decode] [--quick] [--csv FILE]

DeepSeek-V3 dimensions with 16 and 128 heads, random weights (``mla.testing``), bf16.

Context phase: prompts with no prefix and prompts over a cached prefix, each timed eagerly
(``mla.bench.timing.eager_time_us``). The provider column is the strategy the layer's plan
chose (``layer.plan(batch)``); tokens/s count the new tokens.

Decode step: B 1, 8, 32, 128 sequences of 4k tokens, one new token each, the layer called
eagerly and through ``mla.StepGraph`` (copies into its buffers, a replay, the output copied
out: what a serving loop pays), both with ``eager_time_us``. The floor is the least a step can
take: its weights read once at the copy bandwidth, plus the decode kernel's own time
(``graph_time_us`` over rotated cache copies)::

    floor = weight bytes / COPY_BYTES_PER_S + mla_decode time

The graphed step's output is checked against the eager step's before either is timed.
"""
from __future__ import annotations

import argparse

import torch

from . import report
from .roofline import COPY_BYTES_PER_S
from .timing import eager_time_us, graph_time_us, rotated_copies

__all__ = ["add_args", "validate", "run", "time_layer", "print_layer", "time_step", "print_step"]

PHASES = ("all", "context", "decode")


def v3_layer(H: int):
    """(config, bf16 layer with random weights) of DeepSeek-V3's dimensions with H heads."""
    import mla
    from mla.testing import random_state_dict

    cfg = mla.MLAConfig.preset("deepseek-v3").replace(num_heads=H)
    layer = mla.MLA(cfg, dtype=torch.bfloat16, device="cuda")
    layer.load_hf_state_dict(random_state_dict(cfg, torch.Generator().manual_seed(0)))
    return cfg, layer


def time_layer(rows: list[dict], quick: bool) -> None:
    """One row per (heads, new tokens, prefix) appended to rows."""
    import mla

    cases = [(4096, 0), (4096, 4096)] if quick else [(1024, 0), (4096, 0), (16384, 0), (32768, 0), (4096, 4096),
                                                       (4096, 28672)]
    for H in (16, 128):
        cfg, layer = v3_layer(H)
        for n, c in cases:
            cache = mla.PagedLatentCache(cfg, num_blocks=(n + c) // 64 + 4, block_size=64, dtype=torch.bfloat16,
                                         device="cuda")
            if c:
                layer(torch.randn(c, cfg.hidden_size, device="cuda", dtype=torch.bfloat16), cache.prepare([("s", c)]))
            batch = cache.prepare([("s", n)])
            x = torch.randn(n, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
            layer(x, batch)   # plan and compile; later calls rewrite the same slots
            us = eager_time_us(lambda: layer(x, batch))
            plan = layer.plan(batch)
            rows.append(dict(shape=f"V3 layer H{H} new {n} prefix {c}", provider=plan.strategy[0],
                             ms=round(us * 1e-3, 3), tokens_per_s=round(n / us * 1e6)))
            del cache
            torch.cuda.empty_cache()


def time_step(rows: list[dict], quick: bool, context: int = 4096) -> None:
    """One row per (heads, batch) appended to rows: the eager and the graphed decode step of one
    layer over ``context`` tokens a sequence, and their floor (module docstring)."""
    import mla

    batches = (1, 32) if quick else (1, 8, 32, 128)
    for H in (16, 128):
        cfg, layer = v3_layer(H)
        weight_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
        blocks = context // 64
        for B in batches:
            cache = mla.PagedLatentCache(cfg, num_blocks=B * blocks, block_size=64, dtype=torch.bfloat16,
                                         device="cuda")
            cache.prepare([(b, context - 1) for b in range(B)])
            cache.kv.normal_()      # the cached rows: random latents, as a prefill would leave them
            batch = cache.prepare([(b, 1) for b in range(B)])
            x = torch.randn(B, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
            graph = mla.StepGraph(layer, cache, max_blocks_per_seq=blocks, buckets=(B,))
            want, got = layer(x, batch).float(), graph(x, batch).float()   # the same slots rewritten
            err = ((got - want).norm() / want.norm()).item()
            if not err < 1e-2:
                raise RuntimeError(f"H{H} B{B}: the graphed step is {err:.3g} off the eager step")
            eager_us = eager_time_us(lambda: layer(x, batch))
            graph_us = eager_time_us(lambda: graph(x, batch))
            q = torch.randn(B, 1, H, cfg.kv_lora_rank + cfg.qk_rope_head_dim, device="cuda", dtype=torch.bfloat16)
            kernel_us = graph_time_us([
                lambda kv=kv: mla.ops.mla_decode(q, kv, batch.block_table, batch.cache_seqlens, cfg.kv_lora_rank,
                                                 cfg.softmax_scale)
                for kv in rotated_copies(cache.layer(0))])
            floor_us = weight_bytes / COPY_BYTES_PER_S * 1e6 + kernel_us
            rows.append(dict(shape=f"V3 layer H{H} B{B} x {context // 1024}k", eager_us=round(eager_us, 1),
                             graph_us=round(graph_us, 1), floor_us=round(floor_us, 1),
                             kernel_us=round(kernel_us, 1), eager_floor=round(eager_us / floor_us, 2),
                             graph_floor=round(graph_us / floor_us, 2), rel_err=f"{err:.1e}"))
            del graph, cache
            torch.cuda.empty_cache()
        del layer
        torch.cuda.empty_cache()


def print_step(rows: list[dict]) -> None:
    print("\n## a decode step of the layer: eager, CUDA-graphed (mla.StepGraph), floor")
    report.print_rows(rows, ["shape", "eager_us", "graph_us", "floor_us", "kernel_us", "eager_floor", "graph_floor",
                             "rel_err"])


def print_layer(rows: list[dict]) -> None:
    print("\n## the layer's context phase (strategy as provider)")
    report.print_rows(rows, ["shape", "provider", "ms", "tokens_per_s"])


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--phase", choices=PHASES, default="all", help="the context phase, the decode step, or both")
    p.add_argument("--quick", action="store_true", help="4k tokens only; decode at B 1 and 32")
    p.add_argument("--csv", help="write every row to this CSV file")


def validate(args) -> None:
    """Nothing to check beyond argparse's own."""


def run(args) -> int:
    torch.manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}")
    context: list[dict] = []
    step: list[dict] = []
    if args.phase in ("all", "context"):
        time_layer(context, args.quick)
    if args.phase in ("all", "decode"):
        time_step(step, args.quick)
    if args.csv:
        report.write_csv(context + step, args.csv)
    if context:
        print_layer(context)
    if step:
        print_step(step)
    return 0
