"""A.X-K2 (transformers' axk2): the fused q_gate_proj and the output gate it feeds.

A.X-K2 is DeepSeek-V3.2's sparse MLA (the same indexer: neox RoPE on the first
qk_rope_head_dim values, key LayerNorm eps 1e-6, q from q_a_norm(q_a)) without q_b_proj: one
q_gate_proj [H * (dn + dr + dv), 2 * rq] over cat(q_a_norm(q_a), q_a) gives per head the
query, then dv gate logits; attn * sigmoid(gate) (float32, cast back) before o_proj. The
layer exact against AXK2Attention (prompt, decode, drafts + truncate, fork, chunked prefill)
is the SPARSE table's "axk2" case in tests/test_sparse.py; here what is A.X-K2's own.
"""
from __future__ import annotations

import copy

import pytest
import torch

import hf_families as F
import mla
from hf_util import FP32_TOL, rel_err
from mla.weights import dequant_block_fp8, quantize_checkpoint_fp8

CASE = F.SPARSE["axk2"]
NAME = "q_gate_proj.weight"


def test_from_hf_reads_axk2():
    hf_cfg = CASE.make_config()
    for source in ("object", "dict"):
        cfg = mla.MLAConfig.from_hf(F.config_source(hf_cfg, source))
        assert cfg.q_gate_fused and cfg.output_gate == "sigmoid" and not cfg.attention_sinks
        assert cfg.rope_interleave and not cfg.index_rope_interleave and not cfg.index_rope_last
        assert (cfg.q_norm_eps, cfg.kv_norm_eps, cfg.index_k_norm_eps) == (1e-6, 1e-6, 1e-6)
    shapes = mla.weights.hf_weight_shapes(cfg)
    assert shapes[NAME] == (3 * (16 + 8 + 24), 2 * 24)
    assert "q_b_proj.weight" not in shapes and "gate_proj.weight" not in shapes


def test_config_and_parallel_refusals():
    cfg = mla.MLAConfig.from_hf(CASE.make_config())
    for bad in (dict(output_gate=None), dict(q_lora_rank=None), dict(q_gate_fused=1)):
        with pytest.raises(ValueError, match="q_gate_fused"):
            cfg.replace(**bad)
    with pytest.raises(ValueError, match="q_gate_proj"):
        mla.MLA(cfg, dtype=torch.float32, parallel=mla.Parallel(tp_size=1))


def test_strict_loading_of_q_gate_proj():
    cfg = mla.MLAConfig.from_hf(CASE.make_config())
    attn, _ = F.make_attention(CASE, CASE.make_config(), 0)
    sd = F.state_dict(attn, CASE.prefix)
    layer = mla.MLA(cfg, dtype=torch.float32, backend="torch")
    with pytest.raises(ValueError, match=NAME):
        layer.load_hf_state_dict({k: v for k, v in sd.items() if not k.endswith(NAME)}, prefix=CASE.prefix)
    bad = dict(sd, **{CASE.prefix + NAME: sd[CASE.prefix + NAME][:, :24]})    # q_a_norm(q_a)'s half only
    with pytest.raises(ValueError, match=NAME):
        layer.load_hf_state_dict(bad, prefix=CASE.prefix)
    with pytest.raises(ValueError, match="q_b_proj"):
        layer.load_hf_state_dict(dict(sd, **{CASE.prefix + "q_b_proj.weight": torch.zeros(3 * 24, 24)}),
                                 prefix=CASE.prefix)
    assert not layer.loaded
    # a layer without the fused projection refuses it as unused
    plain = mla.MLA(cfg.replace(q_gate_fused=False, output_gate=None), dtype=torch.float32, backend="torch")
    with pytest.raises(ValueError, match=NAME):
        plain.load_hf_state_dict(dict(sd, **{CASE.prefix + "q_b_proj.weight": torch.zeros(3 * 24, 24)}),
                                 prefix=CASE.prefix)
    layer.load_hf_state_dict(sd, prefix=CASE.prefix)
    assert torch.equal(layer.w_q_b, attn.q_gate_proj.weight.detach()) and not hasattr(layer, "w_gate")


def test_gate_matters():
    """The oracle changes with the gate half of q_gate_proj zeroed (sigmoid(0) = 1/2 everywhere):
    a layer that ignored the gate would fail the SPARSE tests."""
    h = F.FamilyHarness("axk2", torch.float32, seed=1)
    x = h.new_inputs(20).double()
    ref = F.reference(CASE, h.attn_ref, h.rotary, x)
    no_gate = copy.deepcopy(h.attn_ref)
    with torch.no_grad():
        no_gate.q_gate_proj.weight.view(3, 16 + 8 + 24, -1)[:, 16 + 8:].zero_()
    assert rel_err(2 * F.reference(CASE, no_gate, h.rotary, x), ref) > 1e-2


def test_output_gate_takes_the_fused_logits():
    h = F.FamilyHarness("axk2", torch.float32, seed=4)
    assert isinstance(h.layer.query, mla.projections.FusedQueryGate)
    x, attn, gate = torch.randn(5, 64), torch.randn(5, 3, 24), torch.randn(5, 3, 24)
    assert torch.allclose(h.layer.gate(h.layer, x, attn, gate), attn * torch.sigmoid(gate))


def test_short_prompt_dense_then_sparse():
    """Up to index_topk keys the dense paths (gated too), then the sparse path."""
    h = F.FamilyHarness("axk2", torch.float32, seed=6)
    plans = []
    h.step([(0, 5)], on_batch=lambda b: plans.append(h.layer.plan(b)))
    h.step([(0, 1), (1, 3)], on_batch=lambda b: plans.append(h.layer.plan(b)))
    h.step([(0, 6), (1, 9)], on_batch=lambda b: plans.append(h.layer.plan(b)))
    assert [p.strategy for p in plans] == [["prefill"], ["absorbed", "prefill"], ["sparse", "sparse"]]
    assert max(h.errors) <= FP32_TOL


def test_bf16_within_the_modules_own_error():
    h = F.FamilyHarness("axk2", torch.bfloat16, seed=2)
    h.step([(0, 24)])
    h.step([(0, 1)])
    h.step([(0, 3)])
    h.check_bf16()


def test_fp8_checkpoint_dequantizes_q_gate_proj():
    """An FP8 checkpoint's q_gate_proj is dequantized even where o_proj stays FP8; the layer is
    then the module's on the dequantized weights."""
    hf_cfg = CASE.make_config()
    cfg = mla.MLAConfig.from_hf(hf_cfg)
    attn, rotary = F.make_attention(CASE, hf_cfg, 0)
    fp8 = quantize_checkpoint_fp8(F.state_dict(attn, CASE.prefix))
    layer = mla.MLA(cfg, dtype=torch.float32, backend="torch", fp8_weights="always")
    layer.load_hf_state_dict(fp8, prefix=CASE.prefix)
    assert layer.w_q_b_scale is None and layer.w_q_b.dtype == torch.float32
    assert torch.equal(layer.w_q_b, dequant_block_fp8(fp8[CASE.prefix + NAME], fp8[CASE.prefix + NAME + "_scale_inv"]))
    assert layer.w_o_scale is not None
