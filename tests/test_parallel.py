"""Tensor parallel and Helix context parallel on gloo, in several CPU processes: every
rank's output equals transformers' (and so the single-process layer's) through prefill,
decode, multi-token decode with truncate, and a prompt over a cached prefix."""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import mla
from hf_util import FP32_TOL, PREFIX, hf_reference, make_attention, make_config, rel_err, state_dict

STEPS = [  # (requests, truncations after the step)
    ([("a", 13), ("b", 2)], {}),                 # prefills; b fits one block: cp rank 1 holds none of it
    ([("a", 1), ("b", 1)], {}),                  # decode
    ([("a", 4), ("b", 3)], {"a": 2, "b": 1}),    # 1 + k drafts, rejected ones rolled back
    ([("b", 1), ("a", 1)], {}),                  # decode after rollback, order swapped
    ([("c", 9), ("a", 40)], {}),                 # a new prompt + a long prompt over a cached prefix
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, tp, cp, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        hf_cfg = make_config("v3", max_position_embeddings=128)
        attn, rotary = make_attention(hf_cfg, seed=5)
        cfg = mla.MLAConfig.from_hf(hf_cfg)
        par = mla.Parallel(tp_size=tp, cp_size=cp)
        layer = mla.MLA(cfg, dtype=torch.float32, backend="torch", parallel=par)
        layer.load_hf_state_dict(state_dict(attn), prefix=PREFIX)
        cache = mla.PagedLatentCache(cfg, num_blocks=64, block_size=4, dtype=torch.float32, parallel=par)
        g = torch.Generator().manual_seed(7)             # the same inputs on every rank
        hist, worst = {}, 0.0
        for step, drop in STEPS:
            batch = cache.prepare(step)
            x = torch.cat([torch.randn(n, cfg.hidden_size, generator=g) for _, n in step])
            out = layer(x, batch)
            off = 0
            for seq, n in step:
                hist[seq] = torch.cat((hist.get(seq, x[:0]), x[off: off + n]))
                assert cache.length(seq) == hist[seq].shape[0]
                worst = max(worst, rel_err(out[off: off + n], hf_reference(attn, rotary, hist[seq])[-n:]))
                off += n
            for seq, k in drop.items():
                cache.truncate(seq, cache.length(seq) - k)
                hist[seq] = hist[seq][: cache.length(seq)]
        exchanged = par.stats["exchange_bytes"]
        if cp > 1:
            # one decode step of 2 sequences, W_UV before and after the exchange: the same output,
            # and the bytes each rank sends are (cp - 1) * tokens * H_s * (d * 4 + 4) in float32
            late = mla.Parallel(tp_size=tp, cp_size=cp, v_before_exchange=False)
            layer_late = mla.MLA(cfg, dtype=torch.float32, backend="torch", parallel=late)
            layer_late.load_hf_state_dict(state_dict(attn), prefix=PREFIX)
            batch = cache.prepare([("a", 1), ("c", 1)])
            x = torch.randn(2, cfg.hidden_size, generator=g)
            before = par.stats["exchange_bytes"]
            y_early = layer(x, batch)
            sent_early = par.stats["exchange_bytes"] - before
            y_late = layer_late(x, batch)     # writes the same rows again: harmless
            hs = cfg.num_heads // tp // cp
            assert sent_early == (cp - 1) * 2 * hs * (cfg.v_head_dim * 4 + 4)
            assert late.stats["exchange_bytes"] == (cp - 1) * 2 * hs * (cfg.kv_lora_rank * 4 + 4)
            assert rel_err(y_late, y_early) <= FP32_TOL
        results[rank] = (worst, exchanged, cache.num_free_blocks)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tp,cp", [(2, 1), (4, 1), (1, 2), (2, 2)])
def test_parallel_layer_matches_transformers(tp, cp):
    world = tp * cp
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(world, tp, cp, _free_port(), results), nprocs=world)
        results = dict(results)
    assert sorted(results) == list(range(world))
    for rank, (worst, exchanged, free) in results.items():
        assert worst <= FP32_TOL, (rank, worst)
        if cp == 1:
            assert exchanged == 0
        else:
            assert exchanged > 0
    if cp > 1:   # the cache is split: CP ranks hold different shares
        assert len({results[r][2] for r in range(world)}) > 1 or tp > 1


def test_parallel_validation():
    with pytest.raises(ValueError, match="tp_size"):
        mla.Parallel(tp_size=0)
    with pytest.raises(ValueError, match="not initialized"):
        mla.Parallel(tp_size=2)
    with pytest.raises(ValueError, match="parallel"):
        mla.MLA(mla.MLAConfig.preset("tiny"), parallel="tp2")


def _full_pool_worker(rank, world, port, results):
    """cp 2, 2 blocks of 4 a rank: 12 tokens put global blocks 0 and 2 on rank 0 and block 1 on
    rank 1; 5 more need 3 blocks on rank 0 (2 there) and 2 on rank 1 (2 there). Both ranks must
    refuse the step, or their lengths part and the next collective pairs different batches."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cfg = mla.MLAConfig.preset("tiny")
        cache = mla.PagedLatentCache(cfg, num_blocks=2, block_size=4, dtype=torch.float32,
                                     parallel=mla.Parallel(tp_size=1, cp_size=2))
        cache.prepare([("a", 12)])
        free = cache.num_free_blocks
        try:
            cache.prepare([("a", 5)])
            refused = ""
        except mla.CacheFullError as e:
            refused = str(e)
        pool = (refused, cache.length("a"), free, cache.num_free_blocks)
        # a layer without CP over this CP cache would compute over half the keys as if whole
        layer = mla.MLA(cfg, dtype=torch.float32, backend="torch")
        batch = cache.prepare([("a", 1)])
        try:
            layer(torch.zeros(1, cfg.hidden_size), batch)
            mismatch = ""
        except ValueError as e:
            mismatch = str(e)
        results[rank] = (*pool, mismatch)
    finally:
        dist.destroy_process_group()


def test_helix_full_pool_and_layer_mismatch_refused_on_every_rank():
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_full_pool_worker, args=(2, _free_port(), results), nprocs=2)
        results = dict(results)
    assert sorted(results) == [0, 1]
    assert [results[r][2] for r in (0, 1)] == [0, 1]       # the pools differ: rank 1 alone had room
    for rank, (refused, length, free_before, free_after, mismatch) in results.items():
        assert "block" in refused, (rank, refused)
        assert length == 12 and free_after == free_before, rank
        assert "CP rank" in mismatch and "same parallel" in mismatch, (rank, mismatch)
