"""Tiny random configs of every MLA family transformers ships, their own attention
modules as oracles, and a harness that drives ``mla`` beside them.

hf_util.py does this for DeepSeek-V2/V3; here the same approach is generalised to a
family table. A ``Case`` names a transformers config class, the family's attention
module and rotary embedding classes, the overrides that make a tiny config of it
(hidden 64, 3-4 heads, ranks 16-32, the family's published ratios where they matter),
the layer index the module is built for, and how the module's ``forward`` is called
(Mistral 4 needs ``position_ids`` for its query temperature; Kimi Linear's MLA has no
RoPE and takes no ``position_embeddings``).

The reference for any step is the family's module in float64 recomputed from scratch
over the whole sequence (batch 1, causal), taking the rows of the new tokens.
``FamilyHarness`` drives one ``mla.MLA`` layer and a ``mla.PagedLatentCache`` through
the public API only (``MLAConfig.from_hf``, ``MLA``, ``load_hf_state_dict``,
``prepare``, ``fork``, ``truncate``).
"""
from __future__ import annotations

import copy
import importlib
import math
from dataclasses import dataclass, field
from typing import Any

import torch

import mla
from hf_util import FP32_TOL, WEIGHT_GAIN, check_bf16_outputs, rel_err

_BASE = dict(hidden_size=64, num_attention_heads=4, q_lora_rank=24, kv_lora_rank=32,
             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=64,
             rms_norm_eps=1e-6, attention_bias=False, num_hidden_layers=2, vocab_size=32,
             pad_token_id=None, bos_token_id=None, eos_token_id=None)
_MOE = dict(n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1)


def _yarn(factor=4.0, orig=16, mscale=1.0, mscale_all_dim=1.0, theta=10000.0, **extra):
    d = {"rope_type": "yarn", "rope_theta": theta, "factor": factor, "original_max_position_embeddings": orig,
         "beta_fast": 32.0, "beta_slow": 1.0, **extra}
    if mscale is not None:
        d["mscale"] = mscale
    if mscale_all_dim is not None:
        d["mscale_all_dim"] = mscale_all_dim
    return d


def _default(theta=10000.0, **extra):
    return {"rope_type": "default", "rope_theta": theta, **extra}


def _cls(module: str, name: str):
    """A class of transformers.models.<module>: configs from configuration_<module>, the rest
    from modeling_<module>."""
    kind = "configuration" if name.endswith("Config") else "modeling"
    return getattr(importlib.import_module(f"transformers.models.{module}.{kind}_{module}"), name)


@dataclass(frozen=True)
class Case:
    """One family (or one variant of a family) and how to build and call its module."""
    family: str                      # transformers model_type
    module: str                      # transformers.models.<module>
    config_cls: str
    attention_cls: str
    rotary_cls: str | None           # None: the module takes no position_embeddings (NoPE)
    overrides: dict = field(default_factory=dict)
    layer_idx: int = 0
    prefix: str = "model.layers.0.self_attn."
    needs_position_ids: bool = False  # Mistral 4's query temperature reads position_ids
    padding_mask: bool = False        # the module takes a [B, S] bool padding mask (GLM-5.3-Flash's indexer)

    def make_config(self, **more):
        """The tiny transformers config: _BASE, then the case's overrides, then ``more``."""
        kw = dict(_BASE)
        kw.update(copy.deepcopy(self.overrides))
        if "model_max_length" in kw:       # Kimi Linear's name for max_position_embeddings
            kw.pop("max_position_embeddings", None)
        kw.update(more)
        kw.setdefault("num_key_value_heads", kw.get("num_attention_heads"))
        cfg = _cls(self.module, self.config_cls)(**kw)
        cfg._attn_implementation = "eager"
        return cfg


# The families mla serves exactly. Sequences stay below 40 tokens; max_position_embeddings 64.
EXACT = {
    # DeepSeek-V2: complex (= interleaved) RoPE, YaRN with mscale == mscale_all_dim.
    "deepseek_v2": Case("deepseek_v2", "deepseek_v2", "DeepseekV2Config", "DeepseekV2Attention",
                        "DeepseekV2RotaryEmbedding",
                        dict(rope_parameters=_yarn(orig=16, mscale=0.707, mscale_all_dim=0.707), **_MOE)),
    # DeepSeek-V3: YaRN, interleaved pairs.
    "deepseek_v3": Case("deepseek_v3", "deepseek_v3", "DeepseekV3Config", "DeepseekV3Attention",
                        "DeepseekV3RotaryEmbedding",
                        dict(rope_parameters=_yarn(orig=16), rope_interleave=True, **_MOE)),
    # A.X-K1: DeepSeek-V3's attention under its own model_type.
    "axk1": Case("axk1", "axk1", "AXK1Config", "AXK1Attention", "AXK1RotaryEmbedding",
                 dict(rope_parameters=_yarn(orig=16), rope_interleave=True, num_attention_heads=3)),
    # Youtu: DeepSeek-V3's attention, plain RoPE.
    "youtu": Case("youtu", "youtu", "YoutuConfig", "YoutuAttention", "YoutuRotaryEmbedding",
                  dict(rope_parameters=_default(), rope_interleave=True)),
    # GLM-4.7-Flash: nope 192, rope 64, v 256 (3:1:4), kv_lora 512, q_lora 768: dn 24, dr 8, dv 32.
    "glm4_moe_lite": Case("glm4_moe_lite", "glm4_moe_lite", "Glm4MoeLiteConfig", "Glm4MoeLiteAttention",
                          "Glm4MoeLiteRotaryEmbedding",
                          dict(qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=32, kv_lora_rank=32,
                               q_lora_rank=24, num_attention_heads=3, rope_parameters=_default(),
                               rope_interleave=True)),
    # Mistral 4: query temperature 1 + beta * log(1 + floor(p / orig)), orig 8 so the scale changes
    # within a 20-token prompt; kv_lora 256 of 4096 -> 16 of 64 (smaller than q_lora).
    "mistral4": Case("mistral4", "mistral4", "Mistral4Config", "Mistral4Attention", "Mistral4RotaryEmbedding",
                     dict(kv_lora_rank=16, q_lora_rank=32,
                          rope_parameters=_yarn(factor=8.0, orig=8, llama_4_scaling_beta=0.1),
                          rope_interleave=True, **_MOE),
                     needs_position_ids=True),
    # Mistral 4 with neox pairs (rope_interleave False) and another beta. (A default-RoPE Mistral 4 is
    # not testable: transformers' Mistral4RotaryEmbedding then rotates head_dim = dn + dr values.)
    "mistral4_neox": Case("mistral4", "mistral4", "Mistral4Config", "Mistral4Attention", "Mistral4RotaryEmbedding",
                          dict(kv_lora_rank=16, q_lora_rank=32, num_attention_heads=3,
                               rope_parameters=_yarn(factor=8.0, orig=8, mscale=0.707, mscale_all_dim=1.0,
                                                     llama_4_scaling_beta=0.3),
                               rope_interleave=False, **_MOE),
                          needs_position_ids=True),
    # LongCat-Flash: q scaled by sqrt(hidden / q_lora_rank), c_kv by sqrt(hidden / kv_lora_rank);
    # always interleaved RoPE; two MLA modules per decoder layer (self_attn.0 / self_attn.1).
    "longcat_flash": Case("longcat_flash", "longcat_flash", "LongcatFlashConfig", "LongcatFlashMLA",
                          "LongcatFlashRotaryEmbedding",
                          dict(q_lora_rank=16, kv_lora_rank=32, head_dim=8, num_layers=1,
                               rope_parameters=_default(theta=10000.0), n_routed_experts=4, moe_topk=2,
                               zero_expert_num=2, ffn_hidden_size=32, expert_ffn_hidden_size=16),
                          layer_idx=1, prefix="model.layers.0.self_attn.1."),
    # MiniCPM3: neox RoPE (rotate_half) and no rope_interleave key.
    "minicpm3": Case("minicpm3", "minicpm3", "MiniCPM3Config", "MiniCPM3Attention", "MiniCPM3RotaryEmbedding",
                     dict(rope_parameters=_default(), intermediate_size=32)),
    "minicpm3_yarn": Case("minicpm3", "minicpm3", "MiniCPM3Config", "MiniCPM3Attention",
                          "MiniCPM3RotaryEmbedding",
                          dict(rope_parameters=_yarn(orig=16, mscale=0.707, mscale_all_dim=1.0),
                               intermediate_size=32)),
    # Kimi Linear: NoPE MLA (the rope part of q and k used unrotated), q_proj (no q_lora), context
    # length in model_max_length; MLA only in the "full_attention" layers (here 1 and 3).
    "kimi_linear": Case("kimi_linear", "kimi_linear", "KimiLinearConfig", "KimiLinearAttention", None,
                        dict(q_lora_rank=None, num_attention_heads=3, num_hidden_layers=4, model_max_length=64,
                             layer_types=["linear_attention", "full_attention", "linear_attention",
                                          "full_attention"],
                             linear_head_dim=16, linear_num_heads=4, num_local_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=32),
                        layer_idx=3, prefix="model.layers.3.self_attn."),
}


# Sparse MLA (DeepSeek Sparse Attention): exact past index_topk (tests/test_sparse.py). index_topk 8
# under prompts of up to 40 tokens; 8 indexer heads, so that a key scores exactly 0 (every head's
# relu 0) rarely enough that the top-k boundary never falls on a tie at these seeds.
_DSA = dict(index_topk=8, index_n_heads=8, index_head_dim=16, head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
            first_k_dense_replace=1)
SPARSE = {
    # DeepSeek-V3.2: neox pairs in the indexer, interleaved in the attention; YaRN with a cos/sin scale
    "deepseek_v32": Case("deepseek_v32", "deepseek_v32", "DeepseekV32Config", "DeepseekV32Attention",
                         "DeepseekV32RotaryEmbedding",
                         dict(rope_parameters=_yarn(orig=16, mscale=0.707, mscale_all_dim=1.0), n_group=1,
                              topk_group=1, **_DSA)),
    # GLM-5: interleaved pairs in the indexer too; 3 heads, v_head_dim != qk_nope_head_dim
    "glm_moe_dsa": Case("glm_moe_dsa", "glm_moe_dsa", "GlmMoeDsaConfig", "GlmMoeDsaAttention",
                        "GlmMoeDsaRotaryEmbedding",
                        dict(rope_parameters=_default(), num_attention_heads=3, v_head_dim=24, **_DSA)),
    # Hy4: neox pairs in the attention and the indexer, whose RoPE is on the last dr values; the
    # indexer's key norm eps is rms_norm_eps (1e-5 here); a sink logit per head; a sigmoid gate
    "hy_v4": Case("hy_v4", "hy_v4", "HYV4Config", "HYV4Attention", "HYV4RotaryEmbedding",
                  dict(rope_parameters=_default(), rms_norm_eps=1e-5, index_topk=8, index_n_heads=8,
                       index_head_dim=16, n_routed_experts=4, num_experts_per_tok=2)),
    # A.X-K2: DeepSeek-V3.2's attention and indexer with q_gate_proj over cat(norm(q_a), q_a) for the
    # query and a sigmoid output gate; 3 heads, v_head_dim != qk_nope_head_dim, YaRN
    "axk2": Case("axk2", "axk2", "AXK2Config", "AXK2Attention", "AXK2RotaryEmbedding",
                 dict(rope_parameters=_yarn(orig=16, mscale=0.707, mscale_all_dim=1.0), num_attention_heads=3,
                      v_head_dim=24, **_DSA)),
}


# GLM-5.3-Flash: MLA without RoPE (qk_rope_head_dim 0), both latent norms at rms_norm_eps (1e-5), the
# k-pool indexer: pools of 4 tokens, index_topk 8 (two pools, plus the open pool's up to 3 tokens: 11
# keys at most); 3 heads, v_head_dim != qk_nope_head_dim. Layer 0 is linear attention, 1 and 2 MLA, 2
# reusing 1's top-k.
KPOOL = {
    "glm5_next_text": Case("glm5_next_text", "glm5_next", "Glm5NextTextConfig", "Glm5NextTextAttention", None,
                           dict(qk_rope_head_dim=0, head_dim=0, num_attention_heads=3, v_head_dim=24,
                                rms_norm_eps=1e-5, index_topk=8, index_kpool=4, index_n_heads=8, index_head_dim=16,
                                n_routed_experts=4, num_experts_per_tok=2, linear_head_dim=16, linear_num_heads=4,
                                num_hidden_layers=3,
                                layer_types=["linear_attention", "deepseek_sparse_attention",
                                             "deepseek_sparse_attention"],
                                indexer_types=["full", "full", "shared"]),
                           layer_idx=1, prefix="model.layers.1.self_attn.", padding_mask=True),
}


def find_case(name: str) -> Case:
    for table in (EXACT, SPARSE, KPOOL):
        if name in table:
            return table[name]
    raise KeyError(name)


def attention_class(case: Case):
    return _cls(case.module, case.attention_cls)


@torch.no_grad()
def make_attention(case: Case, hf_config, seed: int):
    """(attention module in float32 with unit-scale random weights, rotary module or None)."""
    g = torch.Generator().manual_seed(seed)
    attn = attention_class(case)(hf_config, case.layer_idx).float().eval()
    for name, p in attn.named_parameters():
        if name.endswith("layernorm.weight") or (name.endswith("norm.weight") and p.dim() == 1):
            p.copy_(0.5 + torch.rand(p.shape, generator=g))
        elif name.endswith(".bias"):
            p.copy_(0.5 * torch.randn(p.shape, generator=g))
        elif name == "sinks":          # Hy4: logits of the size of the scores', so that they matter
            p.copy_(1.0 + 2.0 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(torch.randn(p.shape, generator=g) * (WEIGHT_GAIN / math.sqrt(p.shape[1])))
    rotary = _cls(case.module, case.rotary_cls)(hf_config) if case.rotary_cls else None
    return attn, rotary


def state_dict(attn, prefix: str, dtype=None) -> dict:
    """The module's own state dict under ``prefix``."""
    return {prefix + k: (v.detach().clone() if dtype is None else v.detach().to(dtype))
            for k, v in attn.state_dict().items()}


@torch.no_grad()
def run_module(case: Case, attn, rotary, hidden: torch.Tensor, **extra):
    """The family's module over one whole sequence (batch 1, causal): hidden [n, D] -> its
    outputs (the attention output [1, n, D] first; the sparse families' top-k last), ``extra``
    passed on (a shared layer's ``prev_topk_indices``)."""
    n = hidden.shape[0]
    dtype = next(attn.parameters()).dtype
    x = hidden.unsqueeze(0).to(dtype)
    pos = torch.arange(n).view(1, n)
    mask = torch.full((n, n), torch.finfo(dtype).min, dtype=dtype).triu(1).view(1, 1, n, n)
    if case.padding_mask:      # its indexer builds the (sparse, causal) mask from this one
        mask = torch.ones(1, n, dtype=torch.bool)
    kw: dict[str, Any] = {"attention_mask": mask, **extra}
    if rotary is not None:
        kw["position_embeddings"] = rotary(x, pos)
    if case.needs_position_ids:
        kw["position_ids"] = pos
    return attn(x, **kw)


def reference(case: Case, attn, rotary, hidden: torch.Tensor) -> torch.Tensor:
    """The family's module over one whole sequence (batch 1, causal): hidden [n, D] -> [n, D]."""
    return run_module(case, attn, rotary, hidden)[0][0]


@torch.no_grad()
def check_shared_layer(case_name: str, hf_cfg, layers=(0, 1), seed: int = 10, steps=(30, 1, 3)) -> None:
    """A "shared" indexer layer (GLM-5's indexer_types): ``layers`` = (a layer with its own
    indexer, the shared layer after it) of one model on one batch a step, against the family's
    two modules, the second fed the first's top-k (prev_topk_indices); each float32 within
    FP32_TOL of the float64 modules. Before the first runs, the second refuses the batch."""
    case = find_case(case_name)
    cfg = mla.MLAConfig.from_hf(hf_cfg)
    assert cfg.index_shared_layers == (layers[1],) and cfg.index_source_layer(layers[1]) == layers[0]
    mods, ours = [], []
    for i in layers:
        attn, rotary = make_attention(Case(**{**case.__dict__, "layer_idx": i}), hf_cfg, seed=seed + i)
        prefix = f"model.layers.{i}.self_attn."
        layer = mla.MLA(cfg, layer_idx=i, dtype=torch.float32, backend="torch")
        layer.load_hf_state_dict(state_dict(attn, prefix), prefix=prefix)
        mods.append(attn.double())
        ours.append(layer)
    assert isinstance(mods[1], attention_class(case)) and mods[1].indexer is None and not ours[1].has_own_indexer
    cache = mla.PagedLatentCache(cfg, num_layers=layers[1] + 1, num_blocks=32, block_size=4, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    hist = torch.zeros(0, cfg.hidden_size, dtype=torch.float64)
    for n in steps:
        x = torch.randn(n, cfg.hidden_size, generator=g)
        batch = cache.prepare([(0, n)])
        try:
            ours[1](x, batch)
            raise AssertionError("the shared layer ran before the layer whose top-k it reuses")
        except ValueError as e:
            assert f"run layer {layers[0]}" in str(e)
        outs = [ours[0](x, batch), ours[1](x, batch)]
        hist = torch.cat([hist, x.double()])
        o0, _, topk = run_module(case, mods[0], rotary, hist)
        o1 = run_module(case, mods[1], rotary, hist, prev_topk_indices=topk)[0]
        for o, ref in zip(outs, (o0, o1)):
            assert rel_err(o, ref[0, -n:]) <= FP32_TOL


def config_source(hf_config, source: str):
    """What a user hands to from_hf: the config object, its to_dict(), or ("legacy") a
    config.json in the pre-transformers-5 layout (rope_theta + rope_scaling with "type")."""
    if source == "object":
        return hf_config
    d = hf_config.to_dict()
    if source == "dict":
        return d
    if source == "legacy":
        rp = dict(d.pop("rope_parameters", None) or {})
        d["rope_theta"] = rp.pop("rope_theta", 10000.0)
        rope_type = rp.pop("rope_type", "default")
        if rope_type != "default":
            d["rope_scaling"] = {"type": rope_type, **rp}
        return d
    raise ValueError(f"source: expected 'object', 'dict' or 'legacy', got {source!r}")


class FamilyHarness:
    """One ``mla.MLA`` layer + cache beside the family's module with the same weights.

    ``step(plan)`` runs one call on fresh random hidden states and checks the new rows
    against the float64 module over each whole sequence (float32 layers: per step,
    relative error <= FP32_TOL). ``check_bf16`` compares a bf16 layer's error over all
    steps with 2x that of the module run in bf16, plus BF16_SLACK.
    """

    def __init__(self, case_name: str, dtype=torch.float32, *, block_size=4, num_blocks=64, seed=0,
                 source="object", max_workspace_tokens=None, config_overrides=None, strategy=None):
        self.case = case = find_case(case_name)
        self.hf_cfg = case.make_config(**(config_overrides or {}))
        self.cfg = mla.MLAConfig.from_hf(config_source(self.hf_cfg, source))
        self.dtype = dtype
        self.gen = torch.Generator().manual_seed(1000 + seed)
        attn, self.rotary = make_attention(case, self.hf_cfg, seed)
        if dtype != torch.float32:
            with torch.no_grad():
                for p in attn.parameters():
                    p.copy_(p.to(dtype).to(p.dtype))
            self.attn_lowp = copy.deepcopy(attn).to(dtype)
        else:
            self.attn_lowp = None
        self.attn_ref = copy.deepcopy(attn).to(torch.float64)
        kw = {"strategy": strategy}
        if max_workspace_tokens is not None:
            kw["max_workspace_tokens"] = max_workspace_tokens
        self.layer = mla.MLA(self.cfg, layer_idx=case.layer_idx, dtype=dtype, device="cpu", backend="torch", **kw)
        self.layer.load_hf_state_dict(state_dict(attn, case.prefix, dtype), prefix=case.prefix)
        self.cache = mla.PagedLatentCache(self.cfg, num_layers=case.layer_idx + 1, num_blocks=num_blocks,
                                          block_size=block_size, dtype=dtype, device="cpu")
        self.hist: dict = {}          # seq -> [n, D] float32 inputs so far
        self.outputs = []             # (ours, float64 reference, module in low precision or None)
        self.errors = []              # per step relative error

    def length(self, seq) -> int:
        return self.hist[seq].shape[0] if seq in self.hist else 0

    def new_inputs(self, n: int) -> torch.Tensor:
        x = torch.randn(n, self.cfg.hidden_size, generator=self.gen)
        return x.to(self.dtype).float()

    @torch.no_grad()
    def step(self, plan, x=None, on_batch=None):
        """``on_batch(batch)``, where given, sees the step's batch before the layer runs."""
        T = sum(n for _, n in plan)
        x = self.new_inputs(T) if x is None else x
        batch = self.cache.prepare(plan)
        if on_batch is not None:
            on_batch(batch)
        out = self.layer(x.to(self.dtype), batch)
        assert out.shape == (T, self.cfg.hidden_size) and out.dtype == self.dtype
        ours = out.float()
        rows, lrows, off = [], [], 0
        for seq, n in plan:
            full = torch.cat([self.hist.get(seq, x[:0]), x[off:off + n]])
            self.hist[seq] = full
            off += n
            rows.append(reference(self.case, self.attn_ref, self.rotary, full.double())[-n:])
            if self.attn_lowp is not None:
                lrows.append(reference(self.case, self.attn_lowp, self.rotary, full.to(self.dtype))[-n:].float())
            assert self.cache.length(seq) == full.shape[0]
        ref = torch.cat(rows)
        lowp = torch.cat(lrows) if lrows else None
        self.outputs.append((ours, ref, lowp))
        err = rel_err(ours, ref)
        self.errors.append(err)
        if self.dtype == torch.float32:
            assert err <= FP32_TOL, f"{self.case_name_for_msg()}: plan {plan}: relative error {err:.3g} > {FP32_TOL}"
        return ours, ref

    def case_name_for_msg(self) -> str:
        return f"{self.case.family} ({self.case.attention_cls}, layer {self.case.layer_idx})"

    def fork(self, src, dst):
        self.cache.fork(src, dst)
        self.hist[dst] = self.hist[src].clone()
        assert self.cache.length(dst) == self.length(src)

    def truncate(self, seq, new_length):
        self.cache.truncate(seq, new_length)
        self.hist[seq] = self.hist[seq][:new_length]
        assert self.cache.length(seq) == new_length

    def check_bf16(self):
        if self.dtype != torch.float32:
            check_bf16_outputs(self.outputs, self.case_name_for_msg())


# ---------------------------------------------------------------------------------------
# Families from_hf must refuse: (config class module, class, tiny overrides, words of which the
# NotImplementedError message must name at least one, besides the model_type).

REFUSED = {
    "deepseek_v4": ("deepseek_v4", "DeepseekV4Config",
                    dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=16, q_lora_rank=24,
                         num_hidden_layers=2, vocab_size=32, n_routed_experts=4, num_experts_per_tok=2,
                         o_lora_rank=16, o_groups=2, index_n_heads=2, index_head_dim=16, index_topk=8),
                    ("not mla", "not an mla", "compressed", "sliding")),
}


def make_refused_config(name: str, minimal: bool = False):
    """A tiny config of a refused family (``minimal``: the class defaults, nothing overridden)."""
    module, cls_name, overrides, _ = REFUSED[name]
    cls = _cls(module, cls_name)
    return cls() if minimal else cls(**overrides)
