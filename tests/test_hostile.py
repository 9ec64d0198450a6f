"""Hostile inputs: strided index tensors give the contiguous call's answer, bad
gather values and hand-built batches are refused, integer arguments are ints, the cache refuses
a non-finite kv_scale and a pool the machine cannot hold, and NaN stays NaN in FP8 rows. Every
case on both backends where both exist (the "triton" backend runs Triton's interpreter here)."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import hf_util as H
import mla
from hf_util import Harness
from mla import quant
from mla.ops import gather_latent, mla_decode, prefill_attention, quantize_act_1x128, rope_append

BACKENDS = ["torch", "triton"]


def raises(*words):
    """pytest.raises(ValueError) whose message holds every one of ``words`` (literals)."""
    return pytest.raises(ValueError, match="(?s)" + "".join(f"(?=.*{re.escape(str(w))})" for w in words))


def i32(*rows):
    return torch.tensor(rows, dtype=torch.int32)


def column_major(t: torch.Tensor) -> torch.Tensor:
    """The same values, stored column by column (strides (1, rows))."""
    return t.t().contiguous().t()


def spread(t: torch.Tensor) -> torch.Tensor:
    """The same 1-D values at stride 2 (every other element of a buffer filled with junk)."""
    buf = torch.full((2 * t.shape[0],), 77, dtype=t.dtype)
    buf[::2] = t
    return buf[::2]


def same(a, b):
    """Equal results, NaN and inf positions included."""
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)


# ---------------------------------------------------------------------------------------
# 1. strided index tensors: the same answer as the contiguous call

def _decode_inputs():
    """3 sequences, s_q 2, 3 heads, d = 16 + 8; 13 blocks of 4 rows, shuffled, 4 table columns."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 2, 3, 24, generator=g)
    kv = torch.randn(13, 4, 24, generator=g)
    table = torch.randperm(13, generator=g)[:12].view(3, 4).int()
    return q, kv, table, i32(13, 2, 16)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["column-major table", "column-sliced table", "strided seqlens", "all"])
def test_decode_strided_index_tensors(backend, layout):
    q, kv, table, lens = _decode_inputs()
    want = mla_decode(q, kv, table, lens, 16, 0.3, backend=backend)
    wide = torch.full((3, 9), -5, dtype=torch.int32)
    wide[:, 2:6] = table
    t, l = {"column-major table": (column_major(table), lens), "column-sliced table": (wide[:, 2:6], lens),
            "strided seqlens": (table, spread(lens)), "all": (column_major(table), spread(lens))}[layout]
    assert not (t.is_contiguous() and l.is_contiguous())
    same(mla_decode(q, kv, t, l, 16, 0.3, backend=backend), want)
    # q and the cache through strided views too
    qs = torch.cat([q, q], -1)[..., :24]
    kvs = torch.cat([kv, kv], -1)[..., 24:]
    same(mla_decode(qs, kvs, t, l, 16, 0.3, backend=backend), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_strided_offsets(backend):
    g = torch.Generator().manual_seed(2)
    lq, lk = [3, 0, 4], [5, 2, 6]
    q, k, v = torch.randn(7, 2, 24, generator=g), torch.randn(13, 2, 24, generator=g), torch.randn(13, 2, 16, generator=g)
    cu_q, cu_k = (torch.tensor([0] + l).cumsum(0).int() for l in (lq, lk))
    want = prefill_attention(q, k, v, cu_q, cu_k, 0.2, backend=backend)
    same(prefill_attention(q, k, v, spread(cu_q), spread(cu_k), 0.2, backend=backend), want)
    vs = torch.cat([v, v], -1)[..., 16:]
    same(prefill_attention(q, k, vs, spread(cu_q), cu_k, 0.2, backend=backend), want)


def _append_inputs(T=5, H=3, r=8, dr=4):
    g = torch.Generator().manual_seed(3)
    q_pe, k_pe = torch.randn(T, H, dr, generator=g), torch.randn(T, dr, generator=g)
    c_kv = torch.randn(T, r, generator=g)
    ang = torch.rand(T, dr // 2, generator=g) * 6
    return q_pe, k_pe, c_kv, ang.cos(), ang.sin(), torch.tensor([9, -1, 0, 14, 3])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_rope_append_strided_slots_and_cos(backend, dtype):
    def run(strided):
        q_pe, k_pe, c_kv, cos, sin, slots = _append_inputs()
        kv = torch.zeros(4, 4, 12, dtype=dtype)
        if strided:
            cos, sin, slots = column_major(cos), column_major(sin), spread(slots)
            assert not (cos.is_contiguous() or slots.is_contiguous())
        rope_append(q_pe, k_pe, c_kv, cos, sin, kv, slots, True, kv_scale=0.5 if dtype != torch.float32 else 1.0,
                    backend=backend)
        return q_pe, k_pe, kv.float()
    same(run(True), run(False))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_strided_index_tensors(backend):
    kv = torch.randn(9, 4, 12)
    table = torch.randperm(9, generator=torch.Generator().manual_seed(4))[:6].view(2, 3).int()
    starts, cu = i32(1, 3), i32(0, 7, 13)
    want = gather_latent(kv, table, starts, cu, 13, backend=backend)
    got = gather_latent(kv, column_major(table), spread(starts), spread(cu), 13, backend=backend)
    same((got,), (want,))
    assert torch.equal(want[:7], kv[table[0].long()].flatten(0, 1)[1:8])


# ---------------------------------------------------------------------------------------
# 2. gather_latent: values checked on CPU, and the kernel itself never reads out of bounds

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("table, starts, cu, n, words", [
    ([[0, 9], [2, 3]], [1, 0], [0, 7, 9], 9, ("block_table", "[0, 9)", "block_table[0, 1] = 9")),
    ([[0, -1], [2, 3]], [1, 0], [0, 7, 9], 9, ("block_table", "block_table[0, 1] = -1")),
    ([[0, 1], [2, 3]], [3, 0], [0, 7, 9], 9, ("block_table", "past block_table.shape[1] = 2")),
    ([[0, 1], [2, 3]], [-1, 0], [0, 7, 9], 9, ("starts", ">= 0", "-1")),
    ([[0, 1], [2, 3]], [1, 0], [0, 7, 9], 12, ("cu_seqlens", "num_tokens = 12")),
    ([[0, 1], [2, 3]], [1, 0], [0, 7, 5], 5, ("cu_seqlens", "non-decreasing")),
    ([[0, 1], [2, 3]], [1, 0], [0, 7, 9], True, ("num_tokens", "int")),
    ([[0, 1], [2, 3]], [1, 0], [0, 7, 9], -1, ("num_tokens", "int")),
])
def test_gather_values_refused(backend, table, starts, cu, n, words):
    kv = torch.randn(9, 4, 12)
    with raises(*words):
        gather_latent(kv, i32(*table), i32(*starts), i32(*cu), n, backend=backend)


def test_gather_tail_past_the_table_is_free():
    """Entries a sequence does not reach may hold anything (-1 pads)."""
    kv = torch.randn(9, 4, 12)
    table, starts, cu = i32([0, -1], [2, 99]), i32(1, 0), i32(0, 3, 5)
    outs = [gather_latent(kv, table, starts, cu, 5, backend=b) for b in BACKENDS]
    same(outs[:1], outs[1:])


def test_gather_kernel_clamps_unchecked_values():
    """What CUDA callers may pass unchecked, straight to the kernel (the interpreter reads real
    memory: an out-of-bounds read would crash or show garbage): block ids out of the pool and
    negative, starts past the table, num_tokens past cu_seqlens[-1]. Rows stay in the pool;
    rows past the last offset are zeros."""
    from mla.ops import gather

    kv = torch.randn(3, 4, 12)
    table, starts, cu = i32([1, 2**30], [-2**30, 0]), i32(-50, 10**6), i32(0, 6, 9)
    out = gather.gather_latent(kv, table, starts, cu, 14)
    assert torch.isfinite(out).all()
    rows = kv.flatten(0, 1)
    assert all(any(torch.equal(o, r) for r in rows) for o in out[:9])
    assert (out[9:] == 0).all()


def test_append_kernel_skips_slots_past_the_pool():
    """Unchecked on CUDA: the kernel writes no row for a slot past the pool."""
    from mla.ops import cache_append

    q_pe, k_pe, c_kv, cos, sin, _ = _append_inputs()
    guard = torch.zeros(3, 4, 12)
    kv = guard[:2]
    cache_append.rope_append(q_pe, k_pe, c_kv, cos, sin, kv, torch.tensor([8, 2**40, 3, -1, 0]), False)
    assert (guard[2] == 0).all()
    written = kv.flatten(0, 1).abs().sum(-1) > 0
    assert written.nonzero().flatten().tolist() == [0, 3]

@pytest.mark.parametrize("schedule", ["plan", "flat", "persistent"])
@pytest.mark.parametrize("block_size", [16, 4])     # one table read a 16-key tile; a gather per key
def test_decode_kernel_clamps_unchecked_values(block_size, schedule):
    """Unchecked on CUDA, straight to the portable kernel (the interpreter reads real memory):
    block ids past the pool and negative, lengths negative and past the table. The kernel reads
    them clamped (ids to the pool, lengths to 0 .. the table's capacity), on each of its
    schedules: the reference over the clamped values, in float32."""
    import dataclasses

    from mla.ops import reference
    from mla.ops.decode import portable

    g = torch.Generator().manual_seed(5)
    kv = torch.randn(5, block_size, 40, generator=g)
    q = torch.randn(3, 1, 3, 40, generator=g)
    table = i32([4, 2**30, 1], [-2**30, 0, 3], [2, 2, 2])
    lens = i32(3 * block_size + 10**6, -7, 2 * block_size + 1)
    cfg = dataclasses.replace(portable.default_config(q, 3 * block_size), num_splits=3, flat=schedule == "flat",
                              persistent=schedule == "persistent")     # the latter two run with splits only
    got = portable.launch(q, kv, table, lens, 32, 0.3, True, cfg)
    want = reference.mla_decode(q, kv, table.clamp(0, 4), lens.clamp(0, 3 * block_size), 32, 0.3)
    for g_, w in zip(got, want):
        torch.testing.assert_close(g_, w, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------
# 3. only the cache's own prepare makes batches that write into it

@pytest.fixture
def h():
    h = Harness("v3", torch.float32, seed=41, block_size=4, num_blocks=8)
    h.step([(0, 5), (1, 3)])
    return h


@pytest.mark.parametrize("forge", ["by hand", "a copy", "another cache's"])
def test_hand_built_batch_refused(h, forge):
    real = h.cache.prepare([(0, 1), (1, 1)])
    if forge == "by hand":
        fake = mla.Batch(seq_ids=real.seq_ids, num_cached=real.num_cached, num_new=real.num_new,
                         positions=real.positions, slot_mapping=real.slot_mapping.flip(0),
                         block_table=real.block_table, cache_seqlens=real.cache_seqlens,
                         cu_seqlens_q=real.cu_seqlens_q, cu_seqlens_k=real.cu_seqlens_k, block_size=4,
                         cache=h.cache, versions=real.versions, _checked=real._checked)
    elif forge == "a copy":
        fake = dataclasses.replace(real, slot_mapping=real.slot_mapping.flip(0))
    else:   # the layer writes where batch.cache says: this cache refuses it when asked
        other = mla.PagedLatentCache(h.cfg, num_blocks=8, block_size=4, dtype=torch.float32)
        fake = other.prepare([(0, 1), (1, 1)])
        with raises("batch", "prepare"):
            h.cache.check_batch(fake)
        fake = dataclasses.replace(fake, cache=h.cache)
    kv = h.cache.kv.clone()
    with raises("batch", "prepare"):
        h.layers[0](h.new_inputs(2), fake)
    assert torch.equal(h.cache.kv, kv)
    h.layers[0](h.new_inputs(2), real)      # the real one still runs
    with raises("batch", "prepare"):
        h.cache.check_batch("not a batch")


# ---------------------------------------------------------------------------------------
# 6. the cache's constructor

@pytest.mark.parametrize("kv_scale", [float("inf"), float("nan"), 0.0, -1.0, True, "1"])
def test_cache_kv_scale(kv_scale):
    with raises("kv_scale", "finite", "> 0"):
        mla.PagedLatentCache(mla.MLAConfig.preset("tiny"), dtype=torch.float8_e4m3fn, kv_scale=kv_scale)


def test_cache_too_large_names_num_blocks_and_bytes():
    cfg = mla.MLAConfig.preset("tiny")
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    with raises("num_blocks", str(2**40), f"{2**40 * 64 * width * 2} bytes"):
        mla.PagedLatentCache(cfg, num_blocks=2**40, block_size=64, dtype=torch.bfloat16)
    # "meta" storage takes no memory, but the host's block lists would
    with raises("num_blocks", "host"):
        mla.PagedLatentCache(cfg, num_blocks=2**40, device="meta")
    assert mla.PagedLatentCache(cfg, num_blocks=2**16, device="meta").num_free_blocks == 2**16


# ---------------------------------------------------------------------------------------
# 7. integer arguments are ints (not bools), switches are bools

@pytest.mark.parametrize("backend", BACKENDS)
def test_ints_and_flags(backend):
    q, kv, table, lens = _decode_inputs()
    with raises("head_dim_v", "int", "True"):
        mla_decode(q, kv, table, lens, True, 0.3, backend=backend)
    with raises("causal", "bool", "'false'"):
        mla_decode(q, kv, table, lens, 16, 0.3, causal="false", backend=backend)
    with raises("softmax_scale", "True"):
        mla_decode(q, kv, table, lens, 16, True, backend=backend)
    with raises("kv_scale", "> 0"):
        mla_decode(q, kv.to(torch.float8_e4m3fn), table, lens, 16, 0.3, kv_scale=0.0, backend=backend)
    qp, kp, vp = torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    with raises("max_seqlen_q", "True"):
        prefill_attention(qp, kp, vp, i32(0, 4), i32(0, 4), 0.2, max_seqlen_q=True, backend=backend)
    with raises("causal", "bool"):
        prefill_attention(qp, kp, vp, i32(0, 4), i32(0, 4), 0.2, causal=torch.tensor(True), backend=backend)
    q_pe, k_pe, c_kv, cos, sin, slots = _append_inputs()
    with raises("interleave", "bool"):
        rope_append(q_pe, k_pe, c_kv, cos, sin, torch.zeros(4, 4, 12), slots, 1, backend=backend)
    with raises("q_pe", "overlapping"):
        rope_append(q_pe[:, :1].expand(-1, 3, -1), k_pe, c_kv, cos, sin, torch.zeros(4, 4, 12), slots, True,
                    backend=backend)
    with raises("c_kv", "tensor"):
        rope_append(q_pe, k_pe, None, cos, sin, torch.zeros(4, 4, 12), slots, True, backend=backend)


def test_cache_ints():
    cache = mla.PagedLatentCache(mla.MLAConfig.preset("tiny"), num_blocks=4, block_size=4, dtype=torch.float32)
    for kwargs in ({"num_blocks": True}, {"block_size": True}, {"num_layers": True}):
        with raises(next(iter(kwargs)), "int"):
            mla.PagedLatentCache(mla.MLAConfig.preset("tiny"), dtype=torch.float32, **kwargs)
    with raises("layer_idx"):
        cache.layer(False)
    cache.prepare([("a", 3)])
    with raises("new_length"):
        cache.truncate("a", True)
    with raises("requests", "int"):
        cache.prepare([("a", True)])
    assert cache.length("a") == 3 and cache.num_free_blocks == 3


# ---------------------------------------------------------------------------------------
# 8. NaN / inf into FP8 rows: NaN stays NaN (as bf16 keeps it), +-inf saturate (per-tensor)

@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_rows_keep_nan(backend):
    q_pe, k_pe, c_kv, cos, sin, _ = _append_inputs(T=3, r=128)
    c_kv[0, 1], c_kv[1, 2], c_kv[2, 3] = float("nan"), float("inf"), -float("inf")
    slots = torch.tensor([0, 1, 2])
    kv8 = torch.zeros(1, 4, 132, dtype=torch.float8_e4m3fn)
    rope_append(q_pe.clone(), k_pe.clone(), c_kv, cos, sin, kv8, slots, True, kv_scale=0.5, backend=backend)
    rows = kv8[0, :3].float()
    assert rows[0, 1].isnan() and rows[1, 2] == 448 and rows[2, 3] == -448
    assert rows.isnan().sum() == 1 and torch.isfinite(rows[:, 4:]).all()
    want = quant.quantize_rows(torch.cat((c_kv, k_pe), -1), "fp8", 128, 0.5)   # the rows' values, ignoring RoPE
    assert torch.equal(rows[:, :128].isnan(), want[:, :128].float().isnan())
    # tile rows: a tile with a NaN or an inf reads back as NaN; k_pe (bf16) and clean rows are untouched
    kvt = torch.zeros(1, 4, 128 + 4 + 8, dtype=torch.uint8)
    c_kv = torch.cat((c_kv, torch.randn(1, 128)))
    q_pe, k_pe, cos, sin = (torch.cat((t, t[:1])) for t in (q_pe, k_pe, cos, sin))
    rope_append(q_pe, k_pe, c_kv, cos, sin, kvt, torch.tensor([0, 1, 2, 3]), True, backend=backend)
    back = quant.dequantize_rows(kvt[0], "fp8_tile", 128)
    assert back[:3, :128].isnan().all() and torch.isfinite(back[3]).all() and torch.isfinite(back[:, 128:]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_act_quant_keeps_nan(backend):
    x = torch.randn(3, 200)
    x[0, 3], x[1, 150] = float("nan"), float("inf")
    ref_q, ref_s = mla.ops.reference.quantize_act_1x128(x)
    x_q, x_s = quantize_act_1x128(x, backend=backend)
    assert torch.equal(x_q.float().isnan(), ref_q.float().isnan()) and x_q[0, :128].float().isnan().all()
    same((x_s,), (ref_s,))
    assert torch.isfinite(x_q[2].float()).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_over_nan_fp8_row_gives_nan(backend):
    """A NaN hidden state's row in an FP8 cache: the queries that see it give NaN, the others
    (an earlier causal query, another sequence) stay finite."""
    g = torch.Generator().manual_seed(5)
    q_pe, k_pe, c_kv, cos, sin, _ = _append_inputs(T=6, H=2, r=16, dr=8)
    c_kv[4, 0] = float("nan")
    kv8 = torch.zeros(4, 4, 24, dtype=torch.float8_e4m3fn)
    # sequence 0: tokens 0..4 in blocks 0, 1 (slots 0..4); sequence 1: token 5 in block 2
    rope_append(q_pe, k_pe, c_kv, cos, sin, kv8, torch.tensor([0, 1, 2, 3, 4, 8]), True, kv_scale=0.25,
                backend=backend)
    q = torch.randn(2, 2, 2, 24, generator=g)
    out, lse = mla_decode(q, kv8, i32([0, 1], [2, 3]), i32(5, 1), 16, 0.3, kv_scale=0.25, backend=backend)
    assert out[0, 1].isnan().all() and lse[0, 1].isnan().all()     # the last query sees token 4
    # the one before does not: its scores stay finite (its value sum meets the NaN as 0 * NaN in
    # P @ V, on every backend, as with a bf16 cache)
    assert torch.isfinite(lse[0, 0]).all()
    assert torch.isfinite(out[1]).all() and torch.isfinite(lse[1, 1]).all()   # another sequence
