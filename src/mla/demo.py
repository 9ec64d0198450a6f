"""``mla demo``: a small serving trace on a DeepSeek-shaped model, every step checked.

A model of ``--layers`` MLA layers with residuals (x <- x + MLA(x); no MLP, so any error
is attention's) serves several requests through one PagedLatentCache: a prompt in
chunks, a request that forks another's prefix, mixed prefill + decode steps, speculative
steps of 1 + k draft tokens with the rejected ones rolled back by ``truncate``. After
every step the new tokens' outputs are compared with a plain float64 recomputation of
the whole sequence from scratch.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from .cache import PagedLatentCache
from .config import MLAConfig
from .layer import MLA
from .testing import dense_forward, random_state_dict


def _trace():
    """(step name, [(seq, new tokens)], truncations after the step {seq: tokens to drop})."""
    return [
        ("prompt A, chunk 1", [("A", 24)], {}),
        ("prompt A, chunk 2 + prompt B", [("A", 80), ("B", 17)], {}),
        ("fork A->C; decode A, B; C's prompt", [("A", 1), ("B", 1), ("C", 9)], {}),
        ("decode A, B, C", [("A", 1), ("B", 1), ("C", 1)], {}),
        ("verify 1+3 drafts A, 1+2 drafts B", [("A", 4), ("B", 3), ("C", 1)], {"A": 2, "B": 1}),
        ("decode after rollback", [("A", 1), ("B", 1), ("C", 1)], {}),
        ("prompt D over A's long prefix (fork)", [("D", 70), ("A", 1)], {}),
        ("decode all", [("A", 1), ("B", 1), ("C", 1), ("D", 1)], {}),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mla demo", description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    ap.add_argument("--workspace", type=int, default=32, help="max_workspace_tokens (small: shows chunking)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        ap.error(f"--device: {e}")
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"mla demo: --device {args.device}: CUDA is not available here (torch {torch.__version__})",
              file=sys.stderr)
        return 1
    dtype = getattr(torch, args.dtype)
    tol = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}[dtype]
    t0 = time.perf_counter()

    cfg = MLAConfig.preset("tiny")
    gen = torch.Generator().manual_seed(args.seed)
    layers = []
    for i in range(args.layers):
        layer = MLA(cfg, layer_idx=i, dtype=dtype, device=args.device, backend=args.backend,
                    max_workspace_tokens=args.workspace)
        layer.load_hf_state_dict(random_state_dict(cfg, gen, f"model.layers.{i}.self_attn."),
                                 prefix=f"model.layers.{i}.self_attn.")
        layers.append(layer)
    cache = PagedLatentCache(cfg, num_layers=args.layers, num_blocks=64, block_size=16, dtype=dtype,
                             device=args.device)
    tokens: dict[str, torch.Tensor] = {}     # every sequence's input hidden states so far

    def new_tokens(n):
        return torch.randn(n, cfg.hidden_size, generator=gen)

    print(f"mla demo: {args.layers} layers of {cfg.name} (H={cfg.num_heads}, r={cfg.kv_lora_rank}), "
          f"{args.dtype} on {args.device}, workspace {args.workspace} tokens, block size {cache.block_size}")
    header = f"{'step':<40} {'seqs':>4} {'tokens':>6} {'strategies':<28} {'max err':>9} {'blocks':>6}"
    print(header + "\n" + "-" * len(header))
    worst = 0.0
    for name, step, drop in _trace():
        for seq, _ in step:
            if seq not in cache and seq in ("C", "D"):
                cache.fork("A", seq)            # C and D share A's prefix
                tokens[seq] = tokens["A"].clone()
        batch = cache.prepare(step)
        x = torch.cat([new_tokens(n) for _, n in step])
        off = 0
        for seq, n in step:
            tokens[seq] = torch.cat((tokens.get(seq, x[:0]), x[off: off + n]))
            off += n
        h = x.to(device=args.device, dtype=dtype)
        for layer in layers:
            h = h + layer(h, batch)
        # check every sequence's new rows against the whole sequence recomputed from scratch
        err, off = 0.0, 0
        for seq, n in step:
            ref = tokens[seq].double()
            for layer in layers:
                ref = ref + dense_forward(layer, ref)
            got = h[off: off + n].double().cpu()
            err = max(err, ((got - ref[-n:]).norm() / ref[-n:].norm()).item())
            off += n
        worst = max(worst, err)
        plan = layers[0].plan(batch)
        strategies = ",".join(sorted({s for s in plan.strategy if s}))
        print(f"{name:<40} {batch.num_seqs:>4} {batch.num_tokens:>6} {strategies:<28} {err:>9.2e} "
              f"{cache.num_blocks - cache.num_free_blocks:>6}")
        for seq, k in drop.items():
            cache.truncate(seq, cache.length(seq) - k)
            tokens[seq] = tokens[seq][: cache.length(seq)]
    for seq in list(tokens):
        cache.release(seq)
    ok = worst <= tol and cache.num_free_blocks == cache.num_blocks
    print(f"{'PASS' if ok else 'FAIL'}: worst relative error {worst:.2e} (tolerance {tol:.0e} for {args.dtype}), "
          f"all {cache.num_blocks} blocks free after release, {time.perf_counter() - t0:.1f} s")
    return 0 if ok else 1
