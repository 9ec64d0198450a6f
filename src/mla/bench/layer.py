"""``mla bench layer``: the whole MLA layer's context phase on the GPU (also the last part of
``mla bench prefill``).

    mla bench layer [--quick] [--csv FILE]

DeepSeek-V3 dimensions with 16 and 128 heads, random weights (``mla.testing``), bf16; prompts
with no prefix and prompts over a cached prefix, each timed eagerly
(``mla.bench.timing.eager_time_us``). The provider column is the strategy the layer's plan
chose (``layer.plan(batch)``); tokens/s count the new tokens.
"""
from __future__ import annotations

import argparse

import torch

from . import report
from .timing import eager_time_us

__all__ = ["add_args", "validate", "run", "time_layer", "print_layer"]


def time_layer(rows: list[dict], quick: bool) -> None:
    """One row per (heads, new tokens, prefix) appended to rows."""
    import mla
    from mla.testing import random_state_dict

    cases = [(4096, 0), (4096, 4096)] if quick else [(1024, 0), (4096, 0), (16384, 0), (32768, 0), (4096, 4096),
                                                       (4096, 28672)]
    for H in (16, 128):
        cfg = mla.MLAConfig.preset("deepseek-v3").replace(num_heads=H)
        layer = mla.MLA(cfg, dtype=torch.bfloat16, device="cuda")
        layer.load_hf_state_dict(random_state_dict(cfg, torch.Generator().manual_seed(0)))
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
    p.add_argument("--quick", action="store_true", help="4k tokens only")
    p.add_argument("--csv", help="write every row to this CSV file")


def validate(args) -> None:
    """Nothing to check beyond argparse's own."""


def run(args) -> int:
    torch.manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}")
    rows: list[dict] = []
    time_layer(rows, args.quick)
    if args.csv:
        report.write_csv(rows, args.csv)
    print_layer(rows)
    return 0
