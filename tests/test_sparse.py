"""Sparse MLA (DeepSeek Sparse Attention): the ops against straightforward oracles, and the
layer exact against transformers' DeepseekV32Attention, GlmMoeDsaAttention and HYV4Attention
past index_topk.

Layer oracle: the family's module in float64 over each whole sequence (tests/hf_families.py,
SPARSE cases: index_topk 8, prompts up to 40 tokens), through the public API only.
"""
from __future__ import annotations

import copy

import pytest
import torch

import hf_families as F
import mla
from hf_util import FP32_TOL, rel_err
from mla import quant

FAMILIES = list(F.SPARSE)
NAN = float("nan")


# ---------------------------------------------------------------------------------------
# ops against oracles


def _paged(g, lens, block_size, d, num_blocks, dtype=torch.float32):
    """A cache [num_blocks, block_size, d] of NaN with each sequence's rows at shuffled blocks,
    and its block table; returns (cache, table, rows per sequence)."""
    cache = torch.full((num_blocks, block_size, d), NAN, dtype=dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max([-(-n // block_size) for n in lens] + [1])
    table = torch.full((len(lens), max_blocks), -1, dtype=torch.int32)   # tails: anything
    rows = []
    for b, n in enumerate(lens):
        x = torch.randn(n, d, generator=g).to(dtype)
        rows.append(x)
        for j in range(-(-n // block_size)):
            blk = perm.pop()
            table[b, j] = blk
            part = x[j * block_size:(j + 1) * block_size]
            cache[blk, :part.shape[0]] = part
    return cache, table, rows


def _slot(table, b, s, block_size):
    return int(table[b, s // block_size]) * block_size + s % block_size


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n_heads", [1, 3, 8])
def test_indexer_logits(n_heads, causal, backend):
    g = torch.Generator().manual_seed(n_heads)
    d, bs = 16, 4
    lens, nq = [9, 0, 14, 5], [3, 0, 14, 1]
    cache, table, keys = _paged(g, lens, bs, d, 12)
    Tq = sum(nq)
    q = torch.randn(Tq, n_heads, d, generator=g)
    w = torch.randn(Tq, n_heads, generator=g)
    cu = torch.tensor([0, 3, 3, 17, 18], dtype=torch.int32)
    out = mla.ops.indexer_logits(q, w, cache, table, torch.tensor(lens, dtype=torch.int32), cu, 16, 0.25,
                                 causal=causal, backend=backend)
    assert out.shape == (Tq, 16) and out.dtype == torch.float32
    t = 0
    for b, (n, m) in enumerate(zip(lens, nq)):
        for i in range(m):
            for s in range(16):
                seen = s < n and (not causal or s < n - m + i + 1)
                if not seen:
                    assert out[t, s] == float("-inf")
                    continue
                want = sum(float(w[t, h]) * max(0.0, float(q[t, h].double() @ keys[b][s].double()) * 0.25)
                           for h in range(n_heads))
                assert abs(out[t, s].item() - want) <= 1e-5 * (1 + abs(want))
            t += 1


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_topk_indices_ties_padding_and_slots(backend):
    g = torch.Generator().manual_seed(0)
    bs = 4
    table = torch.tensor([[7, 2, 5], [1, 0, 0]], dtype=torch.int32)
    inf = float("-inf")
    logits = torch.tensor([
        [1.0, 3.0, 3.0, inf, 3.0, 0.5, 2.0, 2.0, inf, inf, inf],    # a tie at the 4th: the lower index
        [0.1, -2.0, inf, inf, inf, inf, inf, inf, inf, inf, inf],   # 2 visible of topk 4: both, then -1
        [inf] * 11,                                                 # nothing visible
    ])
    cu = torch.tensor([0, 2, 3], dtype=torch.int32)
    out = mla.ops.topk_indices(logits, 4, table, cu, bs, backend=backend)
    pos = [[1, 2, 4, 6], [0, 1], []]
    for t, b in enumerate([0, 0, 1]):
        want = [_slot(table, b, s, bs) for s in pos[t]] + [-1] * (4 - len(pos[t]))
        assert out[t].tolist() == want
    # random rows against the best 5 by (-value, index), listed in key order
    x = torch.randn(6, 11, generator=g).round(decimals=1)        # rounded: many ties
    x[:, 9:] = inf
    out = mla.ops.topk_indices(x, 5, table[:1], torch.tensor([0, 6], dtype=torch.int32), bs, backend=backend)
    for t in range(6):
        best = sorted(sorted(range(9), key=lambda s: (-x[t, s].item(), s))[:5])
        assert out[t].tolist() == [_slot(table, 0, s, bs) for s in best]
    # topk past the width: every visible key, then -1
    out = mla.ops.topk_indices(logits[:1], 16, table[:1], torch.tensor([0, 1], dtype=torch.int32), bs,
                               backend=backend)
    assert out[0].tolist() == [_slot(table, 0, s, bs) for s in (0, 1, 2, 4, 5, 6, 7)] + [-1] * 9
    # many ties (+0.0 and -0.0 among them), rows with nothing or little visible, topk past K,
    # huge values: the reference's selection exactly
    for Tq, K, k in ((5, 300, 37), (3, 100, 128), (4, 1000, 64), (2, 7, 3)):
        x = torch.randn(Tq, K, generator=g).round(decimals=1)
        x[0, K // 2:] = inf
        x[1] = inf
        x[-1, :5], x[-1, 5:8], x[-1, 8:10] = 1e30, -1e30, -0.0
        tab = torch.randperm(2 * -(-K // bs) + 5, generator=g)[:2 * -(-K // bs)].view(2, -1).int()
        cu = torch.tensor([0, Tq // 2, Tq], dtype=torch.int32)
        want = mla.ops.topk_indices(x, k, tab, cu, bs, backend="torch")
        assert torch.equal(mla.ops.topk_indices(x, k, tab, cu, bs, backend=backend), want)
        if backend == "triton":   # both of the kernels' paths (the op picks one by the number of queries)
            from mla.ops import indexer
            for chunked in (False, True):
                assert torch.equal(indexer.topk_indices(x, k, tab, cu, bs, chunked=chunked), want), (Tq, K, k, chunked)


def sparse_oracle(q, rows_per_query, scale, dv, sink=None):
    """q [N, H, d]; rows_per_query: list of [k_i, d] float64 -> out [N, H, dv], lse [N, H] float64.
    sink [H]: one more logit per head in the softmax, dropped from the output (FlashMLA's attn_sink)."""
    N, H, _ = q.shape
    out = torch.zeros(N, H, dv, dtype=torch.float64)
    lse = torch.full((N, H), float("-inf"), dtype=torch.float64)
    for t, kv in enumerate(rows_per_query):
        s = (q[t].double() @ kv.T) * scale
        if sink is not None:
            s = torch.cat([s, sink.double()[:, None]], -1)
        if s.shape[-1] == 0:
            continue
        lse[t] = torch.logsumexp(s, -1)
        out[t] = torch.softmax(s, -1)[:, : kv.shape[0]] @ kv[:, :dv]
    return out, lse


def decode_case(g, H, r, dr=16, bs=4, nb=10, topk=6):
    """A paged cache of 24 random rows among NaN ones, and indices for B 2 x s_q 3 queries:
    full, partial and no index in sequence 0, 4 keys each in sequence 1.
    Returns cache [nb, bs, r + dr], its flat view, indices [2, 3, topk], q [2, 3, H, r + dr]."""
    d = r + dr
    cache = torch.full((nb, bs, d), NAN)
    used = torch.randperm(nb * bs, generator=g)[:24]
    flat = cache.view(-1, d)
    flat[used] = torch.randn(24, d, generator=g)
    B, s_q = 2, 3
    idx = torch.full((B, s_q, topk), -1, dtype=torch.int32)
    for b in range(B):
        for i in range(s_q):
            k = [6, 2, 0][i] if b == 0 else 4     # full, partial, none
            idx[b, i, :k] = used[torch.randperm(24, generator=g)[:k]].int()
    return cache, flat, idx, torch.randn(B, s_q, H, d, generator=g)


def prefill_case(g, H, s_q=5, s_kv=11, d=40, topk=4):
    """q [s_q, H, d], kv [s_kv, 1, d] and indices [s_q, 1, topk]; the last query has none."""
    q = torch.randn(s_q, H, d, generator=g)
    kv = torch.randn(s_kv, 1, d, generator=g)
    idx = torch.full((s_q, 1, topk), -1, dtype=torch.int32)
    for t in range(s_q - 1):
        idx[t, 0, :t + 1] = torch.randperm(s_kv, generator=g)[:t + 1].int()[:topk]
    return q, kv, idx


def rows_of(values, idx):
    """The float64 rows each query's indices name (-1 skipped): a list over the queries."""
    return [values[[s for s in row.tolist() if s >= 0]].double() for row in idx.reshape(-1, idx.shape[-1])]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("H", [1, 3, 16])
@pytest.mark.parametrize("fmt", ["plain", "fp8", "fp8_tile"])
def test_sparse_mla_decode(H, fmt, backend):
    g = torch.Generator().manual_seed(H)
    r, bs, nb, kv_scale = 128, 4, 10, 0.5 if fmt == "fp8" else 1.0
    cache, flat, idx, q = decode_case(g, H, r, bs=bs, nb=nb)
    B, s_q, _, d = q.shape
    stored = cache if fmt == "plain" else quant.quantize_rows(flat.nan_to_num(), fmt, r, kv_scale).view(nb, bs, -1)
    values = flat if fmt == "plain" else quant.dequantize_rows(stored.view(nb * bs, -1), fmt, r, torch.float32,
                                                               kv_scale)
    out, lse = mla.ops.sparse_mla_decode(q, stored, idx, r, 0.1, kv_scale=kv_scale, backend=backend)
    assert out.shape == (B, s_q, H, r) and lse.shape == (B, s_q, H) and lse.dtype == torch.float32
    want_o, want_l = sparse_oracle(q.view(B * s_q, H, d), rows_of(values, idx), 0.1, r)
    assert not out.isnan().any()
    assert torch.equal(lse.view(-1, H).isinf(), want_l.isinf())
    assert torch.allclose(out.view(-1, H, r).double(), want_o, atol=1e-5)
    fin = want_l.isfinite()
    assert torch.allclose(lse.view(-1, H).double()[fin], want_l[fin], atol=1e-5)
    assert (out[0, 2] == 0).all() and (lse[0, 2] == float("-inf")).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("H", [1, 7])
def test_sparse_prefill_attention(H, backend):
    dv = 32
    q, kv, idx = prefill_case(torch.Generator().manual_seed(H), H)   # the last query has no index
    out, lse = mla.ops.sparse_prefill_attention(q, kv, idx, 0.2, dv, backend=backend)
    want_o, want_l = sparse_oracle(q, rows_of(kv[:, 0], idx), 0.2, dv)
    assert torch.allclose(out.double(), want_o, atol=1e-5) and torch.equal(lse.isinf(), want_l.isinf())
    assert (out[-1] == 0).all() and (lse[-1] == float("-inf")).all()
    # the same as the paged op over a one-block cache holding kv
    o2, l2 = mla.ops.sparse_mla_decode(q[None], kv[:, 0][None], idx[:, 0][None], dv, 0.2, backend=backend)
    assert torch.allclose(o2[0], out, atol=1e-6) and torch.equal(l2[0].isinf(), lse.isinf())


@pytest.mark.parametrize("splits", [1, 2, 5])
def test_sparse_kernel_splits_sink_and_fp16(splits):
    """The Triton kernel with its topk list split over several programs (the LSE combine),
    an attention sink (-inf on one head: no sink there), float16 queries and rows, and
    indices out of range on the kernel path (taken as -1: never read)."""
    from mla.ops import sparse_attention

    g = torch.Generator().manual_seed(splits)
    H, r = 5, 128
    cache, flat, idx, q = decode_case(g, H, r, topk=20)
    idx[1, 0, -3:] = torch.tensor([-7, 10 ** 6, 2 ** 31 - 1], dtype=torch.int32)   # unchecked values
    sink = torch.randn(H, generator=g)
    sink[1] = float("-inf")
    B, s_q, _, d = q.shape
    for dtype, atol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        out, lse = sparse_attention.launch(q.view(-1, H, d).to(dtype), cache.to(dtype), idx.view(B * s_q, -1), r,
                                           0.1, attn_sink=sink, config=sparse_attention.SparseConfig(
                                               16, 16, 4, 1, splits))
        clean = idx.clone()
        clean[1, 0, -3:] = -1
        want_o, want_l = sparse_oracle(q.view(-1, H, d).to(dtype), rows_of(flat.to(dtype), clean), 0.1, r, sink)
        assert not out.isnan().any() and torch.equal(lse.isinf(), want_l.isinf())
        assert torch.allclose(out.double(), want_o, atol=atol)
        assert torch.allclose(lse.double(), want_l, atol=atol)
        none = 2    # query (0, 2) has no index: out 0, lse = the sink (or -inf without one)
        assert (out[none] == 0).all() and torch.allclose(lse[none], sink, atol=1e-6, rtol=0)


def test_sparse_op_validation():
    q = torch.randn(1, 1, 2, 24)
    cache = torch.randn(3, 4, 24)
    with pytest.raises(ValueError, match="indices.*-1"):
        mla.ops.sparse_mla_decode(q, cache, torch.tensor([[[12]]], dtype=torch.int32), 16, 0.1)
    with pytest.raises(ValueError, match="indices.*int32"):
        mla.ops.sparse_mla_decode(q, cache, torch.tensor([[[1]]]), 16, 0.1)
    with pytest.raises(ValueError, match="kv_cache.*dtype"):
        mla.ops.sparse_mla_decode(q, cache.double(), torch.tensor([[[1]]], dtype=torch.int32), 16, 0.1)
    with pytest.raises(ValueError, match="kv: expected"):
        mla.ops.sparse_prefill_attention(q[0], cache[0], torch.zeros(1, 1, 1, dtype=torch.int32), 0.1, 16)
    with pytest.raises(ValueError, match="topk"):
        mla.ops.topk_indices(torch.zeros(1, 4), 0, torch.zeros(1, 1, dtype=torch.int32),
                             torch.tensor([0, 1], dtype=torch.int32), 4)
    qi, w = torch.randn(2, 2, 8), torch.randn(2, 2)
    args = (torch.randn(2, 4, 8), torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="max_seqlen_k"):
        mla.ops.indexer_logits(qi, w, *args, torch.tensor([3], dtype=torch.int32),
                               torch.tensor([0, 2], dtype=torch.int32), 2, 0.25)
    with pytest.raises(ValueError, match="cache_seqlens.*queries"):
        mla.ops.indexer_logits(qi, w, *args, torch.tensor([1], dtype=torch.int32),
                               torch.tensor([0, 2], dtype=torch.int32), 4, 0.25)
    with pytest.raises(ValueError, match="weights"):
        mla.ops.indexer_logits(qi, w.double(), *args, torch.tensor([2], dtype=torch.int32),
                               torch.tensor([0, 2], dtype=torch.int32), 4, 0.25)


# ---------------------------------------------------------------------------------------
# from_hf and loading


@pytest.mark.parametrize("name", FAMILIES)
def test_from_hf_reads_the_indexer(name):
    hf_cfg = F.SPARSE[name].make_config()
    for source in ("object", "dict"):
        cfg = mla.MLAConfig.from_hf(F.config_source(hf_cfg, source))
        assert (cfg.index_topk, cfg.index_n_heads, cfg.index_head_dim) == (8, 8, 16)
        assert cfg.index_rope_interleave == (name == "glm_moe_dsa")
        assert cfg.rope_interleave == (name != "hy_v4") and cfg.index_rope_last == (name == "hy_v4")
        assert cfg.index_weights_scale == pytest.approx(8 ** -0.5)
        attn, _ = F.make_attention(F.SPARSE[name], hf_cfg, 0)
        assert cfg.softmax_scale == pytest.approx(attn.scaling, rel=1e-12)


def test_glm_shared_layers_from_hf():
    hf_cfg = F.SPARSE["glm_moe_dsa"].make_config(num_hidden_layers=4, indexer_types=["full", "shared", "full",
                                                                                        "shared"])
    cfg = mla.MLAConfig.from_hf(hf_cfg)
    assert cfg.index_shared_layers == (1, 3) and cfg.index_source_layer(3) == 2
    assert "indexer.wk.weight" not in mla.weights.hf_weight_shapes(cfg, 1)
    assert "indexer.wk.weight" in mla.weights.hf_weight_shapes(cfg, 2)


@pytest.mark.parametrize("name", FAMILIES)
def test_strict_loading_of_indexer_tensors(name):
    c = F.SPARSE[name]
    hf_cfg = c.make_config()
    cfg = mla.MLAConfig.from_hf(hf_cfg)
    attn, _ = F.make_attention(c, hf_cfg, 0)
    sd = F.state_dict(attn, c.prefix)
    assert any(k.endswith("indexer.k_norm.bias") for k in sd)
    layer = mla.MLA(cfg, dtype=torch.float32, backend="torch")
    extra = dict(sd, **{c.prefix + "indexer.wq_b.bias": torch.zeros(128)})
    with pytest.raises(ValueError, match="indexer.wq_b.bias"):
        layer.load_hf_state_dict(extra, prefix=c.prefix)
    missing = {k: v for k, v in sd.items() if not k.endswith("indexer.weights_proj.weight")}
    with pytest.raises(ValueError, match="indexer.weights_proj.weight"):
        layer.load_hf_state_dict(missing, prefix=c.prefix)
    assert not layer.loaded
    layer.load_hf_state_dict(sd, prefix=c.prefix)


def test_refusals():
    cfg = mla.MLAConfig.from_hf(F.SPARSE["deepseek_v32"].make_config())
    with pytest.raises(ValueError, match="strategy"):
        mla.MLA(cfg.replace(index_topk=None), strategy="sparse")
    with pytest.raises(ValueError, match="index_keys|index_topk"):
        mla.PagedLatentCache(cfg.replace(index_topk=None), num_blocks=2, block_size=4).index_keys(0)
    with pytest.raises(ValueError, match="index_head_dim"):
        cfg.replace(index_head_dim=4)


# ---------------------------------------------------------------------------------------
# the layer against transformers


def _indices_of(batch):
    """Our layer's selection of the step: [rows, topk] cache slots per chunk, concatenated."""
    vals = [v for k, v in batch._memo.items() if isinstance(k, tuple) and k[0] == "sparse_indices"]
    assert len(vals) == 1
    return torch.cat(vals[0])


def _check_selection(h, batch, seq, n):
    """Our top-k of the step's n new tokens of ``seq`` (the only sparse sequence of the batch)
    equals the module's (float64) where the scores at the top-k boundary are distinct."""
    attn = h.attn_ref
    x = h.hist[seq].double()[None]
    L = x.shape[1]
    pos = torch.arange(L)[None]
    mask = torch.full((L, L), float("-inf"), dtype=torch.float64).triu(1)[None]
    cos_sin = h.rotary(x, pos)
    q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
    theirs = attn.indexer(x, q_resid, cos_sin, mask, pos)[0, -n:]                 # [n, topk] positions
    ours = _indices_of(batch)
    blocks = h.cache.blocks(seq)
    bs = h.cache.block_size
    slot_to_pos = {blocks[p // bs] * bs + p % bs: p for p in range(L)}
    checked = 0
    for i in range(n):
        p = L - n + i
        mine = {slot_to_pos[s] for s in ours[i].tolist() if s >= 0}
        if p + 1 <= h.cfg.index_topk:
            assert mine == set(range(p + 1))
            continue
        want = {int(s) for s in theirs[i] if s <= p}
        assert mine == want, f"query at {p}: ours {sorted(mine)}, the module's {sorted(want)}"
        checked += 1
    return checked


@pytest.mark.parametrize("name", FAMILIES)
def test_prompt_decode_drafts_fork(name):
    """40-token prompt (5x index_topk), decodes, s_q 3 drafts with rollback, fork."""
    h = F.FamilyHarness(name, torch.float32, seed=1)
    seen = {}
    h.step([(0, 40)], on_batch=lambda b: seen.update(batch=b))
    assert h.layer.plan(seen["batch"]).strategy == ["sparse"]
    assert _check_selection(h, seen["batch"], 0, 40) == 32
    for _ in range(2):
        h.step([(0, 1)], on_batch=lambda b: seen.update(batch=b))
        _check_selection(h, seen["batch"], 0, 1)
    h.step([(0, 3)])
    h.truncate(0, 43)                  # one draft accepted
    h.step([(0, 1)])
    h.step([(0, 3)])
    h.truncate(0, 40)                  # none accepted, back across a block boundary (block_size 4)
    h.step([(0, 2)])
    h.fork(0, 1)                       # 42 tokens: a partial last block, copied on write
    h.step([(0, 1), (1, 1)])
    h.step([(1, 3), (0, 2)])
    assert max(h.errors) <= FP32_TOL


@pytest.mark.parametrize("name", FAMILIES)
def test_chunked_prefill_and_workspace_bound(name):
    """A prompt prefilled as 12 + 28 tokens under max_workspace_tokens 16: the indexer's logits
    come in chunks of at most 16 * index_head_dim values; then a mixed batch of a new short
    prompt (dense path), a decode and a long chunk."""
    h = F.FamilyHarness(name, torch.float32, seed=3, max_workspace_tokens=16)
    h.step([(0, 12)])
    plans = []
    h.step([(0, 28)], on_batch=lambda b: plans.append(h.layer.plan(b)))
    chunks = plans[0].sparse
    assert len(chunks) > 1
    for c in chunks:
        assert c.num_rows * c.max_seqlen_k <= 16 * h.cfg.index_head_dim or c.num_rows == 1
        assert c.num_rows <= max(1, 16 // h.cfg.index_topk)
    h.step([(1, 6), (0, 1), (2, 20)], on_batch=lambda b: plans.append(h.layer.plan(b)))
    assert plans[-1].strategy == ["sparse" if h.cfg.attention_sinks else "prefill", "sparse", "sparse"]
    h.step([(1, 3), (2, 1)])           # seq 1: 9 keys > 8 from here on
    assert max(h.errors) <= FP32_TOL


@pytest.mark.parametrize("name", FAMILIES)
def test_short_sequences_dense_path_is_identical(name):
    """Up to index_topk keys the dense paths serve (top-k selects every key): forcing the
    sparse path gives the same result."""
    outs = []
    for strategy in (None, "sparse"):
        h = F.FamilyHarness(name, torch.float32, seed=5, strategy=strategy)
        plans = []
        o1, _ = h.step([(0, 6)], on_batch=lambda b: plans.append(h.layer.plan(b)))
        o2, _ = h.step([(0, 2)], on_batch=lambda b: plans.append(h.layer.plan(b)))
        dense = strategy is None and not h.cfg.attention_sinks     # sinks: always the sparse path
        assert [p.strategy[0] for p in plans] == (["prefill", "absorbed"] if dense else ["sparse"] * 2)
        outs.append(torch.cat([o1, o2]))
    assert rel_err(outs[1], outs[0]) <= 1e-6


def test_sparsity_matters():
    """The oracle differs from dense attention at 40 tokens: an index_topk the layer ignored
    would fail the tests above."""
    c = F.SPARSE["deepseek_v32"]
    h = F.FamilyHarness("deepseek_v32", torch.float32, seed=1)
    x = h.new_inputs(40).double()
    sparse = F.reference(c, h.attn_ref, h.rotary, x)
    dense_attn = copy.deepcopy(h.attn_ref)
    dense_attn.indexer.index_topk = 64
    assert rel_err(sparse, F.reference(c, dense_attn, h.rotary, x)) > 1e-2


def test_bf16_within_the_modules_own_error():
    h = F.FamilyHarness("deepseek_v32", torch.bfloat16, seed=2)
    h.step([(0, 24)])
    h.step([(0, 1)])
    h.check_bf16()


def test_glm_shared_layer():
    """GLM-5: layer 1 reuses layer 0's top-k (indexer_types ["full", "shared"]): two layers on one
    batch against the two modules, the second fed the first's top-k."""
    c = F.SPARSE["glm_moe_dsa"]
    F.check_shared_layer("glm_moe_dsa", c.make_config(indexer_types=["full", "shared"]), seed=10)


def test_sparse_layer_on_the_kernels_and_its_chunks():
    """The layer's sparse path on the Triton kernels (interpreter, float32) matches the reference
    path step by step; the kernel path's chunks are bound by the logits alone (it gathers no
    rows), the reference's also by rows x index_topk."""
    from mla.strategy import build_plan
    from mla.testing import random_state_dict

    cfg = mla.MLAConfig(hidden_size=64, num_heads=3, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                        qk_rope_head_dim=16, v_head_dim=16, max_position_embeddings=256, index_topk=8,
                        index_n_heads=4, index_head_dim=32)
    sd = random_state_dict(cfg, torch.Generator().manual_seed(0))
    outs = {}
    for backend in ("torch", "triton"):
        layer = mla.MLA(cfg, dtype=torch.float32, backend=backend, max_workspace_tokens=64)
        layer.load_hf_state_dict(sd)
        cache = mla.PagedLatentCache(cfg, num_blocks=16, block_size=8, dtype=torch.float32)
        g = torch.Generator().manual_seed(1)
        outs[backend] = []
        for step in ([("a", 30), ("b", 5)], [("a", 1), ("b", 1)], [("a", 3)]):
            x = torch.randn(sum(n for _, n in step), 64, generator=g)
            outs[backend].append(layer(x, cache.prepare(step)))
        if backend == "torch":
            batch = cache.prepare([("c", 40)])
            many = build_plan(batch, cfg, 64, gathers=True).sparse
            few = build_plan(batch, cfg, 64, gathers=False).sparse
            assert len(many) == 40 // (64 // 8) and len(few) < len(many)
            assert sum(c.num_rows for c in few) == sum(c.num_rows for c in many) == 40
    for a, b in zip(outs["torch"], outs["triton"]):
        assert rel_err(b, a) <= 1e-5


@pytest.mark.parametrize("fmt", quant.INDEX_FORMATS)
def test_fp8_index_keys_match_deepseeks_form(fmt):
    """DeepSeek's FP8 indexer keys: 132-byte rows (128 e4m3 values of H k, one float32 scale, a
    power of two with ue8m0), and logits over them, on both backends, equal to DeepSeek's form
    computed here from the raw bytes: sum_h relu(q8_h . k8_s) * w_h * q_scale_h * scale * k_scale_s."""
    g = torch.Generator().manual_seed(3)
    d, bs, n_heads = 128, 4, 3
    lens, nq = [9, 14], [2, 3]
    cache, table, keys = _paged(g, lens, bs, d, 10)
    keys_all = cache.view(-1, d).nan_to_num()
    keys_all[5, 7] = 40.0                                            # an outlier the rotation spreads
    h = quant.hadamard(d)
    assert torch.allclose(h @ h.T, torch.eye(d), atol=1e-6)
    rows = quant.quantize_index(keys_all @ h, fmt)
    assert rows.shape == (keys_all.shape[0], 132) and rows.dtype == torch.uint8
    k_scale = rows[:, d:].contiguous().view(torch.float32)[:, 0]
    if fmt == "fp8_ue8m0":
        assert torch.equal(torch.exp2(torch.log2(k_scale).round()), k_scale)
    back = quant.dequantize_index(rows, d)
    assert ((back - keys_all @ h).abs() <= (keys_all @ h).abs() / 16 + k_scale[:, None] * 2 ** -9).all()
    fp8_cache = rows.view(cache.shape[0], bs, -1)

    Tq = sum(nq)
    q = torch.randn(Tq, n_heads, d, generator=g)
    w = torch.randn(Tq, n_heads, generator=g)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    q_rot = q @ h
    x = q_rot.view(Tq, n_heads, 1, d)
    q_scale = x.abs().amax(-1).clamp_min(1e-12) / 448
    if fmt == "fp8_ue8m0":
        q_scale = torch.exp2(torch.ceil(torch.log2(q_scale)))
    q8 = (x / q_scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).double().view(Tq, n_heads, d)
    k8 = rows[:, :d].contiguous().view(torch.float8_e4m3fn).double()
    for backend in ("torch", "triton"):
        got = mla.ops.indexer_logits(quant.fake_quant(q_rot, fmt), w, fp8_cache, table, seqlens, cu, 16, d ** -0.5,
                                     backend=backend)
        t = 0
        for b, (n, m) in enumerate(zip(lens, nq)):
            slots = [_slot(table, b, s, bs) for s in range(n)]
            for i in range(m):
                dots = torch.relu(q8[t] @ k8[slots].T)                              # [n_heads, n]
                want = ((w[t].double() * q_scale[t, :, 0].double() * d ** -0.5)[:, None] * dots).sum(0)
                want = want * k_scale[slots].double()
                seen = n - m + i + 1
                assert torch.allclose(got[t, :seen].double(), want[:seen], rtol=1e-5, atol=1e-6), (backend, t)
                assert torch.isneginf(got[t, seen:]).all()
                t += 1


def test_fp8_index_cache_in_the_layer():
    """A sparse layer over a cache with FP8 index keys: the cache stores 132-byte rows, the layer
    rotates and quantizes its queries to match, and its attention stays close to the bf16-key
    layer's (the selections differ only near the top-k boundary); refusals name index_format."""
    cfg = mla.MLAConfig(hidden_size=64, num_heads=3, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                        qk_rope_head_dim=16, v_head_dim=16, max_position_embeddings=256, index_topk=8,
                        index_n_heads=4, index_head_dim=128)
    from mla.testing import random_state_dict
    sd = random_state_dict(cfg, torch.Generator().manual_seed(0))
    outs = {}
    for fmt in (None, "fp8_ue8m0"):
        layer = mla.MLA(cfg, dtype=torch.float32, backend="torch")
        layer.load_hf_state_dict(sd)
        cache = mla.PagedLatentCache(cfg, num_blocks=16, block_size=8, dtype=torch.float32, index_format=fmt)
        assert cache.index_keys(0).shape[-1] == (132 if fmt else 128)
        g = torch.Generator().manual_seed(1)
        outs[fmt] = []
        for step in ([("a", 30)], [("a", 1)], [("a", 3)]):
            x = torch.randn(sum(n for _, n in step), 64, generator=g)
            outs[fmt].append(layer(x, cache.prepare(step)))
        cache.fork("a", "b")
        cache.truncate("b", 20)
        outs[fmt].append(layer(torch.randn(1, 64, generator=g), cache.prepare([("b", 1)])))
    for a, b in zip(outs[None], outs["fp8_ue8m0"]):
        assert torch.isfinite(b).all() and rel_err(b, a) < 0.3
    with pytest.raises(ValueError, match="index_format"):
        mla.PagedLatentCache(cfg, num_blocks=4, block_size=8, index_format="fp4")
    with pytest.raises(ValueError, match="index_format.*power of two"):
        mla.PagedLatentCache(cfg.replace(index_head_dim=96), num_blocks=4, block_size=8, index_format="fp8")
    with pytest.raises(ValueError, match="index_format.*no sparse indexer"):
        mla.PagedLatentCache(mla.MLAConfig.preset("tiny"), num_blocks=4, block_size=8, index_format="fp8")
