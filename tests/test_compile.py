"""torch.compile and torch.library: every public op is a registered custom op
(``torch.ops.mla.*``) that passes ``torch.library.opcheck``; a call of each public wrapper
compiles with ``fullgraph=True`` and matches eager; a decoder block (RMSNorm -> mla.MLA ->
residual) compiles with ``fullgraph=True`` through prefill, decode and mixed steps and
matches eager, output and cache; and the value checks still raise from a compiled graph.
"""
from __future__ import annotations

import shutil

import pytest
import torch

import mla
from mla import ops
from mla.ops.reference import rms_norm
from mla.ops._library import OPS
from mla.testing import random_state_dict

R, DR = 32, 16          # kv_lora_rank, qk_rope_head_dim of the op inputs
inductor = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("cc") is None,
                              reason="inductor on CPU needs a C++ compiler")


def i32(*x):
    return torch.tensor(x, dtype=torch.int32)


def fp8(x):
    return x.clamp(-448, 448).to(torch.float8_e4m3fn)


# ---- one small valid call of each op: (wrapper args, wrapper kwargs, op args in schema order) ----

def decode_args(g, backend, cache_dtype=torch.float32):
    q = torch.randn(2, 2, 3, R + DR, generator=g)
    kv = torch.randn(8, 4, R + DR, generator=g)
    kv[[1, 6]] = float("nan")                          # pages no sequence reaches
    kv = kv if cache_dtype == torch.float32 else fp8(kv)
    table = i32([5, 0, 3, 1], [7, 2, 4, 6])            # shuffled pages; the tails are never reached
    lens = i32(5, 9)
    return ((q, kv, table, lens, R, 0.2), dict(kv_scale=0.5, backend=backend),
            (q, kv, table, lens, R, 0.2, True, 0.5, backend, True))


def prefill_args(g, backend, host=False):
    q, k, v = (torch.randn(7, 3, 24, generator=g), torch.randn(9, 3, 24, generator=g),
               torch.randn(9, 3, 16, generator=g))
    cu_q, cu_k = i32(0, 3, 3, 7), i32(0, 4, 6, 9)       # a sequence with no queries
    offsets = ([0, 3, 3, 7], [0, 4, 6, 9]) if host else (None, None)
    return ((q, k, v, cu_q, cu_k, 0.2), dict(offsets_q=offsets[0], offsets_k=offsets[1], backend=backend),
            (q, k, v, cu_q, cu_k, 0.2, True, None, None, *offsets, backend, None))


def fp8_prefill_args(g, backend):
    q = torch.randn(7, 3, 24, generator=g)
    k = torch.randn(9, 1, 24, generator=g).to(torch.float8_e4m3fn)       # one key row for every head
    v = torch.randn(9, 1, 16, generator=g).to(torch.float8_e4m3fn)
    k_scale, v_scale = torch.rand(9, 1, generator=g) + 0.5, torch.tensor([0.7])
    cu_q, cu_k = i32(0, 3, 3, 7), i32(0, 4, 6, 9)
    return ((q, k, v, k_scale, v_scale, cu_q, cu_k, 0.2), dict(backend=backend),
            (q, k, v, k_scale, v_scale, cu_q, cu_k, 0.2, True, None, None, backend))


def quantize_rows_args(g, backend):
    x = torch.randn(5, 3, 40, generator=g)
    x[1, 2] = 0.0                                      # a row of zeros: scale 1e-12 / 448
    return (x,), dict(backend=backend), (x, backend)


def merge_args(g, backend):
    out_a, out_b = torch.randn(5, 3, 16, generator=g), torch.randn(5, 3, 16, generator=g)
    lse_a, lse_b = torch.randn(5, 3, generator=g), torch.randn(5, 3, generator=g)
    lse_a[0], lse_b[1], lse_a[2], lse_b[2] = (float("-inf"),) * 4     # empty parts, one row wholly
    return (out_a, lse_a, out_b, lse_b), dict(backend=backend), (out_a, lse_a, out_b, lse_b, backend)


def rms_norm_args(g, backend):
    x = torch.randn(5, 80, generator=g)[:, 7:40]         # strided rows, an odd width
    w = torch.randn(33, generator=g)
    return (x, w, 1e-6), dict(backend=backend), (x, w, 1e-6, backend)


def rms_norm_pair_args(g, backend):
    a = torch.randn(5, 80, generator=g)
    x1, x2 = a[:, 7:40], a[:, 40:52]                     # column slices of one buffer, as the layer's
    w1, w2 = torch.randn(33, generator=g), torch.randn(12, generator=g)
    return (x1, w1, 1e-6, x2, w2, 1e-5), dict(backend=backend), (x1, w1, 1e-6, x2, w2, 1e-5, backend)


def rope_append_args(g, backend, cache_dtype=torch.float32, q_out=False):
    T, H = 5, 3
    q_pe, k_pe, c_kv = torch.randn(T, H, DR, generator=g), torch.randn(T, DR, generator=g), torch.randn(T, R, generator=g)
    angle = torch.rand(T, DR // 2, generator=g) * 6
    kv = torch.zeros(4, 4, R + DR, dtype=cache_dtype)
    slots = torch.tensor([3, 9, -1, 0, 14])              # a negative slot is skipped
    out = torch.zeros(H, T, R + DR).transpose(0, 1)[..., R:] if q_out else None   # a decode query's RoPE columns
    kwargs = dict(kv_scale=0.5, backend=backend, **({"q_out": out} if q_out else {}))
    return ((q_pe, k_pe, c_kv, angle.cos(), angle.sin(), kv, slots, True), kwargs,
            (q_pe, k_pe, c_kv, angle.cos(), angle.sin(), kv, slots, True, 0.5, backend, out))


def rope_args(g, backend):
    T, H = 5, 3
    q = torch.randn(T, H, 2 * DR, generator=g)[..., DR:]     # RoPE on a slice of each row, as the indexer's
    k = torch.randn(T, 2 * DR, generator=g)[:, :DR]
    angle = torch.rand(T, DR // 2, generator=g) * 6
    return (q, k, angle.cos(), angle.sin(), False), dict(backend=backend), (q, k, angle.cos(), angle.sin(), False,
                                                                              backend)


def gather_args(g, backend):
    kv = torch.randn(8, 4, R + DR, generator=g)
    table, starts, cu = i32([5, 0, 3, 1], [7, 2, 4, 6]), i32(2, 0), i32(0, 7, 12)
    return (kv, table, starts, cu, 12), dict(backend=backend), (kv, table, starts, cu, 12, backend)


def quantize_args(g, backend):
    x = torch.randn(3, 200, generator=g)                # a partial last group
    return (x,), dict(backend=backend), (x, backend)


def fp8_linear_args(g, backend):
    x, w, s = torch.randn(3, 200, generator=g), fp8(torch.randn(130, 200, generator=g) * 8), torch.rand(2, 2, generator=g)
    return (x, w, s), dict(backend=backend), (x, w, s, torch.float32, backend)


def fp8_bmm_args(g, backend):
    x, w = torch.randn(2, 3, 200, generator=g), fp8(torch.randn(2, 130, 200, generator=g) * 8)
    s = torch.rand(2, 2, 2, generator=g)
    return (x, w, s), dict(backend=backend), (x, w, s, torch.float32, backend)


def indexer_args(g, backend):
    q, w = torch.randn(4, 3, 16, generator=g), torch.rand(4, 3, generator=g)
    cache = torch.randn(8, 4, 16, generator=g)
    cache[[1, 6]] = float("nan")                       # pages no sequence reaches
    table, lens, cu = i32([5, 0, 3, 1], [7, 2, 4, 6]), i32(5, 9), i32(0, 1, 4)
    return ((q, w, cache, table, lens, cu, 16, 0.25), dict(backend=backend),
            (q, w, cache, table, lens, cu, 16, 0.25, True))


def topk_args(g, backend):
    logits = torch.randn(4, 16, generator=g)
    logits[0, 5:] = float("-inf")                      # fewer visible keys than topk
    table, cu = i32([5, 0, 3, 1], [7, 2, 4, 6]), i32(0, 1, 4)
    return (logits, 6, table, cu, 4), dict(backend=backend), (logits, 6, table, cu, 4)


def sparse_decode_args(g, backend, sink=False):
    q, kv = torch.randn(2, 2, 3, R + DR, generator=g), torch.randn(8, 4, R + DR, generator=g)
    idx = torch.randint(0, 32, (2, 2, 5), generator=g, dtype=torch.int32)
    idx[0, 1, 3:] = -1
    idx[1, 0] = -1                                     # a query with no key
    s = torch.randn(3, generator=g) if sink else None   # attention sinks (Hy4), one logit per head
    return (q, kv, idx, R, 0.2), dict(kv_scale=1.0, attn_sink=s, backend=backend), (q, kv, idx, R, 0.2, 1.0, s)


def sparse_prefill_args(g, backend, sink=False):
    q, kv = torch.randn(5, 3, R + DR, generator=g), torch.randn(9, 1, R + DR, generator=g)
    idx = torch.randint(0, 9, (5, 1, 4), generator=g, dtype=torch.int32)
    idx[2, 0, 1:] = -1
    s = torch.randn(3, generator=g) if sink else None
    return (q, kv, idx, 0.2, R), dict(attn_sink=s, backend=backend), (q, kv, idx, 0.2, R, s)


CASES = {   # name -> (op, builder); Triton runs under its interpreter in float32 here
    "mla_decode": ("mla_decode", decode_args), "prefill_attention": ("prefill_attention", prefill_args),
    "prefill_attention_host": ("prefill_attention", lambda g, b: prefill_args(g, b, host=True)),
    "mla_decode_fp8": ("mla_decode", lambda g, b: decode_args(g, b, torch.float8_e4m3fn)),
    "fp8_prefill_attention": ("fp8_prefill_attention", fp8_prefill_args),
    "quantize_rows_fp8": ("quantize_rows_fp8", quantize_rows_args),
    "merge_attention": ("merge_attention", merge_args), "rms_norm": ("rms_norm", rms_norm_args),
    "rms_norm_pair": ("rms_norm_pair", rms_norm_pair_args),
    "rope": ("rope", rope_args), "rope_append": ("rope_append", rope_append_args),
    "rope_append_fp8": ("rope_append", lambda g, b: rope_append_args(g, b, torch.float8_e4m3fn)),
    "rope_append_q_out": ("rope_append", lambda g, b: rope_append_args(g, b, q_out=True)),
    "gather_latent": ("gather_latent", gather_args), "quantize_act_1x128": ("quantize_act_1x128", quantize_args),
    "fp8_linear": ("fp8_linear", fp8_linear_args), "fp8_bmm": ("fp8_bmm", fp8_bmm_args),
    "indexer_logits": ("indexer_logits", indexer_args), "topk_indices": ("topk_indices", topk_args),
    "sparse_mla_decode": ("sparse_mla_decode", sparse_decode_args),
    "sparse_prefill_attention": ("sparse_prefill_attention", sparse_prefill_args),
    "sparse_mla_decode_sink": ("sparse_mla_decode", lambda g, b: sparse_decode_args(g, b, sink=True)),
    "sparse_prefill_attention_sink": ("sparse_prefill_attention", lambda g, b: sparse_prefill_args(g, b, sink=True)),
}
# the interpreter is slow: opcheck (four runs and traces each) on the kernels that are cheap there
TRITON_OPCHECK = ("mla_decode", "merge_attention", "rms_norm", "rms_norm_pair", "rope", "rope_append",
                  "rope_append_q_out", "gather_latent", "quantize_act_1x128", "quantize_rows_fp8")


def test_every_public_op_is_registered():
    assert set(OPS) == {"mla_decode", "prefill_attention", "fp8_prefill_attention", "merge_attention", "rms_norm",
                        "rms_norm_pair", "rope", "rope_append", "gather_latent", "quantize_act_1x128",
                        "quantize_rows_fp8", "fp8_linear", "fp8_bmm", "indexer_logits", "topk_indices",
                        "sparse_mla_decode", "sparse_prefill_attention"}
    assert set(OPS) == set(ops.__all__) - {"resolve_backend", "triton_available"}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", list(CASES))
def test_opcheck(case, backend):
    op, build = CASES[case]
    if backend == "triton" and case not in TRITON_OPCHECK:
        pytest.skip("interpreted Triton: opcheck on the cheap kernels only (compiled call below covers all)")
    *_, op_args = build(torch.Generator().manual_seed(0), backend)
    fp8_tensors = any(isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn for a in op_args)
    # opcheck's schema test compares tensors with ops CPU float8 lacks (mul): the others there
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic") if fp8_tensors else "ALL"
    torch.library.opcheck(OPS[op], op_args, test_utils=utils if fp8_tensors else
                          ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_eager_calls_skip_the_dispatcher_and_traced_calls_take_it(monkeypatch):
    """A plain eager call runs the op's body; under a dispatch mode (FakeTensorMode) or with an
    input autograd follows, the call goes through the registered op (its fake, its refusal to
    backpropagate)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mla.ops import _library

    x, w = torch.randn(3, 8), torch.randn(8)
    want = ops.rms_norm(x, w, 1e-6, backend="torch")
    through = []
    real = _library.rms_norm.op
    monkeypatch.setattr(_library.rms_norm, "op", lambda *a: through.append(1) or real(*a))
    assert torch.equal(ops.rms_norm(x, w, 1e-6, backend="torch"), want) and through == []
    with FakeTensorMode() as mode:
        y = ops.rms_norm(mode.from_tensor(x), mode.from_tensor(w), 1e-6)
    assert type(y).__name__ == "FakeTensor" and y.shape == (3, 8) and through == [1]
    y = ops.rms_norm(x.clone().requires_grad_(), w, 1e-6, backend="torch")
    assert through == [1, 1] and torch.equal(y.detach(), want)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        y.sum().backward()


def _clone(x):
    return x.clone() if isinstance(x, torch.Tensor) else x


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_call_matches_eager(case, backend):
    """fullgraph: the wrapper's checks trace (no value reads); the op is one node of the graph."""
    torch._dynamo.reset()
    op, build = CASES[case]
    args, kwargs, _ = build(torch.Generator().manual_seed(1), backend)
    fn = getattr(ops, op)
    eager_args, compiled_args = [_clone(a) for a in args], [_clone(a) for a in args]
    eager_kw, compiled_kw = ({k: _clone(v) for k, v in kwargs.items()} for _ in range(2))
    want = fn(*eager_args, **eager_kw)
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(*compiled_args, **compiled_kw)
    if want is None:   # rope, rope_append: what they wrote in place (into q_out too)
        want, got = eager_args + list(eager_kw.values()), compiled_args + list(compiled_kw.values())
    for w, c in zip(want, got):
        if isinstance(w, torch.Tensor):
            assert w.dtype == c.dtype and w.shape == c.shape
            torch.testing.assert_close(c.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else c,
                                       w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w,
                                       rtol=0, atol=0, equal_nan=True)


def test_value_checks_raise_from_a_compiled_graph():
    """Values are not known at trace time: the op checks them when it runs, before any write."""
    torch._dynamo.reset()
    (q, kv, table, lens, *rest), kwargs, _ = decode_args(torch.Generator().manual_seed(2), "torch")
    decode = torch.compile(ops.mla_decode, fullgraph=True, backend="aot_eager")
    decode(q, kv, table, lens, *rest, **kwargs)
    with pytest.raises(ValueError, match="cache_seqlens"):
        decode(q, kv, table, i32(5, 17), *rest, **kwargs)             # past the table's 16 slots
    args, kwargs, _ = rope_append_args(torch.Generator().manual_seed(2), "torch")
    append = torch.compile(ops.rope_append, fullgraph=True, backend="aot_eager")
    bad = list(args)
    bad[6] = torch.tensor([3, 9, -1, 0, 64])                           # past the pool's 64 slots
    kv_before = bad[5].clone()
    with pytest.raises(ValueError, match="slot_mapping"):
        append(*bad, **kwargs)
    assert torch.equal(bad[5], kv_before)


# ---- the layer in a decoder block ----------------------------------------------------------

class Block(torch.nn.Module):
    """RMSNorm -> MLA -> residual, the attention half of a decoder layer."""

    def __init__(self, cfg, dtype, backend):
        super().__init__()
        self.norm = torch.nn.Parameter(torch.rand(cfg.hidden_size, generator=torch.Generator().manual_seed(3),
                                                  dtype=torch.float32).to(dtype) + 0.5, requires_grad=False)
        self.attn = mla.MLA(cfg, dtype=dtype, backend=backend, max_workspace_tokens=8)
        self.attn.load_hf_state_dict(random_state_dict(cfg, torch.Generator().manual_seed(1)))

    def forward(self, x, batch):
        return x + self.attn(rms_norm(x, self.norm, 1e-6), batch)


# prefill, decode, decode, mixed (decode + cached-prefix continuation + new prompt), decode,
# a chunk over a prefix past the workspace (chunked), an MTP-style 3-token verify
STEPS = [[(0, 7), (1, 5)], [(0, 1), (1, 1)], [(0, 1), (1, 1)], [(0, 1), (1, 200), (2, 6)], [(0, 1), (1, 1), (2, 1)],
         [(2, 190)], [(0, 3), (1, 1)]]


def run_block(dtype, backend, compile_backend, cache_dtype=None, steps=STEPS):
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    cfg = mla.MLAConfig.preset("tiny")
    block = Block(cfg, dtype, backend)
    compiled = torch.compile(block, fullgraph=True, backend=compile_backend)
    caches = [mla.PagedLatentCache(cfg, num_layers=1, num_blocks=128, block_size=4, dtype=cache_dtype or dtype)
              for _ in range(2)]
    g = torch.Generator().manual_seed(4)
    outs = []
    # one thread: the same ops give the same bits only if their matmuls split the work alike
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for step in steps:
            x = torch.randn(sum(n for _, n in step), cfg.hidden_size, generator=g).to(dtype)
            want, got = block(x, caches[0].prepare(step)), compiled(x, caches[1].prepare(step))
            outs.append((want, got))
    finally:
        torch.set_num_threads(threads)
    return outs, caches, counters["stats"]["unique_graphs"]


def test_block_compiles_fullgraph_and_matches_eager():
    outs, (eager, compiled), graphs = run_block(torch.float32, "torch", "aot_eager")
    for want, got in outs:   # aot_eager runs the same ops: the same bits
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(eager.kv, compiled.kv)
    assert graphs <= len(STEPS)   # a step's shape is specialised; decode steps reuse one graph


def test_block_decode_steps_reuse_one_graph():
    steps = [[(0, 6), (1, 3)]] + [[(0, 1), (1, 1)]] * 8
    outs, _, graphs = run_block(torch.float32, "torch", "aot_eager", steps=steps)
    for want, got in outs:
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert graphs <= 3   # the prefill, then decode (made dynamic at its second length)


def test_block_fp8_cache_compiles():
    outs, (eager, compiled), _ = run_block(torch.float32, "torch", "aot_eager", cache_dtype=torch.float8_e4m3fn,
                                           steps=STEPS[:5])
    for want, got in outs:
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(eager.kv.view(torch.uint8), compiled.kv.view(torch.uint8))


def test_block_triton_backend_compiles():
    outs, (eager, compiled), _ = run_block(torch.float32, "triton", "aot_eager", steps=STEPS[:3])
    for want, got in outs:
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@inductor
def test_block_inductor_bf16_matches_eager():
    """Inductor fuses the norms and keeps intermediates in float32 where eager rounds to bf16:
    against the float32 block, its error is at most 2x eager bf16's (and the same with float32).
    A prefill, a decode step and a mixed step with a long prompt: each shape compiles once."""
    steps = [STEPS[0], STEPS[1], STEPS[3]]
    outs, _, _ = run_block(torch.bfloat16, "torch", "inductor", steps=steps)
    ref, _, _ = run_block(torch.float32, "torch", "inductor", steps=steps)
    for (want, got), (want32, got32) in zip(outs, ref):
        torch.testing.assert_close(got32, want32, rtol=1e-5, atol=1e-5)
        eager_err = (want.float() - want32).abs().max().item()
        assert (got.float() - want32).abs().max().item() <= 2 * eager_err + 1e-6


def test_stale_batch_raises_under_compile():
    torch._dynamo.reset()
    cfg = mla.MLAConfig.preset("tiny")
    block = torch.compile(Block(cfg, torch.float32, "torch"), fullgraph=True, backend="aot_eager")
    cache = mla.PagedLatentCache(cfg, num_layers=1, num_blocks=16, block_size=4, dtype=torch.float32)
    batch = cache.prepare([(0, 3)])
    block(torch.randn(3, cfg.hidden_size), batch)
    stale = cache.prepare([(0, 1)])
    cache.truncate(0, 2)
    # the versions are guards of the compiled step: the stale batch fails them, the retrace
    # raises (fullgraph=True reports an error raised while tracing as Dynamo's Unsupported)
    with pytest.raises((ValueError, torch._dynamo.exc.Unsupported), match="stale"):
        block(torch.randn(1, cfg.hidden_size), stale)
