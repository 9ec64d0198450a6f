"""``mla bench sparse --section step``: the decode step of a whole DeepSeek-V3.2 layer (projections,
the lightning indexer, its top-k, sparse attention over the selected latent rows) against the
same layer without its indexer (DeepSeek-V3's dense MLA step over every cached row).

For each heads H, batch B, cache format (``--kv``: bf16 rows, per-tensor FP8 rows, FlashMLA's
FP8 tile rows) and index key format: B sequences of ``--context`` tokens, the last one new, both
layers with the same random weights (``mla.testing``) over the same cached latent rows, stored in
that format (page ``--page``); the V3.2 layer's cache also holds random index keys (bf16, or
DeepSeek's FP8 rows). Each step is captured once in a CUDA graph and replayed
(``graph_time_us``: device time, no Python; the plan and RoPE tables are the batch's memos, made
by an eager call first). A row:

    dense_us, sparse_us   the two replays, per layer
    speedup               dense_us / sparse_us (the issue's target: >= 3 at B 32, 32k)
    rel_err               the replayed sparse step's output against its eager call's

and below each row the sparse step's kernels by device time (``kernel_times_us`` over eager
calls), which says where its time goes.
"""
from __future__ import annotations

import torch

from .. import quant
from . import report
from .layer_grid import KV_FORMATS
from .layer_step import build_layer, fill_latents, v3_config
from .timing import graph_time_us, kernel_times_us

__all__ = ["v32_config", "fill_index_keys", "step_shape", "run_step", "STEP_COLS"]

STEP_COLS = [("H", 4, "d"), ("B", 4, "d"), ("L", 6, "d"), ("topk", 5, "d"), ("kv", 8, "<"), ("keys", 9, "<"),
             ("check", 5, "<"), ("rel_err", 8, ".1e"), ("dense_us", 9, ".1f"), ("sparse_us", 9, ".1f"),
             ("speedup", 7, ".2f")]
TOL = 1e-2          # the replay against the eager call: the same kernels on the same rows
KERNELS = 8         # kernels listed under a row


def v32_config(H: int, topk: int, index_heads: int, index_dim: int):
    """DeepSeek-V3.2's attention with H heads: DeepSeek-V3's dimensions and the lightning indexer
    (index_n_heads x index_head_dim, NeoX RoPE in the indexer, top-``topk``)."""
    return v3_config(H).replace(name="deepseek-v3.2", index_topk=topk, index_n_heads=index_heads,
                                index_head_dim=index_dim, index_rope_interleave=False)


def fill_index_keys(cache, block_table: torch.Tensor, n: int, gen: torch.Generator) -> None:
    """Random indexer keys for tokens 0 .. n-1 of each sequence of block_table [B, blocks] in
    every layer of the cache, in its index format (FP8 rows: rotated and quantized)."""
    bs = cache.block_size
    t = torch.arange(n, device=block_table.device)
    for b in range(block_table.shape[0]):
        slots = block_table[b, t // bs].long() * bs + t % bs
        for i in range(cache.num_layers):
            keys = cache.index_keys(i)
            flat = keys.view(-1, keys.shape[-1])
            k = torch.randn(n, cache.cfg.index_head_dim, generator=gen, device=keys.device)
            flat[slots] = k.to(flat.dtype) if cache.index_format is None else \
                quant.quantize_index(quant.rotate(k), cache.index_format)


def _replay_checked(step, want: torch.Tensor) -> tuple[float, float]:
    """(the replay's time, its output's norm-wise error against ``want``): one graph captured
    for the check (its output is the graph's own), then ``graph_time_us``."""
    from .decode_providers import rel_err

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    g.replay()
    torch.cuda.synchronize()
    err = rel_err(out.float(), want.float())
    del g
    return graph_time_us([step]), err


def step_shape(H: int, B: int, L: int, topk: int, index_heads: int, index_dim: int, keys: str, page: int,
               device="cuda", kv: str = "bf16") -> tuple[dict, list[str]]:
    """One row (and its kernel lines): the V3.2 layer's step and the dense V3 layer's, both over
    a cache of ``kv`` rows."""
    import mla
    from mla.testing import random_state_dict

    cfg = v32_config(H, topk, index_heads, index_dim)
    dense_cfg = v3_config(H)
    sd = random_state_dict(cfg, torch.Generator().manual_seed(0))
    sparse = build_layer(cfg, sd, device=device)
    dense = build_layer(dense_cfg, {k: v for k, v in sd.items() if not k.startswith("indexer.")}, device=device)
    gen = torch.Generator(device=device).manual_seed(B * 100003 + L)
    x = torch.randn(B, cfg.hidden_size, generator=gen, device=device, dtype=torch.bfloat16)
    latents = torch.randn(B, L - 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim, generator=gen, device=device,
                          dtype=torch.bfloat16)
    blocks = -(-L // page)
    row = dict(section="step", H=H, B=B, L=L, topk=topk, kv=kv, keys=keys)
    dtype, scaling = KV_FORMATS[kv]
    out = {}
    for name, layer, c in (("dense", dense, dense_cfg), ("sparse", sparse, cfg)):
        index_format = None if name == "dense" or keys == "bf16" else keys
        cache = mla.PagedLatentCache(c, num_blocks=B * blocks, block_size=page, dtype=dtype, device=device,
                                     fp8_scaling=scaling, index_format=index_format)
        cache.prepare([(b, L - 1) for b in range(B)])
        batch = cache.prepare([(b, 1) for b in range(B)])
        fill_latents(cache, batch.block_table, latents)
        if name == "sparse":
            fill_index_keys(cache, batch.block_table, L - 1, gen)
        want = layer(x, batch)        # plan, memos, compilation; replays rewrite the same slot
        us, err = _replay_checked(lambda: layer(x, batch), want)
        row[f"{name}_us"] = us
        if name == "sparse":
            row["rel_err"] = err
            row["check"] = "ok" if err < TOL and bool(torch.isfinite(want).all()) else "FAIL"
            out["kernels"] = kernel_times_us(lambda: layer(x, batch))
        del cache, batch
    row["speedup"] = row["dense_us"] / row["sparse_us"]
    top = sorted(out["kernels"].items(), key=lambda kv: -kv[1])[:KERNELS]
    lines = ["      sparse step's kernels (us, eager): " + ", ".join(f"{k} {v:.1f}" for k, v in top)]
    return row, lines


def run_step(g, fm, rows: list, csv: str | None) -> None:
    """Every (heads, batch, cache format, index keys) of the grid at ``--context``."""

    print(f"\n## a DeepSeek-V3.2 layer's decode step (indexer {g.index_heads} x {g.index_dim}, top-{g.topk}) "
          f"against the dense DeepSeek-V3 step, {g.context} tokens, CUDA-graph replays")
    print(report.fixed_header(STEP_COLS), flush=True)
    for H in g.heads:
        for B in g.batch:
            for kv, keys in ((kv, keys) for kv in g.kv for keys in g.index_keys):
                try:
                    row, lines = step_shape(H, B, g.context, g.topk, g.index_heads, g.index_dim, keys, g.page, kv=kv)
                except Exception as e:
                    row, lines = dict(section="step", H=H, B=B, L=g.context, kv=kv, keys=keys, check="error",
                                      error=report.error_text(e)), []
                    if torch.cuda.is_initialized():
                        torch.cuda.set_stream(torch.cuda.default_stream())
                report.emit([row], rows, STEP_COLS, "check", csv)
                if lines:
                    print("\n".join(lines), flush=True)
                torch.cuda.empty_cache()
