"""GLM-5.3-Flash (transformers' glm5_next): MLA without a RoPE part (qk_rope_head_dim 0: the cache
row is the latent alone) on every op and path, the k-pool sparse indexer, and the layer exact
against Glm5NextTextAttention.

Without RoPE every op takes d = kv_lora_rank rows: the references, the portable Triton kernels
(Triton's interpreter here, float32 and float16) and the layer's paths are checked on them
against float64 oracles.
"""
from __future__ import annotations

import copy

import pytest
import torch

import hf_families as F
import mla
from hf_util import FP32_TOL, rel_err
from mla import quant
from mla.testing import dense_forward, random_state_dict
from test_decode_kernel import check as check_decode
from test_sparse import decode_case, rows_of, sparse_oracle

BACKENDS = ["torch", "triton"]
NOPE = mla.MLAConfig(hidden_size=64, num_heads=3, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                     qk_rope_head_dim=0, v_head_dim=24, max_position_embeddings=256, rope_type="none")


# ---------------------------------------------------------------------------------------
# qk_rope_head_dim 0: the ops and the layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_decode_kernel_without_rope(dtype):
    """The portable decode kernel over latent-only rows (d = dv): varlen, s_q 3, an empty row."""
    check_decode([0, 3, 37], 3, 3, dv=64, dr=0, block_size=16, dtype=dtype, device="cpu", seed=4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", quant.CACHE_FORMATS)
def test_rope_append_without_rope(fmt, backend):
    """rope_append with dr 0 writes c_kv alone, in every row format, the same bytes on both
    backends (skipped and out-of-range slots untouched); decode and sparse decode over the rows
    match the float64 oracle on the dequantized rows."""
    g = torch.Generator().manual_seed(len(fmt))
    r, H, T, nb, bs = 128, 3, 6, 5, 4
    kv_scale = 0.5 if fmt == "fp8" else 1.0
    width = quant.row_width(fmt, r, 0)
    assert width == (r + 4 if fmt == "fp8_tile" else r)
    dtype = torch.float8_e4m3fn if fmt == "fp8" else torch.float32
    kv = torch.zeros(nb, bs, width, dtype=quant.storage_dtype(fmt, dtype))
    c_kv = torch.randn(T, r, generator=g)
    slots = torch.tensor([3, 2, -1, 9, 15, 0])
    empty = torch.zeros(T, 0)
    mla.ops.rope_append(torch.zeros(T, H, 0), empty, c_kv, empty, empty, kv, slots, True, kv_scale=kv_scale,
                        backend=backend)
    stored = kv.view(nb * bs, width)
    want = quant.quantize_rows(c_kv, fmt, r, kv_scale) if fmt != "plain" else c_kv
    keep = slots >= 0
    assert torch.equal(stored[slots[keep]].view(torch.uint8) if fmt != "plain" else stored[slots[keep]],
                       want[keep].view(torch.uint8) if fmt != "plain" else want[keep])
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert (stored[untouched].float() == 0).all()
    values = quant.dequantize_rows(stored, fmt, r, torch.float32, kv_scale)
    q = torch.randn(2, 2, H, r, generator=g)
    table = torch.tensor([[1, 0, 3], [0, 2, 4]], dtype=torch.int32)
    lens = torch.tensor([7, 3], dtype=torch.int32)
    out, lse = mla.ops.mla_decode(q, kv, table, lens, r, 0.1, kv_scale=kv_scale, backend=backend)
    for b, n in enumerate(lens.tolist()):
        keys = torch.stack([values[int(table[b, s // bs]) * bs + s % bs] for s in range(n)]).double()
        for i in range(2):
            seen = keys[: n - 2 + i + 1]
            o, l = sparse_oracle(q[b, i][None], [seen], 0.1, r)
            assert torch.allclose(out[b, i].double(), o[0], atol=1e-5) and torch.allclose(lse[b, i].double(), l[0],
                                                                                           atol=1e-5)
    idx = torch.tensor([[[0, 5, -1], [3, 2, 9]], [[9, 15, -1], [-1, -1, -1]]], dtype=torch.int32)
    out, lse = mla.ops.sparse_mla_decode(q, kv, idx, r, 0.1, kv_scale=kv_scale, backend=backend)
    want_o, want_l = sparse_oracle(q.view(4, H, r), rows_of(values, idx), 0.1, r)
    assert torch.allclose(out.view(4, H, r).double(), want_o, atol=1e-5)
    assert torch.equal(lse.view(4, H).isinf(), want_l.isinf()) and (out[1, 1] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_and_prefill_ops_without_rope(backend):
    """Sparse decode over NaN-filled pages and the varlen prefill with q/k of dn values only."""
    g = torch.Generator().manual_seed(2)
    H, r = 3, 64
    cache, flat, idx, _ = decode_case(g, H, r, dr=0)
    q = torch.randn(2, 3, H, r, generator=g)
    out, lse = mla.ops.sparse_mla_decode(q, cache, idx, r, 0.1, backend=backend)
    want_o, want_l = sparse_oracle(q.view(6, H, r), rows_of(flat, idx), 0.1, r)
    assert not out.isnan().any() and torch.equal(lse.view(6, H).isinf(), want_l.isinf())
    assert torch.allclose(out.view(6, H, r).double(), want_o, atol=1e-5)
    qq, kk, vv = (torch.randn(n, H, d, generator=g) for n, d in ((7, 16), (9, 16), (9, 24)))
    cu_q, cu_k = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32)
    o, l = mla.ops.prefill_attention(qq, kk, vv, cu_q, cu_k, 0.25, backend=backend)
    for b in range(2):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        for i in range(q1 - q0):
            seen = slice(k0, k0 + (k1 - k0) - (q1 - q0) + i + 1)
            s = torch.einsum("hd,khd->hk", qq[q0 + i].double(), kk[seen].double()) * 0.25
            want = torch.einsum("hk,khd->hd", s.softmax(-1), vv[seen].double())
            assert torch.allclose(o[q0 + i].double(), want, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("strategy", [None, "cached", "chunked", "absorbed"])
def test_layer_without_rope_every_path(strategy, backend):
    """A dr 0 layer (cache rows of kv_lora_rank values) on every path, a prefix reuse by fork and
    a chunk past the workspace, against the float64 dense oracle of each whole sequence."""
    sd = random_state_dict(NOPE, torch.Generator().manual_seed(0))
    layer = mla.MLA(NOPE, dtype=torch.float32, backend=backend, max_workspace_tokens=8, strategy=strategy)
    layer.load_hf_state_dict(sd)
    cache = mla.PagedLatentCache(NOPE, num_blocks=24, block_size=4, dtype=torch.float32)
    assert cache.layer(0).shape[-1] == NOPE.kv_lora_rank
    g = torch.Generator().manual_seed(1)
    hist = {}
    for step in ([("a", 10), ("b", 5)], [("a", 1), ("b", 1)], "fork", [("a", 12), ("c", 3)], [("c", 1)]):
        if step == "fork":
            cache.fork("b", "c")
            hist["c"] = hist["b"]
            continue
        x = torch.randn(sum(n for _, n in step), NOPE.hidden_size, generator=g)
        out, off = layer(x, cache.prepare(step)), 0
        for seq, n in step:
            hist[seq] = torch.cat([hist.get(seq, x[:0]), x[off: off + n]])
            want = dense_forward(layer, hist[seq])[-n:]
            assert rel_err(out[off: off + n], want) <= FP32_TOL, (step, seq)
            off += n


# ---------------------------------------------------------------------------------------
# from_hf


KPOOL = F.KPOOL["glm5_next_text"]


@pytest.mark.parametrize("source", ["object", "dict", "wrapped"])
def test_from_hf_reads_glm5_next(source):
    """The text config, its dict, or the published multimodal Glm5NextConfig around it: no RoPE,
    the latent norms at rms_norm_eps, the k-pool indexer, the MLA layers (linear attention
    excluded) and the shared one."""
    hf_cfg = KPOOL.make_config()
    src = F.config_source(hf_cfg, "dict" if source == "dict" else "object")
    if source == "wrapped":
        src = F._cls("glm5_next", "Glm5NextConfig")(text_config=hf_cfg.to_dict())
    cfg = mla.MLAConfig.from_hf(src)
    assert (cfg.qk_rope_head_dim, cfg.rope_type, cfg.kv_dim) == (0, "none", 32)
    assert cfg.q_norm_eps == cfg.kv_norm_eps == 1e-5 and cfg.index_k_norm_eps == 1e-6
    assert (cfg.index_topk, cfg.index_kpool, cfg.index_n_heads, cfg.index_head_dim) == (8, 4, 8, 16)
    assert cfg.mla_layers == (1, 2) and cfg.index_shared_layers == (2,) and cfg.index_source_layer(2) == 1
    assert cfg.sparse_max_keys == 11 and cfg.index_row_dim == 32
    attn, _ = F.make_attention(KPOOL, hf_cfg, 0)
    assert cfg.softmax_scale == pytest.approx(attn.scaling, rel=1e-12)
    assert set(mla.weights.hf_weight_shapes(cfg, 1)) == {k for k in F.state_dict(attn, "")}
    assert not any(k.startswith("indexer.") for k in mla.weights.hf_weight_shapes(cfg, 2))


def test_from_hf_config_json_defaults():
    """A config.json without the keys Glm5NextTextConfig derives (layer_types, indexer_types from
    index_topk_pattern or index_topk_freq, index_kpool, rms_norm_eps, qk_rope_head_dim) reads as
    the class does; a linear-attention layer's indexer_types entry means nothing."""
    keys = dict(hidden_size=64, num_attention_heads=3, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
                v_head_dim=24, num_hidden_layers=8, index_topk=32, index_n_heads=2, index_head_dim=16,
                num_key_value_heads=3)
    cls = F._cls("glm5_next", "Glm5NextTextConfig")
    for extra in ({}, {"index_topk_pattern": "SSSFSSSF"}, {"index_topk_freq": 2, "index_skip_topk_offset": 0}):
        raw = dict(keys, model_type="glm5_next_text", **extra)
        ours = mla.MLAConfig.from_hf(raw)
        assert ours == mla.MLAConfig.from_hf(cls(**keys, **extra))
        assert ours.mla_layers == (3, 7) and ours.index_kpool == 16 and ours.q_norm_eps == 1e-5
        assert ours.index_shared_layers == ()
    with pytest.raises(ValueError, match="indexer_types.*layer 7"):   # after a linear-attention layer
        mla.MLAConfig.from_hf(dict(keys, model_type="glm5_next_text", index_topk_pattern="FFFFFFFS"))
    published = mla.MLAConfig.from_hf(F._cls("glm5_next", "Glm5NextConfig")())    # the class defaults
    assert published.mla_layers == tuple(range(3, 45, 4)) and published.kv_dim == 512
    assert (published.index_kpool, published.sparse_max_keys, published.index_row_dim) == (16, 2063, 256)
    flat = dict(keys, model_type="glm5_next", num_hidden_layers=4, index_topk_pattern="FFSF",
                layer_types=["linear_attention", "full_attention", "full_attention", "linear_attention"])
    assert mla.MLAConfig.from_hf(flat).index_shared_layers == (2,)


def test_from_hf_refusals():
    d = KPOOL.make_config().to_dict()
    with pytest.raises(NotImplementedError, match="index_kpool_always_select_tail"):
        mla.MLAConfig.from_hf(dict(d, index_kpool_always_select_tail=False))
    assert mla.MLAConfig.from_hf(dict(d, index_kpool=1, index_kpool_always_select_tail=False)).sparse_max_keys == 8
    with pytest.raises(ValueError, match="index_kpool"):
        mla.MLAConfig.from_hf(dict(d, index_kpool=3))
    with pytest.raises(ValueError, match="indexer_types.*layer 1"):    # the layer before is linear attention
        mla.MLAConfig.from_hf(dict(d, indexer_types=["full", "shared", "full"]))
    with pytest.raises(ValueError, match="indexer_types.*layer 2"):    # a shared layer hands no top-k on
        mla.MLAConfig.from_hf(dict(d, num_hidden_layers=4, indexer_types=["full", "full", "shared", "shared"],
                                   layer_types=["linear_attention"] + ["deepseek_sparse_attention"] * 3))
    v32 = F.SPARSE["deepseek_v32"].make_config().to_dict()
    with pytest.raises(NotImplementedError, match="index_kpool"):
        mla.MLAConfig.from_hf(dict(v32, index_kpool=4))
    cfg = mla.MLAConfig.from_hf(d)
    with pytest.raises(ValueError, match="index_format.*k-pool"):
        mla.PagedLatentCache(cfg, num_layers=3, num_blocks=4, block_size=4, index_format="fp8")
    with pytest.raises(ValueError, match="index_kpool"):
        cfg.replace(index_kpool=3)
    with pytest.raises(ValueError, match="layer_idx.*not an MLA layer"):
        mla.MLA(cfg, layer_idx=0)


# ---------------------------------------------------------------------------------------
# the layer against Glm5NextTextAttention


def _selection(h, batch, seq, n):
    """Our selection of the step's n new tokens of ``seq`` as sets of positions, and the module's
    (its own indexer over the whole sequence, float64)."""
    attn = h.attn_ref
    x = h.hist[seq].double()[None]
    L = x.shape[1]
    theirs = attn.indexer(x, attn.q_a_layernorm(attn.q_a_proj(x)), torch.ones(1, L, dtype=torch.bool), None)[0, -n:]
    vals = [v for k, v in batch._memo.items() if isinstance(k, tuple) and k[0] == "sparse_indices"]
    ours = torch.cat(vals[0])
    blocks, bs = h.cache.blocks(seq), h.cache.block_size
    slot_to_pos = {blocks[p // bs] * bs + p % bs: p for p in range(L)}
    return ([{slot_to_pos[s] for s in row.tolist() if s >= 0} for row in ours],
            [{int(s) for s in row.tolist() if s >= 0} for row in theirs])


def test_prompt_decode_drafts_fork():
    """A 40-token prompt (pools of 4, top-2 pools + the open pool: 11 keys at most), decodes, s_q 3
    drafts with rollback and a fork, float32 within FP32_TOL of the float64 module; the selection
    of every query is the module's."""
    h = F.FamilyHarness("glm5_next_text", torch.float32, seed=1)
    seen = {}
    h.step([(0, 40)], on_batch=lambda b: seen.update(batch=b))
    assert h.layer.plan(seen["batch"]).strategy == ["sparse"]
    ours, theirs = _selection(h, seen["batch"], 0, 40)
    assert ours == theirs
    assert [len(s) for s in ours] == [min(p + 1, 8 + (p + 1) % 4) for p in range(40)]
    h.step([(0, 1)], on_batch=lambda b: seen.update(batch=b))
    assert _selection(h, seen["batch"], 0, 1)[0] == _selection(h, seen["batch"], 0, 1)[1]
    h.step([(0, 3)])
    h.truncate(0, 42)                  # one draft accepted
    h.step([(0, 1)])
    h.step([(0, 3)], on_batch=lambda b: seen.update(batch=b))
    ours, theirs = _selection(h, seen["batch"], 0, 3)
    assert ours == theirs
    h.truncate(0, 39)                  # back into a complete pool and across a block (block_size 4)
    h.fork(0, 1)
    h.step([(0, 1), (1, 2)])
    h.step([(1, 3), (0, 2)])
    assert max(h.errors) <= FP32_TOL


def test_chunked_prefill_under_a_small_workspace():
    """12 + 28 prompt tokens under max_workspace_tokens 16: the logits come in chunks of at most
    16 * index_head_dim values (a column a pool), the pooled keys from gathers of at most 16 rows
    of whole pools; then a mixed batch: a new short prompt (dense), a decode, a long chunk."""
    h = F.FamilyHarness("glm5_next_text", torch.float32, seed=3, max_workspace_tokens=16)
    h.step([(0, 12)])                  # 12 > 11 keys: sparse from the first step
    plans = []
    h.step([(0, 28)], on_batch=lambda b: plans.append(h.layer.plan(b)))
    plan = plans[0]
    assert len(plan.sparse) > 1 and len(plan.pools.chunks) == len(plan.sparse)
    for c, p in zip(plan.sparse, plan.pools.chunks):
        assert c.num_rows * p.max_pools <= 16 * h.cfg.index_head_dim and p.max_pools == max(c.ends) // 4
        assert c.num_rows <= max(1, 16 // h.cfg.sparse_max_keys)
    assert plan.pools.num_pools == 10 and [g.num_tokens for g in plan.pools.gathers] == [16, 16, 8]
    h.step([(1, 6), (0, 1), (2, 20)], on_batch=lambda b: plans.append(h.layer.plan(b)))
    assert plans[-1].strategy == ["prefill", "sparse", "sparse"]
    assert plans[-1].pools.num_pools == 10 + 5
    h.step([(1, 6), (2, 1)])           # seq 1: 12 keys, sparse from here on
    assert max(h.errors) <= FP32_TOL


def test_dense_path_up_to_sparse_max_keys():
    """Up to index_topk + index_kpool - 1 = 11 keys the selection is every key (all complete pools
    and the open pool), and the dense paths serve: forcing the sparse path gives the same; at
    12 keys the last query loses a pool, and the module differs from dense attention there."""
    outs = []
    for strategy in (None, "sparse"):
        h = F.FamilyHarness("glm5_next_text", torch.float32, seed=5, strategy=strategy)
        plans = []
        o1, _ = h.step([(0, 9)], on_batch=lambda b: plans.append(h.layer.plan(b)))
        o2, _ = h.step([(0, 2)], on_batch=lambda b: plans.append(h.layer.plan(b)))
        o3, _ = h.step([(0, 1)], on_batch=lambda b: plans.append(h.layer.plan(b)))
        assert [p.strategy[0] for p in plans] == (["prefill", "absorbed", "sparse"] if strategy is None
                                                  else ["sparse"] * 3)
        outs.append(torch.cat([o1, o2, o3]))
    assert rel_err(outs[1], outs[0]) <= 1e-6
    dense = copy.deepcopy(h.attn_ref)
    dense.indexer.index_topk = 64
    x = h.hist[0].double()
    sparse_out = F.reference(h.case, h.attn_ref, None, x)
    dense_out = F.reference(h.case, dense, None, x)
    assert rel_err(sparse_out[:11], dense_out[:11]) <= 1e-12 and rel_err(sparse_out[11:], dense_out[11:]) > 1e-2


def test_bf16_within_the_modules_own_error():
    """bf16 over a prompt, a decode, drafts and a fork: within 2x the module's own bf16 error (its
    pooled keys are a bf16 sum of bf16 products, as the layer's)."""
    h = F.FamilyHarness("glm5_next_text", torch.bfloat16, seed=2)
    for step in ([(0, 24)], [(0, 1)], [(0, 3)], "fork", [(0, 1), (1, 2)]):
        if step == "fork":
            h.fork(0, 1)
        else:
            h.step(step)
    h.check_bf16()


def test_triton_backend_matches_the_reference_path():
    """The layer on the Triton kernels (interpreter, float32): the pooled keys' gather, the
    indexer's logits over one-row blocks of pooled keys, the sparse attention; the same outputs
    and the same selection as the reference path, step by step."""
    case = KPOOL
    hf_cfg = case.make_config()
    cfg = mla.MLAConfig.from_hf(hf_cfg)
    attn, _ = F.make_attention(case, hf_cfg, 4)
    outs, picks = {}, {}
    for backend in BACKENDS:
        layer = mla.MLA(cfg, layer_idx=1, dtype=torch.float32, backend=backend, max_workspace_tokens=24)
        layer.load_hf_state_dict(F.state_dict(attn, case.prefix), prefix=case.prefix)
        cache = mla.PagedLatentCache(cfg, num_layers=2, num_blocks=24, block_size=4, dtype=torch.float32)
        g = torch.Generator().manual_seed(5)
        outs[backend], picks[backend] = [], []
        for step in ([("a", 21), ("b", 13)], [("a", 1), ("b", 1)], [("a", 3)]):
            x = torch.randn(sum(n for _, n in step), cfg.hidden_size, generator=g)
            batch = cache.prepare(step)
            outs[backend].append(layer(x, batch))
            picks[backend].append([v for k, v in batch._memo.items() if k[0] == "sparse_indices"][0])
    for a, b in zip(outs["torch"], outs["triton"]):
        assert rel_err(b, a) <= 1e-6
    for a, b in zip(picks["torch"], picks["triton"]):     # chunked alike or not, the same rows
        assert torch.equal(torch.cat(a).sort(-1).values, torch.cat(b).sort(-1).values)


def test_shared_layer_reuses_the_selection():
    """Layer 2 ("shared") attends with layer 1's selection on the same batch, as the module fed
    prev_topk_indices does; before layer 1 runs it refuses the batch."""
    F.check_shared_layer("glm5_next_text", KPOOL.make_config(), layers=(1, 2))


# ---------------------------------------------------------------------------------------
# mla.hf.patch (batch 1 and a left-padded batch of 2 with short prompts: tests/test_hf_patch.py)


def test_patch_generates_eager_tokens_from_sparse_prompts():
    """Prompts past 11 keys (the prefill itself sparse; 15 and 9 real tokens, left-padded) on a
    cache built from ``mla.hf.patch_config``: the MLA layers 1 and 2 are mla's (numbered 0 and 1,
    1 reusing 0's selection), the linear-attention layer 0 stays transformers', and greedy
    generate gives eager's tokens."""
    from test_hf_patch import greedy, make_model, stand_ins

    model = make_model("glm5_next_text", seed=2)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 32, (2, 15), generator=g)
    mask = torch.ones(2, 15, dtype=torch.long)
    mask[1, :6], ids[1, :6] = 0, 0
    ref = greedy(model, ids, mask)
    cfg = mla.hf.patch_config(model)
    assert cfg.mla_layers is None and cfg.index_shared_layers == (1,) and cfg.index_kpool == 4
    cache = mla.PagedLatentCache(cfg, num_layers=2, num_blocks=32, block_size=4, dtype=torch.float32)
    linear = model.model.language_model.layers[0].self_attn
    with mla.hf.patch(model, cache) as handle:
        assert len(stand_ins(model)) == 2 and model.model.language_model.layers[0].self_attn is linear
        assert [layer.has_own_indexer for layer in handle.layers] == [True, False]
        assert greedy(model, ids, mask).tolist() == ref.tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_decode_of_latent_only_rows_takes_the_portable_kernel():
    """The Hopper decode kernels take 576-wide rows only: 512-wide ones (no RoPE part) go to the
    portable kernel, which matches the float64 oracle."""
    from mla.ops import decode

    q = torch.empty(2, 1, 16, 512, dtype=torch.bfloat16, device="cuda")
    assert decode.choose_kernel(q, torch.empty(4, 64, 512, dtype=torch.bfloat16, device="cuda"), 512, 256) == "portable"
    check_decode([1, 700, 4096], 2, 16, dv=512, dr=0, block_size=64, dtype=torch.bfloat16, device="cuda", seed=9)
