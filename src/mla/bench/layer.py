"""``mla bench layer``: the whole MLA layer on the GPU: its context phase (also the last part
of ``mla bench prefill``) and a decode step, eager, CUDA-graphed, against its floor and transformers.

    mla bench layer [--phase all|context|decode] [--quick] [--batch 1 8 32 128] [--context 1k 4k 16k]
                    [--heads 16 128] [--weights bf16 fp8] [--kv bf16 fp8 fp8_tile] [--layers 4]
                    [--profile [N]] [--no-peer] [--csv FILE]

DeepSeek-V3 dimensions with 16 and 128 heads, random weights (``mla.testing``), bf16.

Context phase: prompts with no prefix and prompts over a cached prefix, each timed eagerly
(``mla.bench.timing.eager_time_us``). The provider column is the strategy the layer's plan
chose (``layer.plan(batch)``); tokens/s count the new tokens.

Decode step (``mla.bench.layer_step``): every (heads, batch, context) of the grid, one new
token a sequence over context - 1 cached ones, for each ``--weights`` (bf16, or FP8 q_b_proj
and o_proj) and ``--kv`` cache format: the step eager, through ``mla.StepGraph`` (the whole
call), its replay alone, the decode kernel alone and the floor
max(weight bytes / copy bandwidth, projection FLOPs / GEMM peak) + kernel (``layer_grid``);
a row of ``--layers`` layers in one StepGraph (figures per layer); transformers'
DeepseekV3Attention on a StaticCache with the same weights and cached rows, eager and
compiled (``layer_peer``), and mla's speed-up over it. Defaults: the full grid in bf16;
``--quick``: B 1 and 32 at 4k. ``--profile`` lists the kernels of one graphed step of each
single-layer row. Checked before timing: the graphed step against the eager one,
transformers against mla. A shape that does not fit in the free GPU memory is skipped with a
line saying so; the exit status is 1 when a row failed.
"""
from __future__ import annotations

import argparse

import torch

from . import report
from .layer_grid import add_step_args, check_grid, step_grid
from .layer_step import build_layer, run_step, v3_config
from .timing import eager_time_us

__all__ = ["add_args", "validate", "run", "time_layer", "print_layer"]

PHASES = ("all", "context", "decode")


def v3_layer(H: int):
    """(config, bf16 layer with random weights) of DeepSeek-V3's dimensions with H heads."""
    from mla.testing import random_state_dict

    cfg = v3_config(H)
    return cfg, build_layer(cfg, random_state_dict(cfg, torch.Generator().manual_seed(0)))


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


def print_layer(rows: list[dict]) -> None:
    print("\n## the layer's context phase (strategy as provider)")
    report.print_rows(rows, ["shape", "provider", "ms", "tokens_per_s"])


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--phase", choices=PHASES, default="all", help="the context phase, the decode step, or both")
    p.add_argument("--quick", action="store_true",
                   help="context: 4k tokens only; decode: B 1 and 32 at 4k (where --batch, --context, --heads are "
                        "not given)")
    add_step_args(p)
    p.add_argument("--csv", help="write every row to this CSV file (rewritten after each decode shape)")


def validate(args) -> None:
    """The decode grid's contexts within DeepSeek-V3's positions (argparse checks the rest)."""
    check_grid(step_grid(args), v3_config(1).max_position_embeddings)


def run(args) -> int:
    torch.manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}")
    context: list[dict] = []
    step: list[dict] = []

    def emit(rows):
        if args.csv:
            report.write_csv(context + rows, args.csv)
    if args.phase in ("all", "context"):
        time_layer(context, args.quick)
        emit([])
        print_layer(context)
    if args.phase in ("all", "decode"):
        step = run_step(step_grid(args), emit)
    return 1 if any("error" in r for r in step) else 0
