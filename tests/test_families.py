"""Every MLA family transformers ships: exact against the family's own attention module,
or refused by name; and load_hf_state_dict never ignores a tensor silently.

The oracle for each family is its own attention class in transformers (e.g.
``Mistral4Attention`` with ``Mistral4RotaryEmbedding``) on a tiny random config of its own
config class (tests/hf_families.py), run in float64 over each whole sequence from scratch.
Our side goes only through the public API. Tolerances as in test_layer_hf.py: float32
relative error <= FP32_TOL per step; bfloat16 within 2x the module's own bf16 error plus
BF16_SLACK.
"""
from __future__ import annotations

import copy

import pytest
import torch

import hf_families as F
import mla
from hf_util import FP32_TOL, rel_err

EXACT = list(F.EXACT)
DTYPES = [torch.float32, torch.bfloat16]


def _hf_max_positions(hf_cfg) -> int:
    d = hf_cfg.to_dict()
    return d.get("max_position_embeddings") or d["model_max_length"]


# ---------------------------------------------------------------------------------------
# from_hf reads each family


@pytest.mark.parametrize("source", ["object", "dict"])
@pytest.mark.parametrize("case", EXACT)
def test_from_hf_attributes(case, source):
    c = F.EXACT[case]
    hf_cfg = c.make_config()
    cfg = mla.MLAConfig.from_hf(F.config_source(hf_cfg, source))
    assert cfg.hidden_size == hf_cfg.hidden_size
    assert cfg.num_heads == hf_cfg.num_attention_heads
    assert cfg.q_lora_rank == hf_cfg.q_lora_rank
    assert cfg.kv_lora_rank == hf_cfg.kv_lora_rank
    assert cfg.qk_nope_head_dim == hf_cfg.qk_nope_head_dim
    assert cfg.qk_rope_head_dim == hf_cfg.qk_rope_head_dim
    assert cfg.v_head_dim == hf_cfg.v_head_dim
    assert cfg.max_position_embeddings == _hf_max_positions(hf_cfg)
    attn, _ = F.make_attention(c, hf_cfg, seed=0)
    assert cfg.softmax_scale == pytest.approx(attn.scaling, rel=1e-12)


@pytest.mark.parametrize("source", ["dict", "legacy"])
@pytest.mark.parametrize("case", EXACT)
def test_from_hf_sources_agree(case, source):
    """The config object, its to_dict() and the pre-transformers-5 config.json layout
    (rope_theta + rope_scaling) give one MLAConfig."""
    hf_cfg = F.EXACT[case].make_config()
    assert mla.MLAConfig.from_hf(hf_cfg) == mla.MLAConfig.from_hf(F.config_source(hf_cfg, source))


# ---------------------------------------------------------------------------------------
# Each family exact through a serving trace


@pytest.mark.parametrize("case", EXACT)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_prompt_then_decode(case, dtype):
    """(a) a 20-token prompt, (b) 3 decode steps."""
    h = F.FamilyHarness(case, dtype, seed=1)
    h.step([(0, 20)])
    for _ in range(3):
        h.step([(0, 1)])
    h.check_bf16()


@pytest.mark.parametrize("case", EXACT)
def test_speculative_verify_truncate(case):
    """(c) s_q = 3 new tokens (draft verify), rejected ones truncated, decoding goes on."""
    h = F.FamilyHarness(case, torch.float32, seed=2)
    h.step([(0, 20)])
    h.step([(0, 3)])
    h.truncate(0, 21)            # one draft accepted
    h.step([(0, 1)])
    h.step([(0, 3)])
    h.truncate(0, 22)            # none accepted: back across a block boundary (block_size 4)
    h.step([(0, 1)])


# (workspace, forced strategy) -> the path the 8-token chunk over a 12-token prefix takes.
# Left to the rule, 8 new tokens over a cached prefix take the absorbed path at these dims
# (absorb_max_new is 32 or more), so the context paths are pinned with MLA(strategy=...).
PATHS = {"chunked": (8, "chunked"), "cached": (65536, "cached"), "absorbed": (8, "absorbed")}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("case", EXACT)
def test_prefix_then_chunk(case, path):
    """(d) a prompt prefilled as 12 then 8 tokens: under max_workspace_tokens=8 the second
    chunk's cached prefix exceeds the workspace (the chunked path, prefix chunks merged by LSE);
    the same through the cached and the absorbed paths; then a decode and a mixed step."""
    workspace, force = PATHS[path]
    h = F.FamilyHarness(case, torch.float32, seed=3, max_workspace_tokens=workspace, strategy=force)
    h.step([(0, 12)])

    def pinned(batch):
        assert h.layer.plan(batch).strategy == [path]

    h.step([(0, 8)], on_batch=pinned)
    h.step([(0, 1)])
    h.step([(1, 12), (0, 3)])


@pytest.mark.parametrize("case", EXACT)
def test_fork_divergent_decode(case):
    """(e) cache.fork of a prompt into a second sequence that then decodes differently."""
    h = F.FamilyHarness(case, torch.float32, seed=4)
    h.step([(0, 18)])            # a partial last block (2 of 4): copy-on-write when both write
    h.fork(0, 1)
    h.step([(0, 1), (1, 1)])
    h.step([(1, 3), (0, 1)])
    h.step([(0, 1), (1, 1)])


def test_longcat_two_sublayers_from_one_decoder_layer():
    """LongCat-Flash's decoder layer holds two MLA modules (self_attn.0, self_attn.1): each loads
    from the layer's whole state dict under its own prefix, the other's tensors untouched."""
    c = F.EXACT["longcat_flash"]
    hf_cfg = c.make_config()
    cfg = mla.MLAConfig.from_hf(hf_cfg)
    mods = [F.make_attention(c, hf_cfg, seed=20 + i) for i in range(2)]
    sd = {}
    for i, (attn, _) in enumerate(mods):
        sd.update(F.state_dict(attn, f"model.layers.0.self_attn.{i}."))
    sd["model.layers.0.mlps.0.gate_proj.weight"] = torch.zeros(4, 64)
    layers = []
    for i in range(2):
        layer = mla.MLA(cfg, layer_idx=i, dtype=torch.float32, device="cpu", backend="torch")
        layer.load_hf_state_dict(sd, prefix=f"model.layers.0.self_attn.{i}.")
        layers.append(layer)
    refs = [(attn.double(), rot) for attn, rot in mods]     # after the state dict was taken
    cache = mla.PagedLatentCache(cfg, num_layers=2, num_blocks=32, block_size=4, dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(5)
    hist = [torch.zeros(0, 64) for _ in range(2)]
    for n in (20, 1, 3):
        batch = cache.prepare([(0, n)])
        for i, layer in enumerate(layers):
            x = torch.randn(n, 64, generator=g)
            hist[i] = torch.cat([hist[i], x])
            ref = F.reference(c, *refs[i], hist[i].double())[-n:]
            with torch.no_grad():
                out = layer(x, batch)
            assert rel_err(out, ref) <= FP32_TOL, f"self_attn.{i}, step of {n}"


# ---------------------------------------------------------------------------------------
# Kimi Linear: MLA in the full_attention layers only; context length in model_max_length


def test_kimi_linear_layer_types():
    c = F.EXACT["kimi_linear"]
    hf_cfg = c.make_config()
    for source in ("object", "dict"):
        cfg = mla.MLAConfig.from_hf(F.config_source(hf_cfg, source))
        for i, kind in enumerate(hf_cfg.layer_types):
            if kind == "full_attention":
                mla.MLA(cfg, layer_idx=i, dtype=torch.float32, device="cpu", backend="torch")
            else:
                with pytest.raises(ValueError, match="layer_idx"):
                    mla.MLA(cfg, layer_idx=i, dtype=torch.float32, device="cpu", backend="torch")


@pytest.mark.parametrize("source", ["object", "dict"])
def test_kimi_linear_context_length(source):
    """model_max_length (its max_position_embeddings) bounds the positions, not a default."""
    hf_cfg = F.EXACT["kimi_linear"].make_config(model_max_length=40)
    cfg = mla.MLAConfig.from_hf(F.config_source(hf_cfg, source))
    assert cfg.max_position_embeddings == 40
    cache = mla.PagedLatentCache(cfg, num_layers=4, num_blocks=32, block_size=4, dtype=torch.float32, device="cpu")
    cache.prepare([(0, 40)])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        cache.prepare([(0, 1)])


def _kimi_published_json(hf_cfg) -> dict:
    """Kimi-Linear's config.json as published: the layers in linear_attn_config (1-indexed
    full_attn_layers / kda_layers), no layer_types key."""
    d = hf_cfg.to_dict()
    types = d.pop("layer_types")
    d["linear_attn_config"] = {
        "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"],
        "kda_layers": [i + 1 for i, t in enumerate(types) if t == "linear_attention"],
        "head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4}
    return d


def test_kimi_linear_published_config_json():
    """The published config.json names the MLA layers only in linear_attn_config: the KDA layers
    must still be refused (transformers reads linear_attn_config into the same layer_types)."""
    hf_cfg = F.EXACT["kimi_linear"].make_config()
    d = _kimi_published_json(hf_cfg)
    assert F._cls("kimi_linear", "KimiLinearConfig")(**d).layer_types == hf_cfg.layer_types
    cfg = mla.MLAConfig.from_hf(d)
    for i, kind in enumerate(hf_cfg.layer_types):
        if kind == "full_attention":
            mla.MLA(cfg, layer_idx=i, dtype=torch.float32, device="cpu", backend="torch")
        else:
            with pytest.raises(ValueError, match="layer_idx"):
                mla.MLA(cfg, layer_idx=i, dtype=torch.float32, device="cpu", backend="torch")


def test_kimi_linear_without_layer_info_is_not_all_mla():
    """With neither layer_types nor linear_attn_config, transformers makes every layer i with
    i % 4 == 0 and i > 0 full attention and the rest KDA: from_hf must not serve layer 0 as MLA
    (it may refuse the config instead)."""
    hf_cfg = F.EXACT["kimi_linear"].make_config(layer_types=None, num_hidden_layers=5)
    assert hf_cfg.layer_types == ["linear_attention"] * 4 + ["full_attention"]
    d = hf_cfg.to_dict()
    d.pop("layer_types")
    try:
        cfg = mla.MLAConfig.from_hf(d)
    except (NotImplementedError, ValueError):
        return
    with pytest.raises(ValueError, match="layer_idx"):
        mla.MLA(cfg, layer_idx=0, dtype=torch.float32, device="cpu", backend="torch")


# ---------------------------------------------------------------------------------------
# Keys a family's module does not read: exact (as the module) or refused, never half-read

STRAY = {
    # DeepseekV3Attention has no query temperature: llama_4_scaling_beta is inert there.
    "deepseek_v3+llama_4_scaling_beta": ("deepseek_v3", dict(rope_parameters=F._yarn(
        orig=16, llama_4_scaling_beta=0.5))),
    # MiniCPM3Attention always rotates neox halves, whatever rope_interleave says.
    "minicpm3+rope_interleave": ("minicpm3", dict(rope_interleave=True)),
    # LongcatFlashMLA always rotates interleaved pairs.
    "longcat_flash+rope_interleave_false": ("longcat_flash", dict(rope_interleave=False)),
    # DeepseekV2Attention always rotates complex (interleaved) pairs.
    "deepseek_v2+rope_interleave_false": ("deepseek_v2", dict(rope_interleave=False)),
    # KimiLinearAttention has no RoPE: a rope_parameters entry changes nothing.
    "kimi_linear+yarn": ("kimi_linear", dict(rope_parameters=F._yarn(orig=16))),
}


@pytest.mark.parametrize("source", ["object", "dict"])
@pytest.mark.parametrize("stray", list(STRAY))
def test_inert_key_exact_or_refused(stray, source):
    case, overrides = STRAY[stray]
    try:
        h = F.FamilyHarness(case, torch.float32, seed=6, source=source, config_overrides=overrides)
    except NotImplementedError as e:
        assert F.EXACT[case].family in str(e)
        return
    h.step([(0, 20)])
    h.step([(0, 1)])
    h.step([(0, 3)])


# ---------------------------------------------------------------------------------------
# Refused at from_hf, by name


@pytest.mark.parametrize("minimal", [False, True], ids=["tiny", "defaults"])
@pytest.mark.parametrize("source", ["object", "dict"])
@pytest.mark.parametrize("name", list(F.REFUSED))
def test_refused_family(name, source, minimal):
    hf_cfg = F.make_refused_config(name, minimal)
    model_type = hf_cfg.model_type
    with pytest.raises(NotImplementedError) as e:
        mla.MLAConfig.from_hf(F.config_source(hf_cfg, source))
    msg = str(e.value)
    assert model_type in msg, f"the message does not name model_type {model_type!r}: {msg}"
    words = F.REFUSED[name][3]
    assert any(w in msg.lower() for w in words), f"the message names none of {words}: {msg}"


def _minicpm3_longrope():
    half = F.EXACT["minicpm3"].make_config().qk_rope_head_dim // 2
    return F.EXACT["minicpm3"].make_config(rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
        "short_factor": [1.0 + 0.1 * i for i in range(half)], "long_factor": [2.0 + 0.5 * i for i in range(half)]})


@pytest.mark.parametrize("source", ["object", "dict", "legacy"])
def test_minicpm3_longrope_read(source):
    """MiniCPM3's LongRoPE is read from every config layout (the layer against the module:
    test_longrope.py); another family's LongRoPE is refused by name."""
    hf_cfg = _minicpm3_longrope()
    cfg = mla.MLAConfig.from_hf(F.config_source(hf_cfg, source))
    rp = hf_cfg.rope_parameters
    assert cfg.rope_type == "longrope" and cfg.longrope.original_max_position_embeddings == 16
    assert cfg.longrope.short_factor == tuple(rp["short_factor"])
    assert cfg.longrope.long_factor == tuple(rp["long_factor"])
    v3 = F.EXACT["deepseek_v3"].make_config(rope_parameters=dict(rp, factor=4.0))
    with pytest.raises(NotImplementedError, match="longrope") as e:
        mla.MLAConfig.from_hf(F.config_source(v3, source))
    assert "deepseek_v3" in str(e.value)


@pytest.mark.parametrize("rope_type", ["dynamic", "linear"])
def test_unknown_rope_type_refused(rope_type):
    """A RoPE type the library does not implement is refused by name, not read as the default."""
    hf_cfg = F.EXACT["deepseek_v3"].make_config(rope_parameters={"rope_type": rope_type, "rope_theta": 10000.0,
                                                                 "factor": 2.0})
    for source in ("object", "dict"):
        with pytest.raises(NotImplementedError, match=rope_type) as e:
            mla.MLAConfig.from_hf(F.config_source(hf_cfg, source))
        assert "deepseek_v3" in str(e.value)


@pytest.mark.parametrize("key,value", [("index_topk", 8), ("index_n_heads", 2)])
def test_indexer_keys_refused_under_any_model_type(key, value):
    """A DeepSeek-V3 config.json carrying a sparse indexer's keys is DeepSeek-V3.2's attention."""
    d = F.EXACT["deepseek_v3"].make_config().to_dict()
    d[key] = value
    with pytest.raises(NotImplementedError, match=key):
        mla.MLAConfig.from_hf(d)


# ---------------------------------------------------------------------------------------
# load_hf_state_dict: every tensor under the prefix is used, or refused by name

STRICT_CASES = ["deepseek_v3", "kimi_linear", "longcat_flash"]
EXTRAS = ["indexer.wk.weight", "indexer.k_norm.weight", "gate_proj.weight", "q_gate_proj.weight", "sinks",
          "kv_b_proj.bias"]


def _layer_and_weights(case, seed=0):
    c = F.EXACT[case]
    hf_cfg = c.make_config()
    cfg = mla.MLAConfig.from_hf(hf_cfg)
    layer = mla.MLA(cfg, layer_idx=c.layer_idx, dtype=torch.float32, device="cpu", backend="torch")
    attn, rot = F.make_attention(c, hf_cfg, seed)
    return c, cfg, layer, attn, rot


def _snapshot(layer):
    return {k: v.detach().clone() for k, v in layer.state_dict().items()}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _extra_tensor(name):
    return torch.ones(4) if name == "sinks" else torch.randn(8, 64)


@pytest.mark.parametrize("extra", EXTRAS)
@pytest.mark.parametrize("case", STRICT_CASES)
def test_load_refuses_unused_tensor(case, extra):
    c, cfg, layer, attn, _ = _layer_and_weights(case)
    layer.load_hf_state_dict(F.state_dict(attn, c.prefix), prefix=c.prefix)
    before = _snapshot(layer)
    _, _, _, other, _ = _layer_and_weights(case, seed=9)      # different weights: a change would show
    sd = F.state_dict(other, c.prefix)
    sd[c.prefix + extra] = _extra_tensor(extra)
    with pytest.raises(ValueError) as e:
        layer.load_hf_state_dict(sd, prefix=c.prefix)
    assert extra in str(e.value), f"the message does not name {extra!r}: {e.value}"
    assert _same(before, _snapshot(layer)), "a refused load changed the layer"


@pytest.mark.parametrize("missing", ["kv_b_proj.weight", "kv_a_layernorm.weight", "o_proj.weight"])
@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("case", STRICT_CASES)
def test_load_refuses_missing_tensor(case, strict, missing):
    c, cfg, layer, attn, _ = _layer_and_weights(case)
    layer.load_hf_state_dict(F.state_dict(attn, c.prefix), prefix=c.prefix)
    before = _snapshot(layer)
    _, _, _, other, _ = _layer_and_weights(case, seed=9)
    sd = F.state_dict(other, c.prefix)
    del sd[c.prefix + missing]
    if not strict:      # strict=False skips named extras but still needs every tensor it uses
        sd[c.prefix + "indexer.wk.weight"] = torch.randn(8, 64)
    with pytest.raises(ValueError) as e:
        layer.load_hf_state_dict(sd, prefix=c.prefix, strict=strict)
    assert missing in str(e.value), f"the message does not name {missing!r}: {e.value}"
    assert _same(before, _snapshot(layer)), "a refused load changed the layer"


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("case", STRICT_CASES)
def test_load_refuses_misshaped_tensor(case, strict):
    c, cfg, layer, attn, _ = _layer_and_weights(case)
    layer.load_hf_state_dict(F.state_dict(attn, c.prefix), prefix=c.prefix)
    before = _snapshot(layer)
    sd = F.state_dict(_layer_and_weights(case, seed=9)[3], c.prefix)
    sd[c.prefix + "kv_b_proj.weight"] = sd[c.prefix + "kv_b_proj.weight"][:-1]
    with pytest.raises(ValueError, match="kv_b_proj.weight"):
        layer.load_hf_state_dict(sd, prefix=c.prefix, strict=strict)
    assert _same(before, _snapshot(layer)), "a refused load changed the layer"


@pytest.mark.parametrize("case", STRICT_CASES)
def test_load_non_strict_skips_extras(case):
    """strict=False loads what the layer uses and ignores the extras; the layer is then exact."""
    c, cfg, layer, attn, rot = _layer_and_weights(case)
    sd = F.state_dict(attn, c.prefix)
    for extra in EXTRAS:
        sd[c.prefix + extra] = _extra_tensor(extra)
    layer.load_hf_state_dict(sd, prefix=c.prefix, strict=False)
    plain = mla.MLA(cfg, layer_idx=c.layer_idx, dtype=torch.float32, device="cpu", backend="torch")
    plain.load_hf_state_dict(F.state_dict(attn, c.prefix), prefix=c.prefix)
    assert _same(_snapshot(plain), _snapshot(layer))
    cache = mla.PagedLatentCache(cfg, num_layers=c.layer_idx + 1, num_blocks=16, block_size=4,
                                 dtype=torch.float32, device="cpu")
    x = torch.randn(12, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = layer(x, cache.prepare([(0, 12)]))
    assert rel_err(out, F.reference(c, attn.double(), rot, x.double())) <= FP32_TOL


@pytest.mark.parametrize("case", STRICT_CASES)
def test_load_ignores_tensors_outside_prefix(case):
    """Other layers' tensors (an indexer, an MLP, another attention) are never looked at."""
    c, cfg, layer, attn, _ = _layer_and_weights(case)
    sd = F.state_dict(attn, c.prefix)
    sd.update(F.state_dict(attn, "model.layers.7.self_attn."))
    sd["model.layers.7.self_attn.indexer.wk.weight"] = torch.randn(8, 64)
    sd[c.prefix.rstrip(".") + "_gate.weight"] = torch.randn(8, 64)     # shares the prefix's text, not its dot
    sd["model.layers.0.mlp.gate_proj.weight"] = torch.randn(8, 64)
    if c.prefix.endswith(".1."):         # LongCat's self_attn.1: its sibling self_attn.0, with an extra
        sd.update(F.state_dict(attn, c.prefix[:-2] + "0."))
        sd[c.prefix[:-2] + "0.sinks"] = torch.randn(4)
    sd["lm_head.weight"] = torch.randn(32, 64)
    layer.load_hf_state_dict(sd, prefix=c.prefix)
    plain = mla.MLA(cfg, layer_idx=c.layer_idx, dtype=torch.float32, device="cpu", backend="torch")
    plain.load_hf_state_dict(F.state_dict(attn, c.prefix), prefix=c.prefix)
    assert _same(_snapshot(plain), _snapshot(layer))


def test_load_fp8_checkpoint_is_strict_clean():
    """An FP8 checkpoint's weight_scale_inv tensors are used, not refused as extras."""
    from mla.weights import quantize_checkpoint_fp8

    c, cfg, layer, attn, _ = _layer_and_weights("deepseek_v3")
    sd = quantize_checkpoint_fp8(F.state_dict(attn, c.prefix))
    assert any(k.endswith("weight_scale_inv") for k in sd)
    layer.load_hf_state_dict(sd, prefix=c.prefix)
    sd[c.prefix + "indexer.wk.weight"] = torch.randn(8, 64)
    with pytest.raises(ValueError, match="indexer.wk.weight"):
        layer.load_hf_state_dict(sd, prefix=c.prefix)


@pytest.mark.parametrize("fp8_weights", ["never", "always"])
def test_longcat_fp8_checkpoint_scales_folded(fp8_weights):
    """LongCat's q scale folded into an FP8 q_b_proj (its block scales when kept in FP8, the
    dequantized weight otherwise): against the module with the dequantized weights. Kept in FP8
    the activations are quantized too (about 4% here); an unfolded scale is 16%."""
    from mla.weights import dequant_block_fp8, quantize_checkpoint_fp8

    c, cfg, _, attn, rot = _layer_and_weights("longcat_flash")
    sd = quantize_checkpoint_fp8(F.state_dict(attn, c.prefix))
    ref = copy.deepcopy(attn).double()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if c.prefix + name + "_scale_inv" in sd:
                p.copy_(dequant_block_fp8(sd[c.prefix + name], sd[c.prefix + name + "_scale_inv"]))
    layer = mla.MLA(cfg, layer_idx=c.layer_idx, dtype=torch.float32, device="cpu", backend="torch",
                    fp8_weights=fp8_weights)
    layer.load_hf_state_dict(sd, prefix=c.prefix)
    cache = mla.PagedLatentCache(cfg, num_layers=c.layer_idx + 1, num_blocks=16, block_size=4,
                                 dtype=torch.float32, device="cpu")
    x = torch.randn(20, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = layer(x, cache.prepare([(0, 20)]))
    err = rel_err(out, F.reference(c, ref, rot, x.double()))
    assert err <= (FP32_TOL if fp8_weights == "never" else 0.08), err
