"""GLM-5.3-Flash (transformers' glm5_next): MLA without a RoPE part (qk_rope_head_dim 0: the cache
row is the latent alone) on every op and path, the k-pool sparse indexer, and the layer exact
against Glm5NextTextAttention.

Without RoPE every op takes d = kv_lora_rank rows: the references, the portable Triton kernels
(Triton's interpreter here, float32 and float16) and the layer's paths are checked on them
against float64 oracles.
"""
from __future__ import annotations

import pytest
import torch

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
