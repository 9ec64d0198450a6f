"""Tensor parallel and Helix context parallel on NCCL, one process per GPU.

    PYTHONPATH=src python3 benchmarks/multi_gpu.py [--quick]

For each layout that fits the GPUs present (tp, cp, tp x cp), with DeepSeek-V3 shapes and
random bf16 weights: checks the layer's decode output on every rank against the
single-GPU layer on rank 0, then times decode steps (batch 1, 8, 64; contexts 4k, 64k,
256k) and the Helix all-to-all inside them. Caches are filled with random latents
(no prefill is timed here). On CPU (`--gloo`) it runs the same code on tiny shapes.
Keep NVLink multicast off (NCCL_NVLS_ENABLE=0), as the device notes ask.
"""
from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import mla
from mla.bench.timing import eager_time_us, graph_time_us
from mla.testing import random_state_dict

for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(k, v)


ITERS = 20   # calls per timing on every rank: a fixed count, so the collectives inside them match


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fill(cache, seqs, lengths, gen):
    cache.prepare([(s, n) for s, n in zip(seqs, lengths)])
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=gen, device=cache.kv.device).to(cache.kv.dtype) * 0.5)


def _worker(rank, world, layouts, grid, cfg_name, backend_dist, results):
    os.environ.update(MASTER_ADDR="127.0.0.1")
    gpu = backend_dist == "nccl"
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    dist.init_process_group(backend_dist, rank=rank, world_size=world)
    dtype = torch.bfloat16 if gpu else torch.float32
    cfg = mla.MLAConfig.preset(cfg_name).replace(max_position_embeddings=1 << 20)
    sd = random_state_dict(cfg, torch.Generator().manual_seed(0))
    rows = []
    for tp, cp in layouts:
        par = mla.Parallel(tp_size=tp, cp_size=cp)
        layer = mla.MLA(cfg, dtype=dtype, device=device, parallel=par)
        layer.load_hf_state_dict(sd)
        single = None
        if rank == 0:
            single = mla.MLA(cfg, dtype=dtype, device=device)
            single.load_hf_state_dict(sd)
        for batch_size, ctx in grid:
            block = 64
            blocks = batch_size * (-(-(ctx + 8) // block)) // cp + batch_size + 8
            cache = mla.PagedLatentCache(cfg, num_blocks=blocks, block_size=block, dtype=dtype, device=device,
                                         parallel=par)
            seqs = list(range(batch_size))
            gen = torch.Generator(device).manual_seed(1 + par.cp_rank)   # TP ranks hold the same latents
            _fill(cache, seqs, [ctx] * batch_size, gen)
            x = torch.randn(batch_size, cfg.hidden_size, generator=torch.Generator().manual_seed(2)).to(device, dtype)
            batch = cache.prepare([(s, 1) for s in seqs])
            out = layer(x, batch)
            # correctness: gather every rank's cache share onto rank 0, rebuild a whole cache there
            err = _check_against_single(rank, world, tp, cp, cfg, cache, batch, single, x, out, device, dtype)
            # timing: decode steps on the same batch (the step rewrites the same slots)
            seen = {}
            plain = par.helix_exchange

            def spy(o, l):
                seen["args"] = (o, l)
                return plain(o, l)
            par.__dict__["helix_exchange"] = spy
            step_eager = eager_time_us(lambda: layer(x, batch), ITERS, sync=gpu)
            del par.__dict__["helix_exchange"]
            step_graph = float("nan")
            if gpu:
                try:
                    step_graph = graph_time_us([lambda: layer(x, batch)], ITERS)
                except Exception as e:   # report, keep the eager numbers
                    print(f"rank {rank}: CUDA graph capture failed: {type(e).__name__}: {e}")
            a2a = eager_time_us(lambda: plain(*seen["args"]), ITERS, sync=gpu) if cp > 1 else 0.0
            step = step_graph if step_graph == step_graph else step_eager
            rows.append((tp, cp, batch_size, ctx, step_eager, step_graph, batch_size / step * 1e6 / world, a2a, err))
            del cache
            if gpu:
                torch.cuda.empty_cache()
    if rank == 0:
        results["rows"] = rows
    dist.destroy_process_group()


def _check_against_single(rank, world, tp, cp, cfg, cache, batch, single, x, out, device, dtype):
    """Rank 0 rebuilds the whole cache from every CP rank's share and runs the single layer."""
    shares = [torch.empty_like(cache.kv) for _ in range(world)]
    dist.all_gather(shares, cache.kv)
    tables = {}
    for s in batch.seq_ids:
        b = torch.tensor(cache.blocks(s), dtype=torch.int64, device=device)
        lst = [torch.zeros(1 << 13, dtype=torch.int64, device=device) for _ in range(world)]
        padded = torch.zeros(1 << 13, dtype=torch.int64, device=device)
        padded[: b.numel()] = b + 1
        dist.all_gather(lst, padded)
        tables[s] = [t[t > 0] - 1 for t in lst]
    if rank != 0:
        return float("nan")
    whole = mla.PagedLatentCache(cfg, num_blocks=sum(c.shape[1] for c in shares[::tp]) + 8, block_size=cache.block_size,
                                 dtype=dtype, device=device)
    whole.prepare([(s, cache.length(s) - 1) for s in batch.seq_ids])
    for s in batch.seq_ids:
        dst = whole.blocks(s)
        n_global = -(-(cache.length(s) - 1) // cache.block_size)
        for j in range(n_global):
            src_rank = (j % cp) * tp                     # the TP-0 rank of CP rank j % cp
            src_block = int(tables[s][src_rank][j // cp])
            whole.kv[0, dst[j]].copy_(shares[src_rank][0, src_block])
    ref = single(x, whole.prepare([(s, 1) for s in batch.seq_ids]))
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gloo", action="store_true", help="CPU processes on gloo, tiny shapes")
    ap.add_argument("--world", type=int, default=None)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.gloo:
        world, cfg_name, backend = args.world or 2, "tiny", "gloo"
        grid = [(1, 40), (3, 70)]
    else:
        world, cfg_name, backend = args.world or torch.cuda.device_count(), "deepseek-v3", "nccl"
        grid = [(b, ctx) for ctx in (4096, 65536, 262144) for b in (1, 8, 64)]
        if args.quick:
            grid = grid[:2]
    layouts = list(dict.fromkeys([(world, 1), (1, world)] + ([(2, world // 2)] if world >= 4 else [])))
    os.environ["MASTER_PORT"] = str(_port())
    with mp.Manager() as m:
        results = m.dict()
        mp.spawn(_worker, args=(world, layouts, grid, cfg_name, backend, results), nprocs=world)
        rows = results["rows"]
    print(f"\n{cfg_name}, world {world} ({backend}); decode step = one token per sequence")
    print("step: eager / CUDA graph; tok/s/GPU from the graph step where there is one; a2a: the Helix exchange alone")
    print(f"{'tp':>3} {'cp':>3} {'batch':>6} {'context':>8} {'eager us':>9} {'graph us':>9} {'tok/s/GPU':>10} "
          f"{'a2a us':>8} {'rel err':>9}")
    for tp, cp, b, ctx, eager, graph, tps, a2a, err in rows:
        print(f"{tp:>3} {cp:>3} {b:>6} {ctx:>8} {eager:>9.0f} {graph:>9.0f} {tps:>10.0f} {a2a:>8.1f} {err:>9.2e}")
    bad = [r for r in rows if not r[-1] <= (1e-2 if backend == "nccl" else 1e-4)]
    print("PASS" if not bad else f"FAIL: {len(bad)} layouts differ from the single-GPU layer")
    return 0 if not bad else 1


if __name__ == "__main__":
    raise SystemExit(main())
