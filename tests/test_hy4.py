"""Hy4 (transformers' hy_v4): attention sinks in the sparse ops against a straightforward
oracle, the layer's output gate, and the layer exact against HYV4Attention.

Hy4 is DeepSeek-V3.2's sparse MLA with neox RoPE, the indexer's RoPE on the last
qk_rope_head_dim values of its head, a learnable sink logit per head, and a sigmoid output
gate per head (attn * sigmoid(gate_proj(x))) before o_proj.
"""
from __future__ import annotations

import copy

import pytest
import torch

import hf_families as F
import mla
from hf_util import FP32_TOL, rel_err
from test_sparse import decode_case, prefill_case, rows_of, sparse_oracle
from mla.testing import random_state_dict



@pytest.mark.parametrize("H", [1, 3, 16])
def test_sparse_mla_decode_sink(H):
    g = torch.Generator().manual_seed(H)
    r = 64
    cache, flat, idx, q = decode_case(g, H, r)
    B, s_q, _, d = q.shape
    sink = torch.randn(H, generator=g) * 2
    out, lse = mla.ops.sparse_mla_decode(q, cache, idx, r, 0.1, attn_sink=sink)
    want_o, want_l = sparse_oracle(q.view(B * s_q, H, d), rows_of(flat, idx), 0.1, r, sink)
    assert not out.isnan().any() and lse.isfinite().all()
    assert torch.allclose(out.view(-1, H, r).double(), want_o, atol=1e-5)
    assert torch.allclose(lse.view(-1, H).double(), want_l, atol=1e-5)
    # a query with no index: out 0 and lse the sink alone (the sink is the only logit)
    assert (out[0, 2] == 0).all() and torch.equal(lse[0, 2], sink)
    # the sink only lowers every weight: out = out_without * exp(lse_without - lse)
    o0, l0 = mla.ops.sparse_mla_decode(q, cache, idx, r, 0.1)
    fin = l0.isfinite()
    assert torch.allclose(out[fin], (o0 * torch.exp(l0 - lse)[..., None])[fin], atol=1e-6)
    # a sink of -inf is no sink
    o1, l1 = mla.ops.sparse_mla_decode(q, cache, idx, r, 0.1, attn_sink=torch.full((H,), float("-inf")))
    assert torch.equal(o1, o0) and torch.equal(l1.isinf(), l0.isinf()) and not o1.isnan().any()


@pytest.mark.parametrize("H", [1, 7])
def test_sparse_prefill_attention_sink(H):
    g = torch.Generator().manual_seed(H)
    dv = 32
    q, kv, idx = prefill_case(g, H)                            # the last query has no index
    sink = torch.randn(H, generator=g)
    out, lse = mla.ops.sparse_prefill_attention(q, kv, idx, 0.2, dv, attn_sink=sink)
    want_o, want_l = sparse_oracle(q, rows_of(kv[:, 0], idx), 0.2, dv, sink)
    assert torch.allclose(out.double(), want_o, atol=1e-5) and torch.allclose(lse.double(), want_l, atol=1e-5)
    assert (out[-1] == 0).all() and torch.equal(lse[-1], sink)
    o2, l2 = mla.ops.sparse_mla_decode(q[None], kv[:, 0][None], idx[:, 0][None], dv, 0.2, attn_sink=sink)
    assert torch.allclose(o2[0], out, atol=1e-6) and torch.allclose(l2[0], lse, atol=1e-6)


def test_sink_validation():
    q, cache = torch.randn(1, 1, 2, 24), torch.randn(3, 4, 24)
    idx = torch.tensor([[[1]]], dtype=torch.int32)
    for bad in (torch.zeros(3), torch.zeros(2, dtype=torch.float64), torch.zeros(1, 2), [0.0, 0.0]):
        with pytest.raises(ValueError, match="attn_sink"):
            mla.ops.sparse_mla_decode(q, cache, idx, 16, 0.1, attn_sink=bad)
        with pytest.raises(ValueError, match="attn_sink"):
            mla.ops.sparse_prefill_attention(q[0], cache[0][:, None], idx[0][:, None], 0.1, 16, attn_sink=bad)


# ---------------------------------------------------------------------------------------
# from_hf, loading, the output gate hook, the layer against HYV4Attention

CASE = F.SPARSE["hy_v4"]


def test_from_hf_reads_hy4():
    hf_cfg = CASE.make_config(rms_norm_eps=3e-5)
    for source in ("object", "dict"):
        cfg = mla.MLAConfig.from_hf(F.config_source(hf_cfg, source))
        assert cfg.attention_sinks and cfg.output_gate == "sigmoid"
        assert not cfg.rope_interleave and not cfg.index_rope_interleave and cfg.index_rope_last
        assert cfg.index_k_norm_eps == 3e-5 and (cfg.q_norm_eps, cfg.kv_norm_eps) == (1e-6, 1e-6)
        assert cfg.index_shared_layers == ()
    # the published default: layer 0 and every 4th from 1 run their indexer, the others share
    cfg = mla.MLAConfig.from_hf(CASE.make_config(num_hidden_layers=7))
    assert cfg.index_shared_layers == (2, 3, 4, 6) and cfg.index_source_layer(4) == 1
    with pytest.raises(NotImplementedError, match="layer_types"):
        mla.MLAConfig.from_hf(CASE.make_config(layer_types=["sliding_attention", "deepseek_sparse_attention"]))


def test_config_and_strategy_refusals():
    cfg = mla.MLAConfig.from_hf(CASE.make_config())
    with pytest.raises(ValueError, match="attention_sinks"):
        cfg.replace(index_topk=None)
    with pytest.raises(ValueError, match="output_gate"):
        cfg.replace(output_gate="tanh")
    with pytest.raises(ValueError, match="strategy.*sinks"):
        mla.MLA(cfg, dtype=torch.float32, strategy="absorbed")


@pytest.mark.parametrize("missing", ["sinks", "gate_proj.weight"])
def test_strict_loading_of_sinks_and_gate(missing):
    cfg = mla.MLAConfig.from_hf(CASE.make_config())
    shapes = mla.weights.hf_weight_shapes(cfg)
    assert shapes["sinks"] == (4,) and shapes["gate_proj.weight"] == (4 * 16, 64)
    attn, _ = F.make_attention(CASE, CASE.make_config(), 0)
    sd = F.state_dict(attn, CASE.prefix)
    layer = mla.MLA(cfg, dtype=torch.float32, backend="torch")
    with pytest.raises(ValueError, match=missing):
        layer.load_hf_state_dict({k: v for k, v in sd.items() if not k.endswith(missing)}, prefix=CASE.prefix)
    assert not layer.loaded
    # a config without them refuses the tensors as unused
    plain = mla.MLA(cfg.replace(attention_sinks=False, output_gate=None), dtype=torch.float32, backend="torch")
    with pytest.raises(ValueError, match="sinks|gate_proj"):
        plain.load_hf_state_dict(sd, prefix=CASE.prefix)
    layer.load_hf_state_dict(sd, prefix=CASE.prefix)
    assert torch.equal(layer.sinks, attn.sinks.detach())


def test_output_gate_part():
    """The layer's gate part, picked from the config: Hy4's sigmoid(gate_proj(x)) on attn
    [T, H_s, dv], the identity without a gate; forward applies its gate before o_proj."""
    h = F.FamilyHarness("hy_v4", torch.float32, seed=4)
    x = torch.randn(5, 64)
    attn = torch.randn(5, 4, 16)
    assert isinstance(h.layer.gate, mla.projections.ProjectedGate)
    gated = h.layer.gate(h.layer, x, attn, None)
    want = attn * torch.sigmoid((x @ h.layer.w_gate.T).view(5, 4, 16))
    assert torch.allclose(gated, want)
    plain = mla.MLA(mla.MLAConfig.preset("tiny"), dtype=torch.float32)
    assert type(plain.gate) is mla.projections.NoGate and plain.gate(plain, x, attn, None) is attn

    class Halved(mla.projections.NoGate):
        def __call__(self, layer, hidden_states, attn, gate_logits):
            return attn * 0.5

    cfg = mla.MLAConfig.preset("tiny")
    sd = random_state_dict(cfg, torch.Generator().manual_seed(0))
    outs = []
    for gate in (None, Halved()):
        layer = mla.MLA(cfg, dtype=torch.float32, backend="torch")
        layer.gate = gate or layer.gate
        layer.load_hf_state_dict(sd)
        cache = mla.PagedLatentCache(cfg, num_blocks=8, block_size=4, dtype=torch.float32)
        outs.append(layer(torch.randn(6, cfg.hidden_size, generator=torch.Generator().manual_seed(0)),
                          cache.prepare([(0, 6)])))
    assert torch.allclose(outs[1], outs[0] * 0.5, atol=1e-6)   # o_proj is linear (no bias in tiny)


def test_sinks_and_gate_matter():
    """The oracle changes without the sinks or the gate: a layer that ignored either would fail."""
    h = F.FamilyHarness("hy_v4", torch.float32, seed=1)
    x = h.new_inputs(20).double()
    ref = F.reference(CASE, h.attn_ref, h.rotary, x)
    no_sink = copy.deepcopy(h.attn_ref)
    with torch.no_grad():
        no_sink.sinks.fill_(float("-inf"))
    assert rel_err(F.reference(CASE, no_sink, h.rotary, x), ref) > 1e-2
    no_gate = copy.deepcopy(h.attn_ref)
    with torch.no_grad():
        no_gate.gate_proj.weight.zero_()    # sigmoid(0) = 1/2 everywhere
    assert rel_err(2 * F.reference(CASE, no_gate, h.rotary, x), ref) > 1e-2


def test_short_prompt_takes_the_sparse_path():
    """Below index_topk keys too: the sinks exist only in the sparse ops."""
    h = F.FamilyHarness("hy_v4", torch.float32, seed=6)
    plans = []
    h.step([(0, 5)], on_batch=lambda b: plans.append(h.layer.plan(b)))
    h.step([(0, 1), (1, 3)], on_batch=lambda b: plans.append(h.layer.plan(b)))
    assert [p.strategy for p in plans] == [["sparse"], ["sparse", "sparse"]]
    assert max(h.errors) <= FP32_TOL


def test_bf16_within_the_modules_own_error():
    h = F.FamilyHarness("hy_v4", torch.bfloat16, seed=2)
    h.step([(0, 24)])
    h.step([(0, 1)])
    h.step([(0, 3)])
    h.check_bf16()


def test_shared_indexer_layer():
    """Layer 1 of indexer_types ["full", "shared"] attends with layer 0's top-k, as the module does
    when fed the previous layer's prev_topk_indices."""
    F.check_shared_layer("hy_v4", CASE.make_config(indexer_types=["full", "shared"]), seed=20)


def _tp_worker(rank, world, port, results):
    import os

    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        hf_cfg = CASE.make_config()
        attn, rotary = F.make_attention(CASE, hf_cfg, seed=3)
        cfg = mla.MLAConfig.from_hf(hf_cfg)
        par = mla.Parallel(tp_size=world)
        layer = mla.MLA(cfg, dtype=torch.float32, backend="torch", parallel=par)
        layer.load_hf_state_dict(F.state_dict(attn, CASE.prefix), prefix=CASE.prefix)
        cache = mla.PagedLatentCache(cfg, num_blocks=32, block_size=4, dtype=torch.float32, parallel=par)
        ref_attn = attn.double()
        g = torch.Generator().manual_seed(11)
        hist, errs = torch.zeros(0, cfg.hidden_size), []
        for n in (20, 1, 3):
            x = torch.randn(n, cfg.hidden_size, generator=g)
            out = layer(x, cache.prepare([(0, n)]))
            hist = torch.cat([hist, x])
            errs.append(rel_err(out.double(), F.reference(CASE, ref_attn, rotary, hist.double())[-n:]))
        results[rank] = max(errs)
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_shards_sinks_and_gate():
    """TP 2 on gloo: each rank's sinks and gate rows are its heads'; the output is the module's."""
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as m:
        results = m.dict()
        mp.spawn(_tp_worker, args=(2, port, results), nprocs=2)
        errs = dict(results)
    assert sorted(errs) == [0, 1] and max(errs.values()) <= FP32_TOL, errs
