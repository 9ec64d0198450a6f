"""Sparse MLA (DeepSeek Sparse Attention) under Helix context parallelism, on gloo in CPU
processes: every CP rank's output equals the single-rank layer's on the same weights and
history (float32, relative 1e-5), and the keys the ranks attend to, together, are the
single-rank layer's top-k, through a long prompt, decodes, s_q > 1 with rollback, a long chunk
over a cached prefix, a dense short sequence beside them and chunked logits; with tie-heavy
(duplicated) keys, FP8 index keys, attention sinks and GLM-5's shared indexer layers. The merge
rule of the per-rank top-ks is also checked alone against the single-rank top-k."""
from __future__ import annotations

import contextlib
import os
import socket
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import mla
from hf_util import FP32_TOL, rel_err
from mla import sparse_cp
from mla.sparse_cp import merge_topk
from mla.testing import random_state_dict

BASE = dict(hidden_size=64, num_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
            v_head_dim=16, max_position_embeddings=256, index_topk=8, index_n_heads=4, index_head_dim=32)
STEPS = [  # (requests, truncations after the step)
    ([("a", 30), ("b", 5)], {}),                 # a long prompt (sparse), a short one (dense prefill)
    ([("a", 1), ("b", 1)], {}),                  # decode: a sparse, b absorbed
    ([("a", 3), ("b", 4)], {"a": 2}),            # s_q > 1 (b reaches 10 > index_topk), drafts rolled back
    ([("b", 1), ("a", 1)], {}),
    ([("c", 12)], {}),
    ([("c", 20), ("a", 2)], {}),                 # a long chunk over a cached prefix, chunked logits
]
CASES = {   # name: (config overrides, cache options, steps)
    "v32": ({}, {}, STEPS),
    "ties": ({}, {}, STEPS[:4]),
    "fp8_keys": ({"index_head_dim": 128}, {"index_format": "fp8_ue8m0"}, STEPS[:3]),
    "sinks": ({"attention_sinks": True}, {}, STEPS[:3]),
    "glm_shared": ({"index_rope_interleave": True, "index_shared_layers": (1,)}, {}, STEPS[:4]),
    # a sparse prompt inside one block: CP rank 1 holds none of its keys, then its first ones
    "one_block": ({}, {"block_size": 16}, [([("a", 12)], {}), ([("a", 1)], {}), ([("a", 8)], {})]),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weights(cfg, tie: bool):
    sd = random_state_dict(cfg, torch.Generator().manual_seed(0))
    if tie:
        # Every indexer key is zero but in one channel (past the RoPE part), so a score is one
        # product per head: exact whatever the order of a dot product's terms, which the CPU
        # BLAS picks by shape (a rank's logits see fewer keys than the single rank's). With
        # duplicated tokens (``_inputs``) the scores then tie exactly, within a rank and across.
        channel = cfg.qk_rope_head_dim
        sd["indexer.k_norm.weight"].zero_()[channel] = 1.0
        sd["indexer.k_norm.bias"].zero_()
    return sd


def _inputs(g, n: int, hidden: int, tie: bool) -> torch.Tensor:
    if not tie:
        return torch.randn(n, hidden, generator=g)
    rows = torch.randn(3, hidden, generator=g)   # three distinct tokens: every score ties with many
    return rows[torch.randint(0, 3, (n,), generator=g)]


def _selection(batch, layer, cache) -> list[frozenset]:
    """The global positions each sparse query of the step attends to (this rank's share of them
    under CP), in the plan's chunk order."""
    plan = layer.plan(batch)
    indices = batch.recall(mla.sparse.selection_key(layer))
    bs, cp, rank = cache.block_size, cache.cp_size, cache.cp_rank
    out = []
    for chunk, idx in zip(plan.sparse, indices):
        row = 0
        for b, n in zip(chunk.seqs, chunk.counts):
            where = {blk * bs + o: (lb * cp + rank) * bs + o
                     for lb, blk in enumerate(cache.blocks(batch.seq_ids[b])) for o in range(bs)}
            for i in range(n):
                out.append(frozenset(where[s] for s in idx[row + i].tolist() if s >= 0))
            row += n
    return out


def _run_case(name: str, par, g):
    over, cache_opts, steps = CASES[name]
    cfg = mla.MLAConfig(**{**BASE, **over})
    tie = name == "ties"
    sd = _weights(cfg, tie)
    num_layers = 2 if cfg.index_shared_layers else 1
    pairs = []      # per layer: (single-rank layer, CP layer)
    for i in range(num_layers):
        pair = []
        for p in (None, par):
            layer = mla.MLA(cfg, layer_idx=i, dtype=torch.float32, backend="torch", max_workspace_tokens=32,
                            parallel=p)
            layer.load_hf_state_dict(sd, strict=i == 0)   # a shared layer skips the indexer's tensors
            pair.append(layer)
        pairs.append(pair)
    caches = [mla.PagedLatentCache(cfg, num_layers=num_layers, num_blocks=64, dtype=torch.float32, parallel=p,
                                   **{"block_size": 4, **cache_opts}) for p in (None, par)]
    worst, selections, ties = 0.0, [], [0]
    for step, drop in steps:
        x = _inputs(g, sum(n for _, n in step), cfg.hidden_size, tie)
        batches = [c.prepare(step) for c in caches]
        for pair in pairs:
            with _boundary_ties(ties) if tie else contextlib.nullcontext():
                want = pair[0](x, batches[0])
            worst = max(worst, rel_err(pair[1](x, batches[1]), want))
        plan = pairs[0][1].plan(batches[1])
        for c, hc in zip(plan.sparse, sparse_cp.helix_chunks(batches[1], plan)):   # a rank's logits: the bound
            assert c.num_rows * hc.max_local <= 32 * cfg.index_head_dim or c.num_rows == 1
        if plan.sparse:
            selections.append([_selection(b, pairs[0][k], c) for k, (b, c) in enumerate(zip(batches, caches))])
        for c in caches:
            for seq, k in drop.items():
                c.truncate(seq, c.length(seq) - k)
    return worst, selections, ties[0]


@contextlib.contextmanager
def _boundary_ties(count: list):
    """Count in count[0] the queries whose index_topk-th and next scores tie in the top-k calls
    made inside: the queries where the tie rule, not the scores, decides the selection."""
    topk_indices = mla.ops.topk_indices

    def counting(logits, topk, *args, **kwargs):
        if logits.shape[1] > topk:
            best = logits.topk(topk + 1, dim=-1).values
            count[0] += int(((best[:, -1] == best[:, -2]) & best[:, -1].isfinite()).sum())
        return topk_indices(logits, topk, *args, **kwargs)

    with mock.patch.object(mla.ops, "topk_indices", counting):
        yield


def _worker(rank, world, tp, cp, port, names, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        par = mla.Parallel(tp_size=tp, cp_size=cp)
        g = torch.Generator().manual_seed(7)       # the same inputs on every rank
        out = {name: _run_case(name, par, g) for name in names}
        try:    # the k-pool indexer (GLM-5.3-Flash) is refused under CP, by name
            mla.MLA(mla.MLAConfig(**{**BASE, "index_kpool": 4}), dtype=torch.float32, parallel=par)
            out["kpool"] = ""
        except ValueError as e:
            out["kpool"] = str(e)
        results[rank] = out
    finally:
        dist.destroy_process_group()


def _spawn(tp, cp, names):
    world = tp * cp
    with mp.Manager() as manager:
        results = manager.dict()
        # fork: the children start with torch and mla imported (spawn's imports take most of the time)
        mp.start_processes(_worker, args=(world, tp, cp, _free_port(), names, results), nprocs=world,
                           start_method="fork")
        results = dict(results)
    assert sorted(results) == list(range(world))
    for rank in range(world):
        assert "parallel" in results[rank]["kpool"] and "k-pool" in results[rank]["kpool"], results[rank]["kpool"]
    for name in names:
        for rank in range(world):
            assert results[rank][name][0] <= FP32_TOL, (name, rank, results[rank][name][0])
        checked = 0
        for tp_rank in range(tp):   # the CP ranks of one TP rank attend, together, to the single-rank top-k
            ranks = [c * tp + tp_rank for c in range(cp)]
            for s, steps in enumerate(zip(*(results[r][name][1] for r in ranks))):
                single = steps[0][0]
                for q, want in enumerate(single):
                    parts = [st[1][q] for st in steps]
                    assert sum(len(p) for p in parts) == len(frozenset().union(*parts)), (name, s, q)  # disjoint
                    assert frozenset().union(*parts) == want, (name, s, q)
                    checked += len(want) == BASE["index_topk"]
        assert checked > 0, name
    if "ties" in names:     # the case exercises the tie rule at the top-k boundary
        assert results[0]["ties"][2] > 10, results[0]["ties"][2]


def test_helix_sparse_matches_single_rank():
    _spawn(1, 2, list(CASES))


def test_helix_sparse_tp2_cp2():
    _spawn(2, 2, ["v32"])


def _topk_oracle(logits):
    """The single-rank top-k as positions: an identity block table."""
    K = logits.shape[1]
    table = torch.arange(max(1, -(-K // 4)), dtype=torch.int32)[None]
    cu = torch.tensor([0, logits.shape[0]], dtype=torch.int32)
    return mla.ops.topk_indices(logits, 8, table, cu, 4, backend="torch")


@pytest.mark.parametrize("cp", [2, 3])
def test_merge_of_rank_topks_is_the_global_topk(cp):
    """Keys dealt to cp ranks by blocks of 4 (block j on rank j % cp): each rank's top-8 over its
    keys as positions, merged, is the single-rank top-8 over all keys, order included: rounded
    scores (many ties, across ranks too), +0.0 and -0.0, rows with fewer than 8 visible keys."""
    g = torch.Generator().manual_seed(cp)
    bs, topk, K = 4, 8, 37
    logits = torch.randn(6, K, generator=g).round(decimals=0).abs()
    logits[0, :20] = 0.0
    logits[0, 1::3] = -0.0                      # ties with 0.0
    logits[1, 5:] = float("-inf")               # 5 visible keys
    logits[2] = float("-inf")                   # none
    logits[3, ::2] = 2.0                        # ties spread over every rank
    want = _topk_oracle(logits)
    scores, index = [], []
    cu = torch.tensor([0, logits.shape[0]], dtype=torch.int32)
    for rank in range(cp):
        cols = [s for s in range(K) if (s // bs) % cp == rank]
        local = logits[:, cols]
        table = torch.tensor([[j for j in range(-(-K // bs)) if j % cp == rank]], dtype=torch.int32)
        pos = mla.ops.topk_indices(local, topk, table, cu, bs, backend="torch")
        at = {p: i for i, p in enumerate(cols)}
        scores.append(torch.stack([torch.stack([local[t, at[p]] if p >= 0 else torch.tensor(float("-inf"))
                                                for p in row.tolist()]) for t, row in enumerate(pos)]))
        index.append(pos)
    got = merge_topk(torch.cat(scores, 1), torch.cat(index, 1), topk)
    assert torch.equal(got, want)
    assert (got[2] == -1).all() and (got[1, 5:] == -1).all()

