"""The public ops reject bad offsets, lengths, block ids, devices and scales with a ValueError
naming the argument and the expected value, before any kernel runs: an out-of-bounds offset
reaches memory on the Triton path (on CPU the interpreter writes past the tensors and the
process dies), so the error tests replace every implementation with one that fails if called.
Value checks that would read CUDA tensors back stay off the GPU (no stream sync, decode
stays capturable in a CUDA graph): the GPU test below runs the ops with sync debugging on.
"""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from mla.ops import merge_attention, mla_decode, prefill_attention, reference, rope_append

BACKENDS = ["torch", "triton"]
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def raises(*words):
    """pytest.raises(ValueError) whose message holds every one of ``words`` (literals)."""
    return pytest.raises(ValueError, match="(?s)" + "".join(f"(?=.*{re.escape(w)})" for w in words))


def i32(*rows, device="cpu"):
    return torch.tensor(rows, dtype=torch.int32, device=device)


def test_import_mla_imports_no_kernel_module():
    """The ops import their kernel modules where they first run them: Triton stays optional, and
    ``import mla`` compiles and imports no kernel."""
    code = ("import sys, mla, mla.ops; kernels = [m for m in sys.modules if m.startswith(('mla.ops.decode', "
            "'mla.ops.prefill', 'mla.ops.norm', 'mla.ops.merge', 'mla.ops.cache_append', 'mla.ops.gather', "
            "'mla.ops.fp8_gemm', 'mla.ops.indexer', 'mla.ops.sparse_attention', 'mla.ops.latent_rows', "
            "'mla.ops._jit'))]; assert not kernels, kernels")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.fixture
def no_launch(monkeypatch):
    """Every implementation of the three ops fails the test if it is reached."""
    from mla.ops import decode, merge, prefill
    from mla.ops import cache_append

    def launched(*args, **kwargs):
        raise AssertionError("an implementation ran: the error must come before it")
    modules = {"mla_decode": (decode, reference), "prefill_attention": (prefill, reference),
               "merge_attention": (merge, reference), "rope_append": (cache_append, reference)}
    for op, where in modules.items():
        for module in where:
            monkeypatch.setattr(module, op, launched)


# ---------------------------------------------------------------------------------------
# prefill_attention: q [7, 3, 24], k [9, 3, 24], v [9, 3, 16]

def _qkv(Tq=7, Tk=9, H=3, dq=24, dv=16, device="cpu"):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(Tq, H, dq, generator=g).to(device), torch.randn(Tk, H, dq, generator=g).to(device),
            torch.randn(Tk, H, dv, generator=g).to(device))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cu_q, cu_k, words", [
    ([0, 3, 9], [0, 4, 9], ("cu_seqlens_q", "from 0 to Tq = 7")),         # past q's rows
    ([0, 3, 6], [0, 4, 9], ("cu_seqlens_q", "from 0 to Tq = 7")),         # short of them
    ([1, 3, 7], [0, 4, 9], ("cu_seqlens_q", "from 0")),
    ([0, 3, 7], [0, 4, 10], ("cu_seqlens_k", "from 0 to Tk = 9")),
    ([0, 3, 7], [0, 4, 8], ("cu_seqlens_k", "from 0 to Tk = 9")),
    ([0, 3, 5, 7], [0, 4, 2, 9], ("cu_seqlens_k", "non-decreasing")),
    ([0, 5, 3, 7], [0, 4, 6, 9], ("cu_seqlens_q", "non-decreasing")),
])
def test_prefill_offsets_must_fit_the_tensors(no_launch, backend, cu_q, cu_k, words):
    with raises(*words):
        prefill_attention(*_qkv(), i32(*cu_q), i32(*cu_k), 0.2, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_offsets_dtype_shape_device(no_launch, backend):
    q, k, v = _qkv()
    cu_q, cu_k = i32(0, 3, 7), i32(0, 4, 9)
    with raises("cu_seqlens_q", "1-D int32"):
        prefill_attention(q, k, v, cu_q.long(), cu_k, 0.2, backend=backend)
    with raises("cu_seqlens_k", "1-D int32"):
        prefill_attention(q, k, v, cu_q, cu_k[None], 0.2, backend=backend)
    with raises("cu_seqlens_k", "length 3"):
        prefill_attention(q, k, v, cu_q, i32(0, 9), 0.2, backend=backend)
    with raises("cu_seqlens_q", "[B + 1]"):
        prefill_attention(q, k, v, i32(), i32(), 0.2, backend=backend)
    with raises("cu_seqlens_k", "device cpu"):
        prefill_attention(q, k, v, cu_q, cu_k.to("meta"), 0.2, backend=backend)
    with raises("offsets_q", "cu_seqlens_q's values"):   # host offsets that disagree with the tensor
        prefill_attention(q, k, v, cu_q, cu_k, 0.2, offsets_q=[0, 2, 7], backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", ["x", None, "0.2", float("nan"), torch.ones(2)])
def test_prefill_softmax_scale(no_launch, backend, scale):
    with raises("softmax_scale", "real number"):
        prefill_attention(*_qkv(), i32(0, 3, 7), i32(0, 4, 9), scale, backend=backend)


# ---------------------------------------------------------------------------------------
# mla_decode: 2 sequences, s_q 1, 2 heads, d = 16 + 8, 5 blocks of 4 rows, 3 table columns

def _decode_case(device="cpu"):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 2, 24, generator=g).to(device)
    kv = torch.randn(5, 4, 24, generator=g).to(device)
    return q, kv, i32([0, 1, -1], [2, 3, 4], device=device)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("table, lens, words", [
    ([[0, 1, -1], [2, 3, 4]], [5, 13], ("cache_seqlens", "0..12", "13")),          # past the table
    ([[0, 1, -1], [2, 3, 4]], [5, -1], ("cache_seqlens", "0..12", "-1")),
    ([[0, 1, -1], [2, 3, 4]], [9, 3], ("block_table", "[0, 5)", "block_table[0, 2] = -1")),
    ([[0, 5, -1], [2, 3, 4]], [5, 3], ("block_table", "[0, 5)", "block_table[0, 1] = 5")),
    ([[0, 1, -1], [-7, 3, 4]], [5, 1], ("block_table", "[0, 5)", "block_table[1, 0] = -7")),
])
def test_decode_lengths_and_block_ids(no_launch, backend, table, lens, words):
    q, kv, _ = _decode_case()
    with raises(*words):
        mla_decode(q, kv, i32(*table), i32(*lens), 16, 0.3, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_scales(no_launch, backend):
    q, kv, table = _decode_case()
    with raises("softmax_scale", "real number"):
        mla_decode(q, kv, table, i32(5, 3), 16, "x", backend=backend)
    with raises("softmax_scale", "real number"):
        mla_decode(q, kv, table, i32(5, 3), 16, None, backend=backend)
    with raises("kv_scale", "real number"):
        mla_decode(q, kv, table, i32(5, 3), 16, 0.3, kv_scale="x", backend=backend)


# ---------------------------------------------------------------------------------------
# merge_attention

@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_devices_and_dtypes(no_launch, backend):
    o, lse = torch.randn(3, 2, 8), torch.randn(3, 2)
    with raises("out_b", "device cpu"):
        merge_attention(o, lse, o.to("meta"), lse, backend=backend)
    with raises("lse_a", "device cpu"):
        merge_attention(o, lse.to("meta"), o, lse, backend=backend)
    with raises("lse_b", "device cpu"):
        merge_attention(o, lse, o, lse.to("meta"), backend=backend)
    with raises("out_a", "float16, bfloat16 or float32"):
        merge_attention(o.int(), lse, o, lse, backend=backend)
    with raises("out_b", "float16, bfloat16 or float32"):
        merge_attention(o, lse, o.int(), lse, backend=backend)
    with raises("out_b", "(3, 2, 8)"):
        merge_attention(o, lse, o[:2], lse, backend=backend)


# ---------------------------------------------------------------------------------------
# Valid edge cases still run, and both backends agree

def test_valid_edge_cases_pass():
    # prefill: empty sequences on either side (a query with no key: out 0, lse -inf), and B = 0
    lq, lk = [0, 3, 2, 0, 2], [2, 0, 4, 0, 3]
    cu_q, cu_k = (torch.tensor([0] + l).cumsum(0).int() for l in (lq, lk))
    q, k, v = _qkv(sum(lq), sum(lk), H=2)
    hint = cu_q.tolist()
    res = [prefill_attention(q, k, v, cu_q, cu_k, 0.3, offsets_q=hint, backend=b) for b in BACKENDS]
    torch.testing.assert_close(res[0], res[1], rtol=1e-5, atol=1e-5)
    assert torch.isinf(res[1][1][:3]).all() and (res[1][0][:3] == 0).all()   # sequence 1: no keys
    for b in BACKENDS:
        out, lse = prefill_attention(*_qkv(0, 0, H=2), i32(0), i32(0), 0.3, backend=b)
        assert out.shape == (0, 2, 16) and lse.shape == (0, 2)

    # decode: table tails of -1 (and garbage) past each sequence's last block, an empty sequence, and B = 0
    q, kv, _ = _decode_case()
    q = torch.cat([q, q[:1]])
    table = i32([1, -1, 99], [0, 2, -1], [-1, -1, -1])
    res = [mla_decode(q, kv, table, i32(3, 6, 0), 16, 0.3, backend=b) for b in BACKENDS]
    torch.testing.assert_close(res[0], res[1], rtol=1e-5, atol=1e-5)
    assert torch.isinf(res[1][1][2]).all() and (res[1][0][2] == 0).all()
    for b in BACKENDS:
        out, lse = mla_decode(q[:0], kv, table[:0], i32(), 16, 0.3, backend=b)
        assert out.shape == (0, 1, 2, 16) and lse.shape == (0, 1, 2)


@gpu
def test_gpu_checks_add_no_sync():
    """On CUDA the wrappers read no values back: with sync debugging set to "error" the ops run
    (the Triton paths; fp32 prefill without host offsets takes our kernel)."""
    q, kv, table = _decode_case("cuda")
    lens = i32(5, 3, device="cuda")
    qp, kp, vp = _qkv(device="cuda")
    cu_q, cu_k = i32(0, 3, 7, device="cuda"), i32(0, 4, 9, device="cuda")
    o, lse = torch.randn(3, 2, 8, device="cuda"), torch.randn(3, 2, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mla_decode(q, kv, table, lens, 16, 0.3, backend="triton")
        prefill_attention(qp, kp, vp, cu_q, cu_k, 0.2, backend="triton")
        merge_attention(o, lse, o, lse, backend="triton")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    with raises("cu_seqlens_k", "device cuda"):   # dtype, shape and device are still checked there
        prefill_attention(qp, kp, vp, cu_q, cu_k.cpu(), 0.2)


def test_bf16_refused_by_the_interpreter(no_launch):
    """Triton's interpreter computes bf16 dot products wrongly: on CPU the kernels refuse bf16
    (the reference serves it), and so does a bf16 layer built for them."""
    import mla

    q, kv, table = _decode_case()
    with raises("backend", "'torch'", "bfloat16"):
        mla_decode(q.bfloat16(), kv.bfloat16(), table, i32(5, 3), 16, 0.3, backend="triton")
    qp, kp, vp = (t.bfloat16() for t in _qkv())
    with raises("backend", "'torch'", "bfloat16"):
        prefill_attention(qp, kp, vp, i32(0, 3, 7), i32(0, 4, 9), 0.2, backend="triton")
    with raises("backend", "bfloat16"):
        mla.MLA(mla.MLAConfig.preset("tiny"), dtype=torch.bfloat16, device="cpu", backend="triton")
    mla.MLA(mla.MLAConfig.preset("tiny"), dtype=torch.float16, device="cpu", backend="triton")


def _rope_case(T=3, H=2, r=8, dr=4, blocks=2, bs=4, dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    q_pe, k_pe = torch.randn(T, H, dr, generator=g), torch.randn(T, dr, generator=g)
    c_kv, cos = torch.randn(T, r, generator=g), torch.rand(T, dr // 2, generator=g)
    kv = torch.zeros(blocks, bs, r + dr, dtype=dtype)
    return q_pe, k_pe, c_kv, cos, cos.clone(), kv, torch.tensor([5, -1, 0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_rope_append_slots_devices_scale(no_launch, backend):
    """The append writes where slot_mapping says: a slot past the pool (out of bounds on the Triton
    path), an input on another device or a non-numeric kv_scale is refused before the write."""
    q_pe, k_pe, c_kv, cos, sin, kv, slots = _rope_case()
    with raises("slot_mapping", "< 8", "8", "index 0"):
        rope_append(q_pe, k_pe, c_kv, cos, sin, kv, torch.tensor([8, -1, 0]), False, backend=backend)
    with raises("sin", "device cpu"):
        rope_append(q_pe, k_pe, c_kv, cos, sin.to("meta"), kv, slots, False, backend=backend)
    kv8 = torch.zeros(2, 4, 12, dtype=torch.float8_e4m3fn)
    with raises("kv_scale", "finite real number"):
        rope_append(q_pe, k_pe, c_kv, cos, sin, kv8, slots, False, kv_scale="x", backend=backend)


def test_rope_append_valid_slots_pass():
    """Negative slots are skipped; both backends write the same rows."""
    outs = []
    for backend in BACKENDS:
        q_pe, k_pe, c_kv, cos, sin, kv, slots = _rope_case()
        rope_append(q_pe, k_pe, c_kv, cos, sin, kv, slots, False, backend=backend)
        outs.append(kv)
        assert kv.view(-1, kv.shape[-1])[[5, 0]].abs().sum(-1).gt(0).all()
        assert kv.view(-1, kv.shape[-1])[[1, 2, 3, 4, 6, 7]].eq(0).all()
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)
