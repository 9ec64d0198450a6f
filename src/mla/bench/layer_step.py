"""The decode step of ``mla bench layer``: one DeepSeek-V3 layer over a paged latent cache, B
sequences of L tokens (the last one new), eager, through mla.StepGraph and as a bare CUDA-graph
replay, against its floor and against transformers' attention (``layer_peer``).

A row's figures, in microseconds:

    eager_us   the step called from Python (``eager_time_us``: the L2 flushed before each call)
    graph_us   the mla.StepGraph call: the batch copied into its buffers, the replay, the output
               copied out, what a serving loop pays (``eager_time_us``)
    replay_us  the step captured once in a CUDA graph and replayed (``graph_time_us``): GPU time
               alone, no Python call (the plan and RoPE tables are made before the capture, as
               the batch's memos)
    kernel_us  mla.ops.mla_decode alone over the cache (``graph_time_us`` over rotated copies)
    floor_us   max(weight bytes / copy bandwidth, projection FLOPs / GEMM peak) + kernel_us
               (``layer_grid.floor_us``: the ceilings of mla.bench.roofline, not measured here)

and ``eager/fl``, ``graph/fl``, ``replay/fl`` their ratios to the floor; ``hf/eager`` and
``hf/graph`` are transformers' eager and compiled times over mla's eager and graphed ones (mla's
speed-up); transformers' own row has its two times as eager_us and graph_us (eager, compiled),
its floor that of mla's bf16 row. ``rel_err``: an mla row's graphed step against its eager
one; transformers' output against mla's eager step with bf16 weights and cache.

Rows with ``layers`` N > 1: N layers (the same weights, layer_idx 0 .. N-1) on one N-layer cache
in one StepGraph, figures per layer (the call over N), so the host's share spread over N layers
shows. Every graphed step is checked against the eager step, transformers against mla's eager
bf16 step, before either is timed. A shape whose tensors would not fit in the free GPU memory
is skipped with a line saying so.
"""
from __future__ import annotations

import os
import traceback

import torch

from .. import quant
from . import report
from .layer_grid import (FILL_ROWS, FP8_GEMM_FLOPS_PER_S, KV_FORMATS, PAGE, StepGrid, floor_us, projection_flops,
                         row_bytes_needed, top_kernels, weight_bytes)
from .roofline import COPY_BYTES_PER_S, GEMM_FLOPS_PER_S
from .timing import eager_time_us, graph_time_us, rotated_copies

__all__ = ["v3_config", "build_layer", "fill_latents", "profile_lines", "free_bytes", "run_step", "COLS"]

GRAPH_TOL = 1e-2         # the graphed step against the eager one: the same kernels on the same rows
PROFILE_STEPS = 20
# the most of the free memory transformers' step may take: its eager temporaries, then its
# compiled form's CUDA-graph pool, which keeps as much again
PEER_SHARE = 0.4


# ------------------------------------------------------------------ inputs

def v3_config(H: int):
    """DeepSeek-V3's attention dimensions with H heads."""
    import mla

    return mla.MLAConfig.preset("deepseek-v3").replace(num_heads=H)


def build_layer(cfg, sd, weights: str = "bf16", layer_idx: int = 0, device="cuda"):
    """A bf16 mla.MLA loaded from sd; ``weights`` "fp8" keeps q_b_proj and o_proj FP8 (sd then an
    FP8 checkpoint, ``mla.weights.quantize_checkpoint_fp8``)."""
    import mla

    layer = mla.MLA(cfg, layer_idx=layer_idx, dtype=torch.bfloat16, device=device,
                    fp8_weights="always" if weights == "fp8" else "never")
    layer.load_hf_state_dict(sd)
    return layer


def fill_latents(cache, block_table: torch.Tensor, latents: torch.Tensor, chunk_rows: int = FILL_ROWS) -> None:
    """Write latents [B, n, r + dr] (tokens 0 .. n-1 of each sequence: c_kv, then rope(k_pe))
    into every layer of the cache through block_table [B, >= ceil(n / block_size)], in the
    cache's format (quantized on the way in), ``chunk_rows`` rows at a time."""
    B, n, d = latents.shape
    bs, r = cache.block_size, cache.cfg.kv_lora_rank
    t = torch.arange(n, device=latents.device)
    per = max(1, chunk_rows // n)
    for b0 in range(0, B, per):
        rows = latents[b0: b0 + per].reshape(-1, d)
        slots = (block_table[b0: b0 + per][:, t // bs].long() * bs + t % bs).reshape(-1)
        if cache.format == "plain":
            stored = rows.to(cache.dtype)
        else:   # as bytes: index_put_ has no float8 kernels
            stored = quant.quantize_rows(rows, cache.format, r, cache.kv_scale).view(torch.uint8)
        for i in range(cache.num_layers):
            kv = cache.layer(i)
            kv = kv if cache.format == "plain" else kv.view(torch.uint8)
            kv.view(-1, kv.shape[-1])[slots] = stored


def _profile(fn, steps: int, top: int) -> list[dict]:
    """``top_kernels`` of ``steps`` calls of fn, after one call the profiler's schedule discards."""
    from torch.profiler import ProfilerActivity, profile, schedule

    once = schedule(wait=0, warmup=1, active=steps, repeat=1)    # repeat=1: the trace stays to be read
    with profile(activities=[ProfilerActivity.CUDA], schedule=once) as prof:
        for _ in range(1 + steps):
            fn()
            torch.cuda.synchronize()     # the call's device work inside its profiler step
            prof.step()
    return top_kernels(prof.key_averages(), steps, top)


def profile_lines(graphed, eager, title: str, top: int, least_us: float, steps: int = PROFILE_STEPS) -> list[str]:
    """The ``top`` device activities of ``steps`` graphed steps (after one unprofiled), as
    lines; those of the eager step, said so, where the profiler does not see inside the graph:
    less than half of ``least_us`` (the device time the step takes at least) a step."""
    rows, what = _profile(graphed, steps, top), "graphed step"
    if sum(r["us"] for r in rows) < least_us / 2:
        rows, what = _profile(eager, steps, top), "eager step (the profiler did not see inside the graph)"
    if not rows:
        return [f"\n### kernels of {title}: the profiler recorded no device activity"]
    total = sum(r["us"] for r in rows)
    out = [f"\n### kernels of {title}, the {what}: {total:.1f} us of device time a step ({steps} steps profiled)",
           f"{'us/step':>9} {'share':>6} {'calls':>6}  kernel"]
    out += [f"{r['us']:9.1f} {r['share']:6.1%} {r['calls']:6.1f}  {r['kernel'][:110]}" for r in rows]
    return out


# ------------------------------------------------------------------ one shape

def free_bytes(device: torch.device) -> int:
    """Bytes free on the device now: the GPU's free memory, or the host's physical memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _fits(need: int, device: torch.device) -> str | None:
    """Why a row needing ``need`` free bytes cannot run now, or None."""
    free = free_bytes(device)
    if need <= free:
        return None
    return f"skipped: needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"


def _step_row(layers, cfg, kv: str, x, latents, profile: int, title: str) -> tuple[dict, tuple]:
    """One row: the step of ``layers`` (one cache layer each) over ``latents``; (its figures,
    (the eager step's output, the profile's lines))."""
    import mla
    from .decode_providers import rel_err

    B, n = latents.shape[:2]
    N, blocks = len(layers), -(-(n + 1) // PAGE)
    dtype, scaling = KV_FORMATS[kv]
    cache = mla.PagedLatentCache(cfg, num_layers=N, num_blocks=B * blocks, block_size=PAGE, dtype=dtype,
                                 device=x.device, fp8_scaling=scaling)
    cache.prepare([(b, n) for b in range(B)])
    batch = cache.prepare([(b, 1) for b in range(B)])
    fill_latents(cache, batch.block_table, latents)

    def step(h, bt):
        for layer in layers:
            h = layer(h, bt)
        return h
    graph = mla.StepGraph(step, cache, max_blocks_per_seq=blocks, buckets=(B,))
    want = step(x, batch)
    err = rel_err(graph(x, batch), want.float())     # both write the same slot with the same row
    if not err < GRAPH_TOL:
        raise RuntimeError(f"the graphed step is {err:.3g} off the eager step (expected < {GRAPH_TOL})")
    eager = eager_time_us(lambda: step(x, batch))
    graphed = eager_time_us(lambda: graph(x, batch))
    lines = []
    try:
        replay = graph_time_us([lambda: step(x, batch)])
    except Exception as e:      # the eager step on a prepared batch not capturable: its row says so
        torch.cuda.set_stream(torch.cuda.default_stream())
        replay = None
        lines.append(f"{title}: no replay_us, the eager step did not capture ({type(e).__name__}: {_first_line(e)})")
    r, d = cfg.kv_lora_rank, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    q = torch.randn(B, 1, cfg.num_heads, d, device=x.device, dtype=torch.bfloat16)
    kernel = graph_time_us([lambda rows=rows: mla.ops.mla_decode(q, rows, batch.block_table, batch.cache_seqlens, r,
                                                                 cfg.softmax_scale, kv_scale=cache.kv_scale)
                            for rows in rotated_copies(cache.layer(0))])
    floor = floor_us(weight_bytes(layers[0]), *projection_flops(layers[0], B), kernel)
    row = dict(eager_us=eager / N, graph_us=graphed / N, kernel_us=kernel, floor_us=floor, rel_err=err)
    if replay is not None:
        row["replay_us"] = replay / N
    row.update({f"{k}/fl": row[f"{k}_us"] / floor for k in ("eager", "graph", "replay") if f"{k}_us" in row})
    if profile and N == 1:
        lines += profile_lines(lambda: graph(x, batch), lambda: step(x, batch),
                               f"{title} (graph {graphed:.1f} us, floor {floor:.1f} us)", profile,
                               kernel if replay is None else replay)
    return row, (want, lines)


def _first_line(e: Exception, width: int = 160) -> str:
    return (str(e).strip().splitlines() or [""])[0][:width]


def _attempt(row: dict, fn) -> tuple[dict, object]:
    """fn()'s (figures, extra): the figures merged into row. A shape the device cannot hold is
    noted in the row ("skipped: ..."), an error too (its traceback on stderr); the others go on."""
    extra, failure = None, None
    try:
        figures, extra = fn()
        row = dict(row, **figures)
    except torch.OutOfMemoryError as e:
        failure = dict(note=f"skipped: out of memory ({_first_line(e, 100)})")
    except Exception as e:
        if isinstance(e, ValueError) and str(e).startswith("num_blocks:"):   # the cache's refusal of the pool
            failure = dict(note=f"skipped: {_first_line(e)}")
        else:
            traceback.print_exc()
            failure = dict(error=f"{type(e).__name__}: {_first_line(e)}")
    if torch.cuda.is_initialized():
        torch.cuda.set_stream(torch.cuda.default_stream())    # a capture that failed leaves its side stream current
        torch.cuda.empty_cache()
    return (row if failure is None else dict(row, **failure)), extra


def _peer_row(peer, cfg, base: dict, x, latents, ref, floor: dict | None) -> dict:
    """transformers' row of one shape (``layer_peer``); its floor and ratios are the bf16 mla row's."""
    from . import layer_peer

    module, hf, fast = peer
    row = dict(base, weights="bf16", kv="bf16", layers=1, provider="transformers")
    need, free = layer_peer.step_bytes(cfg, base["B"], base["L"]), free_bytes(x.device)
    if need > PEER_SHARE * free:
        return dict(row, note=f"skipped: a step expands the whole cache, ~{need / 2**30:.0f} GiB eager and again "
                              f"compiled; {free / 2**30:.0f} GiB free")
    row, _ = _attempt(row, lambda: (layer_peer.time_peer(
        module, fast, layer_peer.StaticStep(hf, x, latents, cfg.rope_interleave), ref), None))
    if floor and "eager_us" in row:
        row["floor_us"] = f = floor["floor_us"]
        row.update({f"{k}/fl": row[f"{k}_us"] / f for k in ("eager", "graph") if f"{k}_us" in row})
    return row


def _group(cfg, B: int, L: int, g: StepGrid, layers: dict, stack, peer, device) -> tuple[list[dict], list[str]]:
    """Every row of one (heads, batch, context): each weight and cache format, the multi-layer
    row, transformers; the same hidden states and cached latent rows for all."""
    H, d = cfg.num_heads, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    gen = torch.Generator(device=device).manual_seed(B * 100003 + L)
    x = torch.randn(B, cfg.hidden_size, generator=gen, device=device, dtype=torch.bfloat16)
    latents = torch.randn(B, L - 1, d, generator=gen, device=device, dtype=torch.bfloat16)
    base = dict(H=H, B=B, L=L)
    rows, lines, ref, ref_row = [], [], None, None
    runs = [(w, kv, [layers[w]]) for kv in g.kv for w in g.weights]
    if stack:
        runs.append((g.weights[0], g.kv[0], stack))
    for w, kv, chain in runs:
        row = dict(base, weights=w, kv=kv, layers=len(chain), provider="mla")
        skip = _fits(row_bytes_needed(cfg, kv, B, L, len(chain)), device)
        if skip:
            rows.append(dict(row, note=skip))
            continue
        title = f"H{H} B{B} L{L} weights {w} kv {kv} layers {len(chain)}"
        row, extra = _attempt(row, lambda: _step_row(chain, cfg, kv, x, latents, g.profile, title))
        if extra is not None:
            lines += extra[1]
            if (w, kv, len(chain)) == ("bf16", "bf16", 1):
                ref, ref_row = extra[0], row
        rows.append(row)
    if peer is not None:
        hf = _peer_row(peer, cfg, base, x, latents, ref, ref_row)
        rows.append(hf)
        if hf.get("cudagraphs") == "skipped":
            lines.append(f"transformers H{H} B{B} L{L}: torch skipped the compiled module's CUDA graphs; its graph_us "
                         "is the compiled module without them")
        for r in rows:
            if r["provider"] == "mla":
                r.update({f"hf/{k}": hf[f"{k}_us"] / r[f"{k}_us"] for k in ("eager", "graph")
                          if f"{k}_us" in hf and f"{k}_us" in r})
    return rows, lines


def _peer(cfg, sd, device):
    """(transformers' attention with sd's weights, its config, its compiled form (None off
    CUDA: reduce-overhead is CUDA graphs), transformers' version), or why there is none:
    ("skip" or "error", a line to print)."""
    try:
        import transformers

        from . import layer_peer
        module, hf = layer_peer.attention(cfg, sd, device)
    except ImportError as e:
        return "skip", f"transformers peer: not importable here ({_first_line(e)}); no transformers rows"
    except Exception as e:      # a peer that cannot be built as this module says: no figure of it
        traceback.print_exc()
        return "error", f"transformers peer: {type(e).__name__}: {_first_line(e)}"
    return module, hf, layer_peer.compiled(module) if device.type == "cuda" else None, transformers.__version__


COLS = [("H", 4, "d"), ("B", 4, "d"), ("L", 6, "d"), ("weights", 7, "<"), ("kv", 8, "<"), ("layers", 6, "d"),
        ("provider", 12, "<"), ("eager_us", 9, ".1f"), ("graph_us", 9, ".1f"), ("replay_us", 9, ".1f"),
        ("kernel_us", 9, ".1f"), ("floor_us", 8, ".1f"), ("eager/fl", 8, ".2f"), ("graph/fl", 8, ".2f"),
        ("replay/fl", 9, ".2f"), ("hf/eager", 8, ".2f"), ("hf/graph", 8, ".2f"), ("rel_err", 8, ".1e"),
        ("compile_s", 9, ".1f")]


def run_step(g: StepGrid, emit, device="cuda") -> list[dict]:
    """Every row of the grid on the device, each shape's rows printed as they are measured and
    handed to ``emit(rows)`` (the CSV); the rows."""
    from mla.testing import random_state_dict
    from mla.weights import quantize_checkpoint_fp8

    print("\n## a decode step of the layer, DeepSeek-V3 dimensions: eager, mla.StepGraph, its replay, floor, "
          "transformers")
    print(f"floor = max(weight bytes / {COPY_BYTES_PER_S / 1e12:.2f} TB/s, projection FLOPs / "
          f"{GEMM_FLOPS_PER_S / 1e12:.0f} TFLOP/s bf16, {FP8_GEMM_FLOPS_PER_S / 1e12:.0f} FP8) + decode kernel "
          "(ceilings of mla.bench.roofline); layers > 1: figures per layer; hf/*: transformers' time / mla's")
    rows, header, device = [], False, torch.device(device)
    for H in g.heads:
        cfg = v3_config(H)
        sd = random_state_dict(cfg, torch.Generator().manual_seed(0))
        sds = dict(bf16=sd, fp8=quantize_checkpoint_fp8(sd) if "fp8" in g.weights else None)
        layers = {w: build_layer(cfg, sds[w], w, 0, device) for w in g.weights}
        w0 = g.weights[0]
        stack = [layers[w0]] + [build_layer(cfg, sds[w0], w0, i, device) for i in range(1, g.layers)] \
            if g.layers > 1 else None
        peer = _peer(cfg, sd, device) if g.peer else None
        if peer is not None and len(peer) == 2:
            print(peer[1])
            if peer[0] == "error":
                rows.append(dict(H=H, provider="transformers", error=peer[1]))
            peer = None
        elif peer is not None:
            print(f"H{H}: transformers {peer[3]} DeepseekV3Attention, sdpa, StaticCache; compiled with "
                  "torch.compile(mode='reduce-overhead', dynamic=True)")
            peer = peer[:3]
        if not header:
            print(report.fixed_header(COLS), flush=True)
            header = True
        for L in g.context:
            for B in g.batch:
                shape, lines = _group(cfg, B, L, g, layers, stack, peer, device)
                print("\n".join([report.fixed_line(r, COLS, "eager_us") for r in shape] + lines), flush=True)
                rows += shape
                emit(rows)
        del layers, stack, peer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows
