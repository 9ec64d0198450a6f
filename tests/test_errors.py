"""Bad input raises ValueError (or mla.CacheFullError, a subclass) naming the argument,
before anything is written: a failed call leaves the cache (and the layer) exactly as it
was, and the sequences already there keep decoding correctly against transformers."""
from __future__ import annotations

import re

import pytest
import torch
from transformers import LlamaConfig

import hf_util as H
import mla
from hf_util import Harness


def raises(*words, exc=ValueError):
    """pytest.raises(exc) whose message must contain every one of ``words`` (case-insensitive;
    a compiled pattern is a regular expression, anything else a literal)."""
    pats = [w.pattern if isinstance(w, re.Pattern) else re.escape(str(w)) for w in words]
    return pytest.raises(exc, match="(?is)" + "".join(f"(?=.*{p})" for p in pats))


TWICE = re.compile(r"twice|duplicate|more than once|repeated")


def snapshot(cache, seqs):
    return cache.num_free_blocks, {s: cache.length(s) for s in seqs}


@pytest.fixture
def h():
    """Two sequences in a small pool (bs 4, 8 blocks): 0 has 10 tokens (3 blocks), 1 has 6 (2)."""
    h = Harness("v3", torch.float32, seed=40, block_size=4, num_blocks=8)
    h.step([(0, 10), (1, 6)])
    assert h.cache.num_free_blocks == 3
    return h


def still_correct(h):
    """The cache is usable and right after the failure: decode both, fork, verify."""
    h.step([(1, 1), (0, 1)])
    h.step([(0, 2), (1, 1)])


# ---------------------------------------------------------------------------------------
# Cache operations


def test_unknown_sequence(h):
    before = snapshot(h.cache, [0, 1])
    with raises("seq", "77"):
        h.cache.length(77)
    with raises("src_seq_id", "77"):
        h.cache.fork(77, 78)
    with raises("seq_id", "77"):
        h.cache.truncate(77, 0)
    with raises("seq_id", "77"):
        h.cache.release(77)
    assert snapshot(h.cache, [0, 1]) == before
    with raises("seq"):
        h.cache.length(78)                  # the failed fork made nothing
    still_correct(h)


def test_sequence_twice_in_one_prepare(h):
    before = snapshot(h.cache, [0, 1])
    with raises("0", TWICE):
        h.cache.prepare([(0, 1), (1, 1), (0, 2)])
    with raises("5", TWICE):
        h.cache.prepare([(5, 1), (5, 1)])   # twice, and new
    assert snapshot(h.cache, [0, 1]) == before
    with raises("seq"):
        h.cache.length(5)
    still_correct(h)


@pytest.mark.parametrize("n", [-1, 1.5, "2", None])
def test_bad_token_count(h, n):
    before = snapshot(h.cache, [0, 1])
    with raises("num_new_tokens"):
        h.cache.prepare([(1, 1), (0, n)])
    assert snapshot(h.cache, [0, 1]) == before
    still_correct(h)


def test_fork_onto_existing(h):
    before = snapshot(h.cache, [0, 1])
    with raises("dst_seq_id", "1"):
        h.cache.fork(0, 1)
    with raises("dst_seq_id"):
        h.cache.fork(0, 0)
    assert snapshot(h.cache, [0, 1]) == before
    still_correct(h)


def test_fork_onto_unhashable(h):
    before = snapshot(h.cache, [0, 1])
    with raises("dst_seq_id", "hashable"):
        h.cache.fork(0, ["x"])
    assert snapshot(h.cache, [0, 1]) == before
    still_correct(h)


@pytest.mark.parametrize("new_length", [11, 100, -1, 2.0])
def test_truncate_past_end(h, new_length):
    before = snapshot(h.cache, [0, 1])
    with raises("new_length"):
        h.cache.truncate(0, new_length)
    assert snapshot(h.cache, [0, 1]) == before
    still_correct(h)


def test_cache_full(h):
    """Sequence 2 asks for 13 tokens (4 blocks) with 3 free: CacheFullError, nothing changes."""
    before = snapshot(h.cache, [0, 1])
    with raises("block", exc=mla.CacheFullError):
        h.cache.prepare([(0, 1), (1, 1), (2, 13)])
    assert issubclass(mla.CacheFullError, ValueError)
    assert snapshot(h.cache, [0, 1]) == before
    with raises("seq"):
        h.cache.length(2)
    # A copy-on-write that does not fit is refused the same way.
    h.fork(0, 3)
    h.step([(2, 12)])                       # the last 3 blocks
    assert h.cache.num_free_blocks == 0
    before = snapshot(h.cache, [0, 1, 2, 3])
    with raises("block", exc=mla.CacheFullError):
        h.cache.prepare([(3, 1)])           # 3 shares 0's partial block: needs a copy
    assert snapshot(h.cache, [0, 1, 2, 3]) == before
    h.step([(1, 2)])                        # 6 -> 8 tokens: still in its own 2 blocks
    h.release(2)
    h.step([(3, 1), (0, 1), (1, 1)])
    h.step([(0, 1), (3, 1), (2, 3)])


def test_positions_past_max():
    """max_position_embeddings is 64: a sequence may hold 64 tokens, not 65."""
    h2 = Harness("v3", torch.float32, seed=41, block_size=8, num_blocks=20)
    limit = h2.cfg.max_position_embeddings
    assert limit == 64
    h2.step([(0, limit - 2), (1, 5)])
    before = snapshot(h2.cache, [0, 1])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        batch = h2.cache.prepare([(1, 1), (0, 3)])
        h2.layers[0](h2.new_inputs(4), batch)
    if snapshot(h2.cache, [0, 1]) != before:
        pytest.fail("prepare accepted positions past max_position_embeddings (only the layer refused)")
    with raises("max_position_embeddings"):
        h2.cache.prepare([(7, limit + 1)])
    assert snapshot(h2.cache, [0, 1]) == before
    h2.step([(0, 2), (1, 1)])               # exactly up to the limit is fine
    assert h2.cache.length(0) == limit


# ---------------------------------------------------------------------------------------
# The layer


@pytest.mark.parametrize("bad", ["rows+1", "rows-1", "hidden+1", "3d", "float64", "bfloat16", "int"])
def test_hidden_states_shape_dtype(h, bad):
    batch = h.cache.prepare([(0, 1), (1, 3)])
    x = h.new_inputs(4)
    bad_x = {"rows+1": lambda: h.new_inputs(5), "rows-1": lambda: h.new_inputs(3),
             "hidden+1": lambda: torch.randn(4, h.cfg.hidden_size + 1), "3d": lambda: x[None],
             "float64": lambda: x.double(), "bfloat16": lambda: x.bfloat16(),
             "int": lambda: x.long()}[bad]()
    with raises("hidden_states"):
        h.layers[0](bad_x, batch)
    # The batch is still good: the same step with the right input matches transformers.
    out = h.layers[0](x, batch)
    ref = []
    for (seq, n), rows in zip([(0, 1), (1, 3)], (x[:1], x[1:])):
        h.hist[seq][0].append(rows)
        full = torch.cat(h.hist[seq][0])
        ref.append(H.hf_reference(h.attn[0], h.rotary, full)[-n:])
    assert H.rel_err(out, torch.cat(ref)) <= H.FP32_TOL
    still_correct(h)


def test_cache_dtype_differs_from_layer(h):
    """A float32 layer over a bf16 cache: refused before the row is written (the decode op would
    refuse it only after the layer wrote it)."""
    cache = mla.PagedLatentCache(h.cfg, num_blocks=8, block_size=4, dtype=torch.bfloat16)
    for n in (10, 1):                    # a prompt, then a decode step
        batch = cache.prepare([("a", n)])
        with raises("batch", "dtype", "bfloat16", "float32"):
            h.layers[0](h.new_inputs(n), batch)
        assert not cache.kv.any()
    # an FP8 cache works with any layer dtype
    cache8 = mla.PagedLatentCache(h.cfg, num_blocks=8, block_size=4, dtype=torch.float8_e4m3fn)
    h.layers[0](h.new_inputs(3), cache8.prepare([("a", 3)]))
    assert cache8.kv.view(torch.uint8).any()


STALE = {
    "prepared again": lambda c: c.prepare([(0, 1)]),
    "truncated": lambda c: c.truncate(0, 9),
    "forked": lambda c: c.fork(0, 5),
    "released, its blocks reused": lambda c: (c.release(0), c.prepare([(6, 9)])),
}


@pytest.mark.parametrize("change", list(STALE))
def test_stale_batch(h, change):
    """A batch whose sequence changed after its prepare would write slots that now hold other
    tokens (or, after a fork, blocks shared with another sequence): refused, nothing written."""
    batch = h.cache.prepare([(0, 1), (1, 1)])
    STALE[change](h.cache)
    kv = h.cache.kv.clone()
    with raises("batch", "stale", "0"):
        h.layers[0](h.new_inputs(2), batch)
    assert torch.equal(h.cache.kv, kv)


def test_batch_of_unchanged_sequences_stays_valid(h):
    """Changes to other sequences leave a batch usable: it matches transformers."""
    batch = h.cache.prepare([(1, 2)])
    h.cache.prepare([(0, 1)])            # another sequence moves on (its row is never written)
    h.cache.truncate(0, 10)
    h.fork(0, 4)
    x = h.new_inputs(2)
    out = h.layers[0](x, batch)
    h.hist[1][0].append(x)
    ref = H.hf_reference(h.attn[0], h.rotary, torch.cat(h.hist[1][0]))[-2:]
    assert H.rel_err(out, ref) <= H.FP32_TOL
    still_correct(h)


def test_layer_idx_past_cache_layers(h):
    layer = mla.MLA(h.cfg, layer_idx=1, dtype=torch.float32, device="cpu", backend="torch")
    layer.load_hf_state_dict(H.state_dict(h.attn[0], prefix=H.layer_prefix(1)), prefix=H.layer_prefix(1))
    batch = h.cache.prepare([(0, 1)])
    with raises("layer"):
        layer(h.new_inputs(1), batch)


@pytest.mark.parametrize("kwargs,word", [({"dtype": torch.int32}, "dtype"), ({"backend": "cuda"}, "backend"),
                                         ({"max_workspace_tokens": 0}, "max_workspace_tokens")])
def test_layer_constructor(kwargs, word):
    cfg = mla.MLAConfig.from_hf(H.make_config("v3"))
    args = dict(layer_idx=0, dtype=torch.float32, device="cpu", backend="torch")
    args.update(kwargs)
    with raises(word):
        mla.MLA(cfg, **args)


@pytest.mark.parametrize("kwargs,word", [({"block_size": 0}, "block_size"), ({"num_blocks": 0}, "num_blocks"),
                                         ({"num_layers": 0}, "num_layers"), ({"dtype": torch.int8}, "dtype")])
def test_cache_constructor(kwargs, word):
    cfg = mla.MLAConfig.from_hf(H.make_config("v3"))
    args = dict(num_layers=1, num_blocks=8, block_size=4, dtype=torch.float32, device="cpu")
    args.update(kwargs)
    with raises(word):
        mla.PagedLatentCache(cfg, **args)


def _mutations(variant):
    attn, _ = H.make_attention(H.make_config(variant), seed=0)
    sd = H.state_dict(attn)
    P = H.PREFIX
    out = []
    for name in sd:
        short = name[len(P):]
        out.append((f"missing {short}", {k: v for k, v in sd.items() if k != name}, short))
        w = sd[name]
        bad = w[:-1] if w.dim() == 1 else (w.T.contiguous() if w.shape[0] != w.shape[1] else w[:, :-1])
        out.append((f"misshaped {short}", {**sd, name: bad}, short))
    return out


@pytest.mark.parametrize("variant", ["v3_bias", "v2_lite"])
def test_load_bad_state_dict(variant):
    h = Harness(variant, torch.float32, seed=42, block_size=4)
    h.step([(0, 7)])
    for what, sd, short in _mutations(variant):
        with raises(short.split(".")[0]):
            h.layers[0].load_hf_state_dict(sd, prefix=H.PREFIX)
    good = H.state_dict(h.attn[0])
    with raises("model.layers.1.self_attn."):
        h.layers[0].load_hf_state_dict(good, prefix="model.layers.1.self_attn.")   # wrong prefix
    # Every failed load left the loaded weights alone: the layer still matches transformers.
    h.step([(0, 1)])
    h.step([(0, 3), (1, 5)])


def test_load_ignores_other_keys():
    """A whole-model state dict loads: other layers' and modules' tensors are not this layer's."""
    h = Harness("v3", torch.float32, seed=44, block_size=4)
    other, _ = H.make_attention(h.hf_cfg, seed=99)
    sd = {**H.state_dict(other, prefix=H.layer_prefix(1)), **H.state_dict(h.attn[0]),
          "model.embed_tokens.weight": torch.randn(32, 64), "model.layers.0.mlp.gate_proj.weight": torch.randn(8, 64)}
    h.layers[0].load_hf_state_dict(sd, prefix=H.PREFIX)
    h.step([(0, 9)])
    h.step([(0, 1)])


def test_fresh_layer_with_bad_weights_does_not_run():
    h = Harness("v3", torch.float32, seed=43, block_size=4)
    layer = mla.MLA(h.cfg, layer_idx=0, dtype=torch.float32, device="cpu", backend="torch")
    sd = H.state_dict(h.attn[0])
    del sd[H.PREFIX + "kv_b_proj.weight"]
    with raises("kv_b_proj"):
        layer.load_hf_state_dict(sd, prefix=H.PREFIX)
    batch = h.cache.prepare([(0, 2)])
    with pytest.raises(ValueError):
        layer(h.new_inputs(2), batch)


# ---------------------------------------------------------------------------------------
# Configuration


def _llama_dict():
    return {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
            "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5}


MLA_FIELDS = r"(kv_lora_rank|qk_nope_head_dim|qk_rope_head_dim|v_head_dim)"


@pytest.mark.parametrize("source", ["dict", "object"])
def test_from_hf_without_mla_fields(source):
    arg = _llama_dict() if source == "dict" else LlamaConfig(hidden_size=256, num_attention_heads=4,
                                                             intermediate_size=512)
    with pytest.raises(ValueError, match=MLA_FIELDS):
        mla.MLAConfig.from_hf(arg)


@pytest.mark.parametrize("drop", ["kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim"])
def test_from_hf_missing_one_field(drop):
    d = H.config_json(H.make_config("v3"))
    del d[drop]
    with raises(drop):
        mla.MLAConfig.from_hf(d)


@pytest.mark.parametrize("arg", ["deepseek-v3", 7168, None])
def test_from_hf_not_a_config(arg):
    with pytest.raises(ValueError):
        mla.MLAConfig.from_hf(arg)


def test_from_hf_bad_values():
    d = H.config_json(H.make_config("v3"))
    with raises("qk_rope_head_dim"):
        mla.MLAConfig.from_hf({**d, "qk_rope_head_dim": 7})       # RoPE rotates pairs
    with raises("kv_lora_rank"):
        mla.MLAConfig.from_hf({**d, "kv_lora_rank": 0})


def test_from_hf_yarn_without_factor_or_max_positions():
    d = H.config_json(H.make_config("v3"))
    d["rope_scaling"] = {"type": "yarn", "original_max_position_embeddings": 32}
    d.pop("rope_parameters", None)
    d.pop("max_position_embeddings", None)
    with raises("rope_scaling", "factor", "max_position_embeddings"):
        mla.MLAConfig.from_hf(d)
    d["max_position_embeddings"] = 128               # transformers' rule: factor = 128 / 32
    assert mla.MLAConfig.from_hf(d).rope_scaling.factor == 4.0


def test_unknown_preset():
    with raises("deepseek-v9"):
        mla.MLAConfig.preset("deepseek-v9")


# ---------------------------------------------------------------------------------------
# mla.ops


def _decode_args(B=2, s_q=2, Hh=3, r=16, dr=8, nb=6, bs=4):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, s_q, Hh, r + dr, generator=g)
    kv = torch.randn(nb, bs, r + dr, generator=g)
    table = torch.tensor([[0, 2, 4], [1, 3, 5]], dtype=torch.int32)[:B]
    seqlens = torch.tensor([9, 4], dtype=torch.int32)[:B]
    return dict(q=q, kv_cache=kv, block_table=table, cache_seqlens=seqlens, head_dim_v=r, softmax_scale=0.3)


DECODE_BAD = {
    "q 3-D": ("q", lambda a: a["q"][0]),
    "q int": ("q", lambda a: a["q"].to(torch.int32)),
    "kv_cache wrong d": ("kv_cache", lambda a: a["kv_cache"][..., :-1]),
    "kv_cache dtype": ("kv_cache", lambda a: a["kv_cache"].double()),
    "kv_cache 4-D not 1": ("kv_cache", lambda a: a["kv_cache"][:, :, None].expand(-1, -1, 2, -1)),
    "block_table int64": ("block_table", lambda a: a["block_table"].long()),
    "block_table 1-D": ("block_table", lambda a: a["block_table"][0]),
    "block_table batch": ("block_table", lambda a: a["block_table"][:1]),
    "cache_seqlens int64": ("cache_seqlens", lambda a: a["cache_seqlens"].long()),
    "cache_seqlens length": ("cache_seqlens", lambda a: a["cache_seqlens"][:1]),
    "head_dim_v too big": ("head_dim_v", lambda a: 25),
    "head_dim_v zero": ("head_dim_v", lambda a: 0),
}


@pytest.mark.parametrize("case", list(DECODE_BAD))
def test_ops_mla_decode_bad_args(case):
    arg, make = DECODE_BAD[case]
    a = _decode_args()
    out, lse = mla.ops.mla_decode(**a)               # the good call works (and is right, below)
    a[arg] = make(a)
    with raises(arg):
        mla.ops.mla_decode(**a)


def test_ops_mla_decode_values():
    """The good call of the error tests gives the paged causal attention it documents."""
    a = _decode_args()
    out, lse = mla.ops.mla_decode(**a, backend="torch")
    q, kv, table, lens = a["q"], a["kv_cache"], a["block_table"], a["cache_seqlens"]
    for b in range(2):
        n = int(lens[b])
        rows = torch.cat([kv[int(blk)] for blk in table[b]])[:n]            # [n, d]
        for i in range(2):
            vis = n - 2 + i + 1
            s = (q[b, i] @ rows[:vis].T) * 0.3                              # [H, vis]
            ref = torch.softmax(s, -1) @ rows[:vis, :16]
            torch.testing.assert_close(out[b, i], ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lse[b, i], torch.logsumexp(s, -1), rtol=1e-5, atol=1e-5)
    assert lse.dtype == torch.float32 and out.shape == (2, 2, 3, 16)


def _prefill_args():
    g = torch.Generator().manual_seed(6)
    return dict(q=torch.randn(7, 3, 12, generator=g), k=torch.randn(9, 3, 12, generator=g),
                v=torch.randn(9, 3, 8, generator=g), cu_seqlens_q=torch.tensor([0, 3, 7], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, 4, 9], dtype=torch.int32), softmax_scale=0.25)


PREFILL_BAD = {
    "q 2-D": ("q", lambda a: a["q"][:, 0]),
    "k heads": ("k", lambda a: a["k"][:, :2]),
    "k dim": ("k", lambda a: a["k"][..., :-1]),
    "v tokens": ("v", lambda a: a["v"][:-1]),
    "k dtype": ("k", lambda a: a["k"].double()),
    "cu_seqlens_q int64": ("cu_seqlens_q", lambda a: a["cu_seqlens_q"].long()),
    "cu_seqlens_k int64": ("cu_seqlens_k", lambda a: a["cu_seqlens_k"].long()),
    "cu_seqlens_k length": ("cu_seqlens_k", lambda a: a["cu_seqlens_k"][:2]),
    # lengths 3 and 4 (7 query rows), 4 and 5 (9 key rows): the longest are 4 and 5
    "max_seqlen_q too small": ("max_seqlen_q", lambda a: 3),
    "max_seqlen_q too large": ("max_seqlen_q", lambda a: 8),
    "max_seqlen_k float": ("max_seqlen_k", lambda a: 5.0),
    "max_seqlen_k bool": ("max_seqlen_k", lambda a: True),
    "offsets_q device tensor": ("offsets_q", lambda a: a["cu_seqlens_q"]),
    "offsets_q length": ("offsets_q", lambda a: (0, 7)),
    "offsets_q wrong total": ("offsets_q", lambda a: (0, 3, 8)),
    "offsets_k decreasing": ("offsets_k", lambda a: (0, 10, 9)),
    "offsets_k not from 0": ("offsets_k", lambda a: (1, 4, 9)),
    "offsets_k float": ("offsets_k", lambda a: (0, 4.0, 9)),
}


@pytest.mark.parametrize("case", list(PREFILL_BAD))
def test_ops_prefill_bad_args(case):
    arg, make = PREFILL_BAD[case]
    a = _prefill_args()
    mla.ops.prefill_attention(**a)
    a[arg] = make(a)
    with raises(arg):
        mla.ops.prefill_attention(**a)


def test_ops_prefill_values():
    a = _prefill_args()
    out, lse = mla.ops.prefill_attention(**a, backend="torch")
    for backend in ("torch", "triton"):   # the host hints change no value
        hinted = mla.ops.prefill_attention(**a, max_seqlen_q=4, max_seqlen_k=5, backend=backend)
        torch.testing.assert_close(hinted, (out, lse), rtol=1e-5, atol=1e-6)
        hinted = mla.ops.prefill_attention(**a, offsets_q=[0, 3, 7], offsets_k=(0, 4, 9), backend=backend)
        torch.testing.assert_close(hinted, (out, lse), rtol=1e-5, atol=1e-6)
    for (q0, q1), (k0, k1) in (((0, 3), (0, 4)), ((3, 7), (4, 9))):
        nq, nk = q1 - q0, k1 - k0
        s = torch.einsum("qhd,khd->hqk", a["q"][q0:q1], a["k"][k0:k1]) * 0.25
        s = s.masked_fill(torch.ones(nq, nk, dtype=torch.bool).triu(nk - nq + 1), float("-inf"))
        ref = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), a["v"][k0:k1])
        torch.testing.assert_close(out[q0:q1], ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[q0:q1], torch.logsumexp(s, -1).T, rtol=1e-5, atol=1e-5)


def test_ops_merge_bad_args():
    o = torch.randn(4, 3, 8)
    lse = torch.randn(4, 3)
    with raises("lse_a"):
        mla.ops.merge_attention(o, lse.half(), o, lse)
    with raises("lse_b"):
        mla.ops.merge_attention(o, lse, o, lse[:2])
    with raises("out_b"):
        mla.ops.merge_attention(o, lse, o[:2], lse)


def test_ops_merge_values_and_empty_parts():
    g = torch.Generator().manual_seed(7)
    s = torch.randn(2, 10, generator=g)
    v = torch.randn(10, 5, generator=g)
    full = torch.softmax(s, -1) @ v
    parts = []
    for sl in (slice(0, 6), slice(6, 10)):
        parts += [torch.softmax(s[:, sl], -1) @ v[sl], torch.logsumexp(s[:, sl], -1)]
    out, lse = mla.ops.merge_attention(*parts)
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), rtol=1e-6, atol=1e-6)
    empty_o, empty_l = torch.zeros(2, 5), torch.full((2,), float("-inf"))
    out, lse = mla.ops.merge_attention(parts[0], parts[1], empty_o, empty_l)
    torch.testing.assert_close(out, parts[0])
    out, lse = mla.ops.merge_attention(empty_o, empty_l, empty_o, empty_l)
    assert not out.isnan().any() and (out == 0).all() and (lse == float("-inf")).all()


@pytest.mark.parametrize("op", ["mla_decode", "prefill_attention"])
def test_ops_bad_backend(op):
    a = _decode_args() if op == "mla_decode" else _prefill_args()
    with raises("backend"):
        getattr(mla.ops, op)(**a, backend="cuda")
