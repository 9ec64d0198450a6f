"""Tiny random DeepSeek-V2/V3 attention modules from transformers, built offline,
and the full-sequence reference the layer tests compare against.

Everything here is test scaffolding around transformers' own modules
(``DeepseekV3Attention`` / ``DeepseekV2Attention`` and their rotary embeddings):
the reference for any step of a test is HF attention recomputed from scratch over
the whole token sequence, taking the rows of the new tokens.

Weights are unit-scale (std ``WEIGHT_GAIN / sqrt(fan_in)``) so that attention is
peaky and positions matter; norm weights are random around 1.

``Harness`` drives our layer(s) and cache through the public API (``mla.MLAConfig.from_hf``,
``mla.MLA``, ``mla.PagedLatentCache``) beside those modules and checks every step.
"""
from __future__ import annotations

import copy
import math

import torch

import mla
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Attention, DeepseekV2RotaryEmbedding
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

PREFIX = "model.layers.0.self_attn."
WEIGHT_GAIN = 2.0
# Float32: HF in float32 against float64 differs by ~5e-7 overall and ~2e-6 on one row.
FP32_TOL = 1e-5
# bfloat16: ours <= 2 x (HF module in bf16 vs the float32 reference) + this slack.
BF16_SLACK = 1e-3

_BASE = dict(
    hidden_size=64, num_attention_heads=4, q_lora_rank=24, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-6,
    attention_bias=False, num_hidden_layers=2, vocab_size=32,
)


def _yarn(factor=4.0, orig=16, mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1):
    d = {"type": "yarn", "factor": factor, "original_max_position_embeddings": orig,
         "beta_fast": beta_fast, "beta_slow": beta_slow}
    if mscale is not None:
        d["mscale"] = mscale
    if mscale_all_dim is not None:
        d["mscale_all_dim"] = mscale_all_dim
    return d


# name -> (architecture, overrides of _BASE). Sequences reach ~48 tokens: past the original
# context of 16 where YaRN uses one, with an interior ramp where the rope dim is 16.
VARIANTS = {
    # DeepSeek-V3 proper: q_lora, YaRN, interleaved pairs.
    "v3": ("v3", dict(rope_scaling=_yarn(), rope_interleave=True)),
    # neox pairing, 3 heads, v_head_dim != qk_nope_head_dim, a wider rope dim, and
    # mscale != mscale_all_dim so cos/sin carry a non-trivial YaRN attention factor
    # and the softmax scale its mscale_all_dim correction.
    # The original context (512) puts YaRN's ramp bounds at 0.81 and 3.82 of 8 frequencies:
    # floored/ceiled to 0 and 4, so three frequencies get interior ramp values.
    "v3_neox_mscale": ("v3", dict(num_attention_heads=3, v_head_dim=24, qk_rope_head_dim=16,
                                  max_position_embeddings=2048,
                                  rope_scaling=_yarn(orig=512, mscale=0.707, mscale_all_dim=1.0),
                                  rope_interleave=False)),
    # attention_bias (q_a_proj, kv_a_proj_with_mqa, o_proj), plain RoPE.
    "v3_bias": ("v3", dict(num_attention_heads=3, attention_bias=True, rope_scaling=None,
                           rope_interleave=True)),
    # V3 architecture without q_lora (lite layout) with attention_bias (kv_a and o_proj only:
    # q_proj has none), YaRN with no mscale keys at all (cos/sin scaled by 0.1 ln(factor) + 1).
    "v3_lite": ("v3", dict(q_lora_rank=None, attention_bias=True,
                           rope_scaling=_yarn(mscale=None, mscale_all_dim=None), rope_interleave=True)),
    # DeepSeek-V2 (complex = interleaved rope), mscale == mscale_all_dim == 0.707.
    # (ramp bounds 2.62 and 5.63 of 8 frequencies: 2 and 6 after floor/ceil).
    "v2": ("v2", dict(qk_rope_head_dim=16, max_position_embeddings=16384,
                      rope_scaling=_yarn(orig=4096, mscale=0.707, mscale_all_dim=0.707))),
    # DeepSeek-V2-Lite: q_proj, no q_lora; v_head_dim != qk_nope_head_dim.
    "v2_lite": ("v2", dict(q_lora_rank=None, v_head_dim=12,
                           rope_scaling=_yarn(mscale=0.707, mscale_all_dim=0.707))),
}


def make_config(name: str, **overrides):
    """A transformers DeepseekV2Config / DeepseekV3Config for a variant of VARIANTS."""
    arch, extra = VARIANTS[name]
    kw = dict(_BASE)
    kw.update(copy.deepcopy(extra))
    kw.update(overrides)
    kw["num_key_value_heads"] = kw["num_attention_heads"]
    if kw.get("rope_scaling") is None:
        kw.pop("rope_scaling", None)
    if arch == "v3":
        kw.update(n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1)
        cfg = DeepseekV3Config(**kw)
    else:
        kw.pop("rope_interleave", None)
        cfg = DeepseekV2Config(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def config_json(hf_config, legacy: bool = True) -> dict:
    """The config.json-style dict of a config: with ``legacy`` the published DeepSeek
    layout (``rope_theta`` + ``rope_scaling`` with ``type``, no ``rope_interleave`` key
    when it is true); otherwise what transformers 5 writes (``rope_parameters``)."""
    d = hf_config.to_dict()
    if not legacy:
        return d
    rp = dict(d.pop("rope_parameters", None) or {})
    d.pop("rope_scaling", None)
    d["rope_theta"] = rp.pop("rope_theta", 10000.0)
    rope_type = rp.pop("rope_type", "default")
    rp.pop("type", None)
    if rope_type != "default":
        d["rope_scaling"] = {"type": rope_type, **rp}
    if d.get("rope_interleave", True):
        d.pop("rope_interleave", None)
    return d


def config_source(hf_config, source: str):
    """What a user hands to ``MLAConfig.from_hf``: the transformers config ("object"), its
    config.json in the published layout ("legacy_dict") or transformers 5's ("dict"), or a
    Kimi K2 config.json ("kimi_dict": DeepSeek-V3's architecture under model_type kimi_k2)."""
    if source == "object":
        return hf_config
    if source == "kimi_dict":
        d = config_json(hf_config, legacy=True)
        d.update(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"])
        return d
    if source not in ("legacy_dict", "dict"):
        raise ValueError(f"source: expected object, legacy_dict, dict or kimi_dict, got {source!r}")
    return config_json(hf_config, legacy=(source == "legacy_dict"))


def is_v2(hf_config) -> bool:
    return isinstance(hf_config, DeepseekV2Config)


@torch.no_grad()
def make_attention(hf_config, seed: int, layer_idx: int = 0):
    """(attention module, rotary module) in float32 with unit-scale random weights."""
    g = torch.Generator().manual_seed(seed)
    attn_cls, rot_cls = ((DeepseekV2Attention, DeepseekV2RotaryEmbedding) if is_v2(hf_config)
                         else (DeepseekV3Attention, DeepseekV3RotaryEmbedding))
    attn = attn_cls(hf_config, layer_idx).float().eval()
    for name, p in attn.named_parameters():
        if name.endswith("layernorm.weight"):
            p.copy_(0.5 + torch.rand(p.shape, generator=g))
        elif name.endswith(".bias"):
            p.copy_(0.5 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(torch.randn(p.shape, generator=g) * (WEIGHT_GAIN / math.sqrt(p.shape[1])))
    rotary = rot_cls(hf_config)
    return attn, rotary


def state_dict(attn, prefix: str = PREFIX, dtype=None) -> dict:
    """The module's weights under their HF checkpoint names (``q_a_proj.weight`` ...)."""
    return {prefix + k: (v.detach().clone() if dtype is None else v.detach().to(dtype))
            for k, v in attn.state_dict().items()}


@torch.no_grad()
def round_weights(attn, dtype):
    """Round the module's weights through ``dtype`` in place (so that a bf16 layer and
    the float32 reference see the same numbers)."""
    for p in attn.parameters():
        p.copy_(p.to(dtype).to(p.dtype))
    return attn


def cast(attn, dtype):
    """A copy of the module in ``dtype`` (the rotary module stays as it is)."""
    return copy.deepcopy(attn).to(dtype)


@torch.no_grad()
def hf_reference(attn, rotary, hidden: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """HF attention over one whole sequence, batch 1, causal.

    hidden [n, D] in the module's dtype; positions [n] (default 0..n-1). Returns [n, D].
    """
    n = hidden.shape[0]
    if positions is None:
        positions = torch.arange(n)
    x = hidden.unsqueeze(0).to(next(attn.parameters()).dtype)
    pos = positions.view(1, n).long()
    pe = rotary(x, pos)
    mask = torch.full((n, n), torch.finfo(x.dtype).min, dtype=x.dtype).triu(1).view(1, 1, n, n)
    if isinstance(attn, DeepseekV2Attention):
        out, _ = attn(x, attention_mask=mask, position_embeddings=pe)
    else:
        out, _ = attn(x, position_embeddings=pe, attention_mask=mask)
    return out[0]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """norm(out - ref) / norm(ref), in float64."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


# ---------------------------------------------------------------------------------------
# The harness the layer and cache tests drive: our layer(s) + cache beside HF.


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}.self_attn."


class Harness:
    """Our layer(s) + cache, HF modules with the same weights, and each sequence's history.

    ``step(plan)`` runs one call (``plan`` = [(seq_id, n_new)], in the order given to
    ``prepare``) on fresh random hidden states for every layer and checks the output rows
    against HF over the full sequences. ``fork``/``truncate``/``release`` keep the
    history in step with the cache.
    """

    def __init__(self, variant, dtype=torch.float32, *, num_layers=1, block_size=4, num_blocks=64,
                 seed=0, source="object", max_workspace_tokens=None):
        self.hf_cfg = make_config(variant)
        self.cfg = mla.MLAConfig.from_hf(config_source(self.hf_cfg, source))
        self.dtype, self.num_layers = dtype, num_layers
        self.gen = torch.Generator().manual_seed(1000 + seed)
        self.attn, self.attn_lowp, self.layers = [], [], []
        for i in range(num_layers):
            attn, self.rotary = make_attention(self.hf_cfg, seed=seed * 7 + i, layer_idx=i)
            if dtype != torch.float32:
                round_weights(attn, dtype)
                self.attn_lowp.append(cast(attn, dtype))
            self.attn.append(attn)
            kw = {} if max_workspace_tokens is None else {"max_workspace_tokens": max_workspace_tokens}
            layer = mla.MLA(self.cfg, layer_idx=i, dtype=dtype, device="cpu", backend="torch", **kw)
            layer.load_hf_state_dict(state_dict(attn, prefix=layer_prefix(i), dtype=dtype), prefix=layer_prefix(i))
            self.layers.append(layer)
        self.cache = mla.PagedLatentCache(self.cfg, num_layers=num_layers, num_blocks=num_blocks,
                                          block_size=block_size, dtype=dtype, device="cpu")
        self.hist: dict = {}        # seq -> per layer, list of [n, D] float32 inputs
        self.outputs = []           # (ours, fp32 reference, HF low-precision or None) per step

    def length(self, seq) -> int:
        return sum(x.shape[0] for x in self.hist[seq][0]) if seq in self.hist else 0

    def new_inputs(self, n: int) -> torch.Tensor:
        x = torch.randn(n, self.cfg.hidden_size, generator=self.gen)
        return x.to(self.dtype).float()      # exactly representable in the layer's dtype

    @torch.no_grad()
    def step(self, plan, inputs=None):
        """Run one call; returns (ours [T, D] per layer, references [T, D] per layer)."""
        T = sum(n for _, n in plan)
        xs = inputs if inputs is not None else [self.new_inputs(T) for _ in range(self.num_layers)]
        batch = self.cache.prepare(plan)
        ours = []
        for layer, x in zip(self.layers, xs):
            out = layer(x.to(self.dtype), batch)
            assert out.shape == (T, self.cfg.hidden_size) and out.dtype == self.dtype
            ours.append(out.float())
        for seq, n in plan:
            self.hist.setdefault(seq, [[] for _ in range(self.num_layers)])
        refs, lowps = [], []
        for li in range(self.num_layers):
            off, rows, lrows = 0, [], []
            for seq, n in plan:
                self.hist[seq][li].append(xs[li][off:off + n])
                off += n
                full = torch.cat(self.hist[seq][li])
                rows.append(hf_reference(self.attn[li], self.rotary, full)[full.shape[0] - n:])
                if self.attn_lowp:
                    lp = hf_reference(self.attn_lowp[li], self.rotary, full.to(self.dtype))
                    lrows.append(lp[full.shape[0] - n:].float())
            refs.append(torch.cat(rows))
            lowps.append(torch.cat(lrows) if lrows else None)
        for seq, _ in plan:
            assert self.cache.length(seq) == self.length(seq)
        for li in range(self.num_layers):
            self.outputs.append((ours[li], refs[li], lowps[li]))
            if self.dtype == torch.float32:
                err = rel_err(ours[li], refs[li])
                assert err <= FP32_TOL, f"layer {li}, plan {plan}: relative error {err:.3g} > {FP32_TOL}"
        return ours, refs

    def fork(self, src, dst):
        self.cache.fork(src, dst)
        self.hist[dst] = [list(h) for h in self.hist[src]]
        assert self.cache.length(dst) == self.length(src)

    def truncate(self, seq, new_length):
        self.cache.truncate(seq, new_length)
        for li in range(self.num_layers):
            full = torch.cat(self.hist[seq][li]) if self.hist[seq][li] else torch.zeros(0, self.cfg.hidden_size)
            self.hist[seq][li] = [full[:new_length]]
        assert self.cache.length(seq) == new_length == self.length(seq)

    def release(self, seq):
        self.cache.release(seq)
        del self.hist[seq]

    def check_bf16(self):
        """Our bf16 error over all steps against 2x HF-bf16's error on the same rows."""
        if self.dtype != torch.float32:
            check_bf16_outputs(self.outputs, "bf16")




def check_bf16_outputs(outputs, what: str) -> None:
    """outputs: (ours, float64 reference, the HF module in bf16) per step; our error over all
    steps must be within 2x the module's own bf16 error (+ BF16_SLACK)."""
    ours = torch.cat([o.flatten() for o, _, _ in outputs])
    ref = torch.cat([r.flatten() for _, r, _ in outputs])
    hf = torch.cat([l.flatten() for _, _, l in outputs])
    err, hf_err = rel_err(ours, ref), rel_err(hf, ref)
    assert err <= 2 * hf_err + BF16_SLACK, f"{what}: bf16 error {err:.3g} vs the module's own bf16 error {hf_err:.3g}"
