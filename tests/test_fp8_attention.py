"""FP8 context attention (``mla.ops.fp8_prefill_attention``) against its float32 emulation and
against exact attention of the same dequantized inputs.

The emulation (``reference.fp8_prefill_attention``) rounds as the kernel does: each query row to
e4m3 on its own scale, P to e4m3 per block of keys at 448 P w. Under Triton's interpreter the
kernel equals it up to float32 summation order; on the GPU the tensor cores' FP8 accumulation
and exp2 differ in the last bits, which can move a P value by one e4m3 step: there the kernel's
error against exact attention must stay within the emulation's own (plus a small slack).
"""
from __future__ import annotations

import pytest
import torch

from mla import ops
from mla.ops import reference

CUDA = torch.cuda.is_available()
FP8 = torch.float8_e4m3fn


def _cu(lengths, device):
    return torch.tensor([0] + list(lengths), device=device).cumsum(0).to(torch.int32)


def _case(H, Hk, dq, dv, lens_q, lens_k, per_row, device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    Tq, Tk = sum(lens_q), sum(lens_k)
    q = (torch.randn(Tq, H, dq, generator=g) * 2).to(device, dtype)
    kf, vf = torch.randn(Tk, Hk, dq, generator=g), torch.randn(Tk, Hk, dv, generator=g)
    if per_row:
        (k, ks), (v, vs) = reference.quantize_rows_fp8(kf), reference.quantize_rows_fp8(vf)
    else:   # one calibrated scale a tensor, as an FP8 latent cache's kv_scale
        ks, vs = torch.tensor([0.02]), torch.tensor([0.03])
        k, v = (kf / ks).clamp(-448, 448).to(FP8), (vf / vs).clamp(-448, 448).to(FP8)
    return q, k.to(device), v.to(device), ks.to(device), vs.to(device), _cu(lens_q, device), _cu(lens_k, device)


def _exact(q, k, v, ks, vs, cu_q, cu_k, scale, causal):
    """float32 attention of the dequantized k, v (q as given)."""
    H = q.shape[1]
    kd = k.float() * (ks[..., None] if ks.dim() == 2 else ks)
    vd = v.float() * (vs[..., None] if vs.dim() == 2 else vs)
    return reference.prefill_attention(q.float(), kd.expand(-1, H, -1).contiguous(),
                                       vd.expand(-1, H, -1).contiguous(), cu_q, cu_k, scale, causal)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


CASES = [   # H, Hk, dq, dv, query lengths, key lengths (a cached prefix where longer), per-row scales, causal
    (3, 3, 24, 16, [5, 0, 20], [9, 3, 20], True, True),          # odd heads, a sequence with no queries
    (3, 1, 40, 32, [7, 33], [30, 33], False, True),              # absorbed form: one key row for all heads
    (2, 2, 24, 16, [17, 4], [40, 0], True, False),               # no causal mask; a sequence with no keys
    (5, 1, 72, 64, [3, 18, 9], [50, 18, 4], True, True),         # 9 queries on 4 keys: the first 5 see none
]


@pytest.mark.parametrize("H, Hk, dq, dv, lens_q, lens_k, per_row, causal", CASES)
def test_kernel_is_its_emulation_on_cpu(H, Hk, dq, dv, lens_q, lens_k, per_row, causal):
    from mla.ops.prefill import triton as kernel
    q, k, v, ks, vs, cu_q, cu_k = _case(H, Hk, dq, dv, lens_q, lens_k, per_row, "cpu")
    cfg = kernel.fp8_config(q, dq, dv)
    out, lse = ops.fp8_prefill_attention(q, k, v, ks, vs, cu_q, cu_k, 0.3, causal, backend="triton")
    ref, ref_lse = reference.fp8_prefill_attention(q, k, v, ks, vs, cu_q, cu_k, 0.3, causal, block_n=cfg.block_n)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)     # -inf where a query sees no key
    exact, exact_lse = _exact(q, k, v, ks, vs, cu_q, cu_k, 0.3, causal)
    assert torch.equal(torch.isinf(lse), torch.isinf(exact_lse)) and (out[torch.isinf(lse)] == 0).all()
    # e4m3 keeps 3 mantissa bits: q and P rounding give errors of a few percent on these peaky rows
    assert _rel(out, exact) < 0.08


def test_query_rounding_and_p_rounding_are_what_the_emulation_states():
    """With one key block and equal keys the only rounding left is q's: out equals v exactly."""
    q, k, v, ks, vs, cu_q, cu_k = _case(2, 2, 16, 16, [4], [4], True, "cpu")
    v = v[:1].expand(4, -1, -1).contiguous()                 # every key carries the same value row
    vs = vs[:1].expand(4, -1).contiguous()
    out, _ = reference.fp8_prefill_attention(q, k, v, ks, vs, cu_q, cu_k, 0.5, True)
    want = (v[:1].float() * vs[:1, :, None]).expand(4, -1, -1)
    torch.testing.assert_close(out, want, rtol=2e-7, atol=1e-7)   # a convex combination of one row


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H, Hk, dq, dv, lens_q, lens_k, per_row, causal", CASES + [
    (16, 16, 192, 128, [300, 1000], [300, 1500], True, True),     # DeepSeek-V3's expanded heads
    (16, 1, 576, 512, [200, 77], [700, 77], False, True),         # absorbed: latent rows, 512-wide values
])
def test_kernel_on_gpu_is_no_worse_than_its_emulation(H, Hk, dq, dv, lens_q, lens_k, per_row, causal, dtype):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores")
    from mla.ops.prefill import triton as kernel
    q, k, v, ks, vs, cu_q, cu_k = _case(H, Hk, dq, dv, lens_q, lens_k, per_row, "cuda", dtype)
    scale = dq ** -0.5
    out, lse = ops.fp8_prefill_attention(q, k, v, ks, vs, cu_q, cu_k, scale, causal)
    cfg = kernel.fp8_config(q, dq, dv)
    ref, ref_lse = reference.fp8_prefill_attention(q, k, v, ks, vs, cu_q, cu_k, scale, causal, block_n=cfg.block_n)
    exact, exact_lse = _exact(q, k, v, ks, vs, cu_q, cu_k, scale, causal)
    assert out.dtype == dtype and torch.equal(torch.isinf(lse), torch.isinf(exact_lse))
    # the output's own rounding to 16 bits adds 2^-9 (bf16) relative
    assert _rel(out, exact) <= 1.1 * _rel(ref, exact) + 4e-3
    fin = torch.isfinite(exact_lse)
    assert (lse[fin] - exact_lse[fin]).abs().max() < 0.1


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_key_major_values_give_the_same_result(backend):
    q, k, v, ks, vs, cu_q, cu_k = _case(3, 3, 24, 16, [5, 0, 20], [9, 3, 20], True, "cpu")
    v = v.clone()
    v[9:12] = float("nan")         # the sequence with no queries: its values must not be read
    want = ops.fp8_prefill_attention(q, k, v, ks, vs, cu_q, cu_k, 0.3, True, backend=backend)
    from mla.ops.prefill.triton import key_major
    vt = key_major(v)
    assert vt.stride(0) == 1 and torch.equal(vt.float().nan_to_num(), v.float().nan_to_num())
    got = ops.fp8_prefill_attention(q, k, vt, ks, vs, cu_q, cu_k, 0.3, True, backend=backend)
    assert not got[0].isnan().any()
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_e4m3_pv_needs_key_major_values():
    from mla.ops.prefill import triton as kernel
    q, k, v, ks, vs, cu_q, cu_k = _case(3, 3, 24, 16, [5, 2], [9, 3], True, "cpu")
    with pytest.raises(ValueError, match="fp8_pv: needs float8_e4m3fn v key-major"):
        kernel.launch(q, k, v, cu_q, cu_k, 0.3, True, kernel.fp8_config(q, 24, 16), ks, vs, fp8_pv=True)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("H, Hk, dq, dv, lens_q, lens_k, per_row, causal", [
    (3, 3, 40, 32, [5, 0, 20], [9, 3, 20], True, True),
    (16, 16, 192, 128, [300, 1000], [300, 1500], True, True),
    (4, 1, 64, 64, [33, 7], [90, 7], False, False),
])
def test_e4m3_pv_on_gpu_is_no_worse_than_its_emulation(H, Hk, dq, dv, lens_q, lens_k, per_row, causal):
    """P V on e4m3 MMAs (``launch(fp8_pv=True)``, key-major v): the bound of the fp16-MMA path."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores")
    from mla.ops.prefill import triton as kernel
    q, k, v, ks, vs, cu_q, cu_k = _case(H, Hk, dq, dv, lens_q, lens_k, per_row, "cuda", torch.bfloat16)
    scale = dq ** -0.5
    cfg = kernel.fp8_config(q, dq, dv)
    out, lse = kernel.launch(q, k, kernel.key_major(v), cu_q, cu_k, scale, causal, cfg, ks, vs, fp8_pv=True)
    ref, _ = reference.fp8_prefill_attention(q, k, v, ks, vs, cu_q, cu_k, scale, causal, block_n=cfg.block_n)
    exact, exact_lse = _exact(q, k, v, ks, vs, cu_q, cu_k, scale, causal)
    assert not out.isnan().any() and torch.equal(torch.isinf(lse), torch.isinf(exact_lse))
    assert _rel(out, exact) <= 1.1 * _rel(ref, exact) + 4e-3


def test_zero_sizes():
    q, k, v, ks, vs, cu_q, cu_k = _case(3, 3, 24, 16, [0, 0], [0, 5], True, "cpu")
    out, lse = ops.fp8_prefill_attention(q, k, v, ks, vs, cu_q, cu_k, 0.3, backend="triton")
    assert out.shape == (0, 3, 16) and lse.shape == (0, 3)
    empty = torch.zeros(0, 3, 24)
    out, lse = ops.fp8_prefill_attention(empty, k[:0], v[:0], ks[:0], vs[:0], _cu([], "cpu"), _cu([], "cpu"), 0.3)
    assert out.shape == (0, 3, 16)


@pytest.mark.parametrize("change, match", [
    (dict(k="bf16"), "k: expected a 3-D float8_e4m3fn"),
    (dict(v="2d"), "v: expected a 3-D float8_e4m3fn"),
    (dict(k="heads"), r"k: expected \[Tk, 3 or 1, 24\]"),
    (dict(q="int"), "q: expected float16, bfloat16 or float32"),
    (dict(k_scale="f64"), "k_scale: expected a float32 tensor"),
    (dict(v_scale="shape"), "v_scale: expected a float32 tensor of shape"),
    (dict(causal="yes"), "causal: expected a bool"),
    (dict(offsets_q="bad"), "offsets_q"),
])
def test_bad_input_is_refused_by_name(change, match):
    q, k, v, ks, vs, cu_q, cu_k = _case(3, 3, 24, 16, [5, 2], [9, 3], True, "cpu")
    args = dict(q=q, k=k, v=v, k_scale=ks, v_scale=vs, causal=True, offsets_q=None)
    bad = {"bf16": lambda t: t.to(torch.bfloat16), "2d": lambda t: t[:, 0], "heads": lambda t: t[:, :2],
           "int": lambda t: t.to(torch.int32), "f64": lambda t: t.double(), "shape": lambda t: t[:, :1, None],
           "yes": lambda t: "yes", "bad": lambda t: [0, 9, 7]}
    for name, how in change.items():
        args[name] = bad[how](args[name])
    with pytest.raises(ValueError, match=match):
        ops.fp8_prefill_attention(args["q"], args["k"], args["v"], args["k_scale"], args["v_scale"], cu_q, cu_k, 0.3,
                                  args["causal"], offsets_q=args["offsets_q"])


# ---------------------------------------------------------------- the layer with fp8_attention
def _layer_case(strategy, backend, fp8_attention, scaling="tensor"):
    import mla
    from hf_util import PREFIX, hf_reference, make_attention, make_config, rel_err, state_dict
    hf_cfg = make_config("v3", kv_lora_rank=128, max_position_embeddings=128)
    attn, rotary = make_attention(hf_cfg, seed=11)
    cfg = mla.MLAConfig.from_hf(hf_cfg)
    layer = mla.MLA(cfg, dtype=torch.float32, backend=backend, max_workspace_tokens=8, strategy=strategy,
                    fp8_attention=fp8_attention)
    layer.load_hf_state_dict(state_dict(attn), prefix=PREFIX)
    cache = mla.PagedLatentCache(cfg, num_blocks=32, block_size=4, dtype=torch.float8_e4m3fn, fp8_scaling=scaling)
    g = torch.Generator().manual_seed(1)
    hist, errs = torch.randn(0, cfg.hidden_size), []
    for n in (13, 1, 3, 20):        # prefill, decode, a draft of 3, then 20 new on a prefix
        x = torch.randn(n, cfg.hidden_size, generator=g)
        hist = torch.cat((hist, x))
        out = layer(x, cache.prepare([("s", n)]))
        errs.append(rel_err(out, hf_reference(attn, rotary, hist)[-n:]))
    return errs


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("strategy, scaling", [(None, "tensor"), ("cached", "tensor"), ("chunked", "tensor"),
                                               ("absorbed", "tensor"), ("absorbed", "tile")])
def test_layer_with_fp8_attention_against_transformers(strategy, scaling, backend):
    """The expanded paths (prefill, cached, chunked) and the absorbed FP8 context (20 new tokens
    on a prefix, strategy "absorbed") on FP8 attention, against transformers in float32.
    Measured 2026-12-07 on these peaky unit-scale rows: FP8 attention 3.7-10.1% per step, bf16
    attention over the same FP8 cache 0-8.3% (its prompt step reads fresh latents, not the
    cache). The bound leaves 1.5x; a scale applied twice is off by far more."""
    fp8 = _layer_case(strategy, backend, True, scaling)
    plain = _layer_case(strategy, backend, False, scaling)
    print(f"strategy={strategy} {scaling} {backend}: fp8 attention {[f'{e:.4f}' for e in fp8]}, "
          f"bf16 {[f'{e:.4f}' for e in plain]}")
    assert max(fp8) <= 0.15
    if strategy in (None, "absorbed"):                  # decode and drafts stay on the decode kernels
        assert fp8[1] == plain[1] and fp8[2] == plain[2]
    assert fp8[0] != plain[0]                           # the prompt did take the FP8 kernel
    assert fp8[3] != plain[3]                           # 20 new tokens on a prefix: expanded, or absorbed FP8


def test_fp8_attention_is_refused_without_an_fp8_cache():
    import mla
    from hf_util import PREFIX, make_attention, make_config, state_dict
    hf_cfg = make_config("v3", kv_lora_rank=128, max_position_embeddings=128)
    attn, _ = make_attention(hf_cfg, seed=11)
    cfg = mla.MLAConfig.from_hf(hf_cfg)
    with pytest.raises(ValueError, match="fp8_attention: expected a bool"):
        mla.MLA(cfg, dtype=torch.float32, fp8_attention="yes")
    layer = mla.MLA(cfg, dtype=torch.float32, backend="torch", fp8_attention=True)
    layer.load_hf_state_dict(state_dict(attn), prefix=PREFIX)
    cache = mla.PagedLatentCache(cfg, num_blocks=8, block_size=4, dtype=torch.float32)
    batch = cache.prepare([("s", 5)])
    before = cache.layer(0).clone()
    with pytest.raises(ValueError, match="fp8_attention: needs an FP8 latent cache"):
        layer(torch.randn(5, cfg.hidden_size), batch)
    assert torch.equal(cache.layer(0), before)        # nothing written


def test_fp8_attention_is_refused_for_a_sparse_config():
    """The sparse path (top-k keys) has no e4m3 arithmetic: asking for FP8 context attention on a
    DeepSeek Sparse Attention config is refused by name, not served in part."""
    import dataclasses
    import mla
    cfg = dataclasses.replace(mla.MLAConfig.preset("tiny"), index_topk=8, index_n_heads=2, index_head_dim=16)
    with pytest.raises(ValueError, match="fp8_attention: 'tiny' attends through its sparse indexer"):
        mla.MLA(cfg, dtype=torch.float32, fp8_attention=True)
    assert mla.MLA(cfg, dtype=torch.float32).fp8_attention is False


# ---------------------------------------------------------------- mla.hf.patch(fp8_attention=True)
def test_patch_with_fp8_attention_generates_and_refuses_a_plain_cache():
    """A patched DeepSeek-V3 model on an FP8 cache, prompts on FP8 attention: generate runs, its
    first token (from the prompt, the only step FP8 attention changes here) is counted against
    16-bit attention over the same cache (random weights: ties flip; what the test asserts is
    that the option reaches the layers and changes only the context steps' arithmetic)."""
    import mla
    from test_hf_patch import greedy, make_model, prompts
    model = make_model("deepseek_v3")
    ids, mask = prompts(2, seed=2)
    cfg = mla.MLAConfig.from_hf(model.config)
    plain = mla.PagedLatentCache(cfg, num_layers=2, num_blocks=32, block_size=8, dtype=torch.float32)
    with pytest.raises(ValueError, match="fp8_attention: needs an FP8 latent cache"):
        mla.hf.patch(model, plain, fp8_attention=True)
    assert not any(isinstance(m, mla.MLA) for m in model.modules())      # nothing swapped
    with pytest.raises(ValueError, match="fp8_attention: expected True or False"):
        mla.hf.patch(model, fp8_attention=1)
    outs = {}
    for fp8 in (False, True):
        cache = mla.PagedLatentCache(cfg, num_layers=2, num_blocks=32, block_size=8, dtype=torch.float8_e4m3fn)
        with mla.hf.patch(model, cache, fp8_attention=fp8) as handle:
            assert all(layer.fp8_attention is fp8 for layer in handle.layers)
            outs[fp8] = greedy(model, ids, mask)
    assert outs[True].shape == outs[False].shape
    agree = (outs[True] == outs[False]).float().mean().item()
    print(f"greedy tokens equal to 16-bit context attention on the FP8 cache: {agree:.2f}")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("cu_q, cu_k, match", [
    ([0, 5, 8], [0, 9, 12], "cu_seqlens_q: expected non-decreasing offsets from 0 to Tq = 7"),
    ([0, 5, 7], [0, 9, 13], "cu_seqlens_k: expected non-decreasing offsets from 0 to Tk = 12"),
    ([0, 5, 7], [0, 13, 12], "cu_seqlens_k: expected non-decreasing"),
])
def test_offset_values_are_checked_before_any_launch(monkeypatch, backend, cu_q, cu_k, match):
    from mla.ops import prefill

    def launched(*args, **kwargs):
        raise AssertionError("an implementation ran: the error must come before it")
    monkeypatch.setattr(prefill, "fp8_prefill_attention", launched)
    monkeypatch.setattr(reference, "fp8_prefill_attention", launched)
    q, k, v, ks, vs, _, _ = _case(3, 3, 24, 16, [5, 2], [9, 3], True, "cpu")
    with pytest.raises(ValueError, match=match):
        ops.fp8_prefill_attention(q, k, v, ks, vs, torch.tensor(cu_q, dtype=torch.int32),
                                  torch.tensor(cu_k, dtype=torch.int32), 0.3, backend=backend)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_nan_query_row_gives_nan_in_that_row_only(backend):
    q, k, v, ks, vs, cu_q, cu_k = _case(3, 3, 24, 16, [5, 20], [9, 20], True, "cpu")
    out, _ = ops.fp8_prefill_attention(q, k, v, ks, vs, cu_q, cu_k, 0.3, backend=backend)
    q[2, 1, 7] = float("nan")
    bad, _ = ops.fp8_prefill_attention(q, k, v, ks, vs, cu_q, cu_k, 0.3, backend=backend)
    assert bad[2, 1].isnan().all()
    keep = torch.ones_like(out, dtype=torch.bool)
    keep[2, 1] = False
    assert torch.equal(bad[keep], out[keep])


# ---------------------------------------------------------------- quantize_rows_fp8
@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if CUDA else []))
@pytest.mark.parametrize("shape, dtype", [((7, 3, 192), torch.bfloat16), ((5, 1, 576), torch.float32),
                                          ((4, 24), torch.float16), ((0, 3, 128), torch.float32)])
def test_quantize_rows_kernel_equals_the_reference(shape, dtype, device):
    """Bit for bit: the same amax, the same correctly rounded divisions, the same rounding to
    e4m3; a row of zeros, a row with a NaN, one past e4m3's range."""
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    if x.numel():
        x.view(-1, shape[-1])[0] = 0.0
        x.view(-1, shape[-1])[-1, 0] = float("nan")
        x.view(-1, shape[-1])[1 % x.view(-1, shape[-1]).shape[0], 1] = 1e30 if dtype == torch.float32 else 6e4
    x = x.to(device)
    got_q, got_s = ops.quantize_rows_fp8(x, backend="triton")
    want_q, want_s = ops.quantize_rows_fp8(x, backend="torch")
    assert got_q.shape == x.shape and got_s.shape == x.shape[:-1] and got_s.dtype == torch.float32
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
    torch.testing.assert_close(got_s, want_s, rtol=0, atol=0, equal_nan=True)


def test_quantize_rows_refuses_bad_input():
    with pytest.raises(ValueError, match="x: expected float16, bfloat16 or float32"):
        ops.quantize_rows_fp8(torch.zeros(3, 4, dtype=torch.int32))
    for bad in (torch.tensor(1.0), torch.zeros(3, 0)):
        with pytest.raises(ValueError, match=r"x: expected a tensor \[..., D\] with D >= 1"):
            ops.quantize_rows_fp8(bad)
