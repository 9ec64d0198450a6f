"""What each MLA family's transformers config says beyond DeepSeek-V3's, and how
``MLAConfig.from_hf`` reads it: RoPE pairing and type, a query temperature, LongCat's latent
scales, the layers that are MLA, the sparse indexer (DeepSeek's, or GLM-5.3-Flash's k-pool
indexer), Hy4's sinks and output gate, A.X-K2's fused q and gate projection; and what the
library refuses, by name (``NotImplementedError`` naming the feature and the ``model_type``): a
config key that changes the attention is never ignored.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

__all__ = ["FAMILIES", "REFUSED", "config_fields", "is_real"]


def is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def config_fields(hf_config: Any) -> dict:
    """MLAConfig's fields from a config.json dict or a transformers PretrainedConfig, with
    ``rope_scaling`` as RopeScaling's fields (or None)."""
    if hasattr(hf_config, "to_dict"):
        hf_config = hf_config.to_dict()
    if not isinstance(hf_config, Mapping):
        raise ValueError(f"hf_config: expected a dict or a transformers config, got {type(hf_config).__name__}")
    c = dict(hf_config)
    if c.get("text_config") and "kv_lora_rank" not in c:   # multimodal wrappers (Kimi-VL style)
        c = dict(c["text_config"])
    model_type = str(c.get("model_type") or "unknown")
    if model_type in REFUSED:
        raise NotImplementedError(f"model_type {model_type!r}: mla does not implement {REFUSED[model_type]}")
    family = FAMILIES.get(model_type, {})
    for key, v in family.get("defaults", {}).items():   # what the family's config class supplies
        c.setdefault(key, v)
    if family.get("v_head_dim_from_heads") and c.get("v_head_dim") is None:   # MiniCPM3's config class
        H, D = c.get("num_attention_heads"), c.get("hidden_size")
        if isinstance(H, int) and isinstance(D, int) and H > 0:
            c["v_head_dim"] = D // H
    missing = [k for k in ("hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                           "qk_rope_head_dim", "v_head_dim") if c.get(k) is None]
    if missing:
        raise ValueError(f"hf_config: expected MLA fields {missing} (an MLA family's config), "
                         f"got model_type {model_type!r} without them")
    indexer = family.get("indexer")
    read = (_INDEXER_KEYS if indexer else ()) + (("index_kpool",) if indexer == "kpool" else ()) \
        + (("learnable_sink_init",) if family.get("sinks") else ())
    _refuse_unimplemented(c, model_type, read)
    rope = _rope_parameters(c)
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    max_pos = c.get("max_position_embeddings")
    if max_pos is None:
        max_pos = c.get("model_max_length")    # Kimi Linear's key
    scaling = longrope = None
    if family.get("nope"):
        rope_type = "none"
    elif rope_type == "yarn":
        scaling = _yarn(rope, max_pos)
    elif rope_type == "longrope" and family.get("longrope"):
        longrope = _longrope(c, rope, max_pos, model_type)
    elif rope_type != "default":
        raise NotImplementedError(f"rope_parameters.rope_type: {rope_type!r} RoPE of model_type {model_type!r} "
                                  "is not implemented (the library has 'default' and 'yarn', and 'longrope' for "
                                  "minicpm3)")
    temperature = _temperature(c, rope if family.get("temperature") else {})
    interleave = c.get("rope_interleave")
    if isinstance(interleave, str) or (interleave is not None and not isinstance(interleave, (bool, int))):
        raise ValueError(f"rope_interleave: expected a bool, got {interleave!r}")
    interleave = family.get("interleave", True if interleave is None else bool(interleave))
    scales = {}
    if family.get("latent_norm_eps"):   # both latent RMSNorms take the config's eps
        eps = _number("rms_norm_eps", c.get("rms_norm_eps", 1e-6))
        scales.update(q_norm_eps=eps, kv_norm_eps=eps)
    if family.get("latent_scales"):
        if c.get("q_lora_rank") is None:
            raise NotImplementedError(f"model_type {model_type!r}: latent scales without q_lora_rank")
        scales.update(q_lora_scale=(c["hidden_size"] / c["q_lora_rank"]) ** 0.5,
                      kv_lora_scale=(c["hidden_size"] / c["kv_lora_rank"]) ** 0.5)
    mla_layers = _mla_layers(c, model_type, family)
    return dict(
        hidden_size=c["hidden_size"], num_heads=c["num_attention_heads"], q_lora_rank=c.get("q_lora_rank"),
        kv_lora_rank=c["kv_lora_rank"], qk_nope_head_dim=c["qk_nope_head_dim"],
        qk_rope_head_dim=c["qk_rope_head_dim"], v_head_dim=c["v_head_dim"],
        max_position_embeddings=4096 if max_pos is None else max_pos, rope_theta=_number("rope_theta", theta),
        rope_scaling=scaling, longrope=longrope, rope_type="none" if rope_type == "none" else None,
        rope_interleave=interleave,
        attention_bias=_flag("attention_bias", c.get("attention_bias", False)),
        temperature_floor_scale=temperature[0], temperature_beta=temperature[1],
        mla_layers=mla_layers,
        **scales, **(_indexer(c, model_type, indexer, mla_layers) if indexer else {}),
        **_gate_fields(c, family),
        name=str(c.get("_name_or_path") or model_type))


# model_type -> what its attention does beyond DeepSeek-V3's, where from_hf must know it:
# interleave: the RoPE pairing its module always uses, whatever rope_interleave says (DeepSeek-V2
# rotates complex pairs, MiniCPM3 neox halves, LongCat interleaved pairs); the other families read
# rope_interleave (default True). nope: no RoPE at all. latent_scales: LongCat's sqrt(D / rank).
# temperature: the module applies rope_parameters' llama_4_scaling_beta (the others ignore it).
# kimi_layers: Kimi Linear's layer list (layer_types, else linear_attn_config, else its default).
# longrope: the module takes LongRoPE (MiniCPM3-4B ships it). v_head_dim_from_heads: a config.json
# without v_head_dim has hidden_size // num_attention_heads (MiniCPM3's config class).
# latent_norm_eps: both latent RMSNorms take rms_norm_eps (others: 1e-6). defaults: what the
# family's transformers config class supplies for a key a config.json may leave out.
FAMILIES: dict[str, dict] = {
    "deepseek_v3": {}, "kimi_k2": {}, "axk1": {}, "youtu": {}, "glm4_moe_lite": {},
    "mistral4": {"temperature": True},
    "deepseek_v2": {"interleave": True},
    "minicpm3": {"interleave": False, "longrope": True, "v_head_dim_from_heads": True},
    "longcat_flash": {"interleave": True, "latent_scales": True},
    "kimi_linear": {"nope": True, "kimi_layers": True},
    # DeepSeek Sparse Attention: the main attention always interleaved; indexer: its RoPE pairing
    "deepseek_v32": {"interleave": True, "indexer": "neox"},
    "glm_moe_dsa": {"interleave": True, "indexer": "interleave"},
    # Hy4: neox pairs in both; the indexer rotates the last dr values of its head and its key
    # LayerNorm uses rms_norm_eps; a learnable sink per head and a sigmoid output gate
    "hy_v4": {"interleave": False, "indexer": "neox", "index_rope_last": True, "index_norm_eps": True,
              "sinks": True, "gate": "sigmoid"},
    # A.X-K2: DeepSeek-V3.2's attention and indexer, except q: no q_b_proj but a q_gate_proj over
    # cat(q_a_norm(q_a), q_a) whose per-head gate half gates the output by sigmoid
    "axk2": {"interleave": True, "indexer": "neox", "gate": "sigmoid", "q_gate_fused": True},
    # GLM-5.3-Flash (mla.kpool): no RoPE anywhere (qk_rope_head_dim 0), the k-pool indexer, MLA in
    # its "deepseek_sparse_attention" layers (linear attention in the others, every fourth layer
    # MLA by default); a "shared" layer reuses the top-k of the layer right before it, which must
    # be a "full" MLA layer (transformers hands a top-k to the next decoder layer only)
    "glm5_next_text": {"nope": True, "indexer": "kpool", "latent_norm_eps": True, "every_fourth_layer": True,
                       "defaults": {"qk_rope_head_dim": 0, "rms_norm_eps": 1e-5, "index_topk": 2048,
                                    "index_head_dim": 128, "index_n_heads": 32, "index_kpool": 16,
                                    "index_kpool_always_select_tail": True, "num_hidden_layers": 45,
                                    "max_position_embeddings": 1048576}},
}
FAMILIES["glm5_next"] = FAMILIES["glm5_next_text"]     # a text-only config.json at the top level

# model_type -> the attention feature the library does not implement (NotImplementedError)
REFUSED: dict[str, str] = {
    "deepseek_v4": "DeepSeek-V4's attention (one 512-wide KV head with compressed and sliding-window "
                   "layers: not MLA)",
}

# keys whose presence (not None) changes the attention in a way the library does not implement
_UNIMPLEMENTED_KEYS = {
    "index_topk": "the sparse indexer (index_topk)",
    "index_n_heads": "the sparse indexer (index_n_heads)",
    "indexer_types": "the sparse indexer (indexer_types)",
    "index_kpool": "the k-pool sparse indexer (index_kpool)",
    "learnable_sink_init": "attention sinks (learnable_sink_init)",
    "attention_sinks": "attention sinks",
    "gated_attention": "an output gate (gated_attention)",
    "sliding_window": "sliding-window attention",
}

# the sparse indexer's keys: read by the families with an indexer, refused elsewhere
_INDEXER_KEYS = ("index_topk", "index_n_heads", "indexer_types")

# layer_types entries that are MLA layers this library serves
_MLA_LAYER_TYPES = ("full_attention", "attention", "mla")
_SPARSE_LAYER_TYPE = "deepseek_sparse_attention"    # DeepSeek-V3.2 / GLM-5 / GLM-5.3-Flash: MLA with the indexer


def _refuse_unimplemented(c: dict, model_type: str, read: tuple[str, ...] = ()) -> None:
    for key, feature in _UNIMPLEMENTED_KEYS.items():
        if key not in read and c.get(key) is not None:
            raise NotImplementedError(f"{key}: mla does not implement {feature} (model_type {model_type!r})")
    rope = _rope_parameters(c)
    for key in ("short_factor", "long_factor"):
        if rope.get(key) is not None and (rope.get("rope_type") or rope.get("type")) != "longrope":
            raise NotImplementedError(f"rope_parameters.{key}: LongRoPE factors with rope_type "
                                      f"{rope.get('rope_type') or rope.get('type')!r} (model_type {model_type!r}) "
                                      "are not implemented")


def _rope_parameters(c: dict) -> dict:
    """transformers 5's rope_parameters, or the legacy rope_scaling (config.json of DeepSeek)."""
    rope, legacy = c.get("rope_parameters"), c.get("rope_scaling")
    for name, v in (("rope_parameters", rope), ("rope_scaling", legacy)):
        if v is not None and not isinstance(v, Mapping):
            raise ValueError(f"{name}: expected a dict or None, got {v!r}"[:200])
    rope = dict(rope or {})
    if legacy and not rope.get("factor"):
        rope.update(legacy)
    return rope


def _number(name: str, v) -> float:
    if not is_real(v) or not 0 < v < math.inf:
        raise ValueError(f"{name}: expected a finite number > 0, got {v!r}"[:200])
    return float(v)


def _flag(name: str, v) -> bool:
    if not isinstance(v, bool) and v not in (0, 1):
        raise ValueError(f"{name}: expected a bool, got {v!r}"[:200])
    return bool(v)


def _yarn(rope: dict, max_pos) -> dict:
    factor, original = rope.get("factor"), rope.get("original_max_position_embeddings")
    if original is None:
        raise ValueError("rope_scaling: expected original_max_position_embeddings for YaRN")
    if factor is None:   # transformers' rule for configs without a factor
        if max_pos is None:
            raise ValueError("rope_scaling: expected a YaRN factor, or max_position_embeddings to derive it")
        factor = _number("max_position_embeddings", max_pos) / _number("rope_scaling.original_max_position_embeddings",
                                                                        original)
    return dict(
        factor=_number("rope_scaling.factor", factor), original_max_position_embeddings=original,
        beta_fast=_number("rope_scaling.beta_fast", rope.get("beta_fast") or 32),
        beta_slow=_number("rope_scaling.beta_slow", rope.get("beta_slow") or 1),
        mscale=rope.get("mscale"), mscale_all_dim=rope.get("mscale_all_dim"),
        attention_factor=rope.get("attention_factor"), truncate=_flag("rope_scaling.truncate", rope.get("truncate", True)))


def _longrope(c: dict, rope: dict, max_pos, model_type: str) -> dict:
    """LongRope's fields as transformers reads them: original_max_position_embeddings from the
    config's top level if there (transformers gives it priority), else from the RoPE parameters,
    else max_position_embeddings; ``factor`` (else max_position_embeddings over that) only sets
    the default attention_factor, sqrt(1 + ln(factor) / ln(original)) (1 for factor <= 1)."""
    for key in ("short_factor", "long_factor"):
        v = rope.get(key)
        if not isinstance(v, (list, tuple)) or not all(is_real(x) for x in v):
            raise ValueError(f"rope_parameters.{key}: expected a list of numbers for longrope, got {v!r}"[:200])
    if rope.get("mscale_all_dim") or rope.get("mscale"):
        raise NotImplementedError(f"rope_parameters.mscale_all_dim: YaRN's mscale with longrope RoPE (model_type "
                                  f"{model_type!r}) is not implemented")
    original = c.get("original_max_position_embeddings")
    if original is None:
        original = rope.get("original_max_position_embeddings")
    if original is None:
        original = max_pos
    if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
        raise ValueError(f"rope_parameters.original_max_position_embeddings: expected a positive int for longrope, "
                         f"got {original!r}")
    factor = rope.get("factor")
    if factor is None:
        if max_pos is None:
            raise ValueError("rope_parameters: expected a longrope factor, or max_position_embeddings to derive it")
        factor = _number("max_position_embeddings", max_pos) / original
    factor = _number("rope_parameters.factor", factor)
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return dict(short_factor=tuple(float(x) for x in rope["short_factor"]),
                long_factor=tuple(float(x) for x in rope["long_factor"]),
                original_max_position_embeddings=original, attention_factor=attention)


def _temperature(c: dict, rope: dict) -> tuple[float | None, float]:
    """(floor_scale, beta) of the query temperature: Mistral 4 keeps llama_4_scaling_beta in its
    rope_parameters (floor scale: original_max_position_embeddings); Mistral's own configs have a
    llama_4_scaling dict."""
    beta = rope.get("llama_4_scaling_beta")
    if beta is not None:
        floor = rope.get("original_max_position_embeddings")
        if floor is None:
            raise ValueError("rope_parameters: expected original_max_position_embeddings with llama_4_scaling_beta")
        return _number("rope_parameters.original_max_position_embeddings", floor), \
            _number("rope_parameters.llama_4_scaling_beta", beta)
    llama4 = c.get("llama_4_scaling")
    if llama4 is None:
        return None, 0.1
    if not isinstance(llama4, Mapping):
        llama4 = vars(llama4)
    return (_number("llama_4_scaling.original_max_position_embeddings",
                    llama4.get("original_max_position_embeddings", 8192)),
            _number("llama_4_scaling.beta", llama4.get("beta", 0.1)))


def _indexer(c: dict, model_type: str, kind: str, mla_layers: tuple[int, ...] | None) -> dict:
    """The indexer fields of a sparse family; ``kind``: its RoPE pairing ("neox", "interleave"),
    or "kpool" (GLM-5.3-Flash's k-pool indexer, no RoPE). GLM-5's indexer_types marks the layers
    that reuse an earlier layer's top-k ("shared") instead of running their own."""
    out = {}
    for key in ("index_topk", "index_n_heads", "index_head_dim"):
        v = c.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{key}: expected a positive int for {model_type!r}'s sparse indexer, got {v!r}"[:200])
        out[key] = v
    if c.get("q_lora_rank") is None:
        raise NotImplementedError(f"q_lora_rank: a sparse indexer without a q latent (model_type {model_type!r})")
    if kind == "kpool":
        out.update(_kpool(c, model_type, out["index_topk"]))
    types = _indexer_types(c) if kind == "kpool" else c.get("indexer_types")
    shared: tuple[int, ...] = ()
    if types is not None:
        if not isinstance(types, (list, tuple)) or not all(t in ("full", "shared") for t in types):
            raise ValueError(f"indexer_types: expected a list of 'full' and 'shared', got {types!r}"[:200])
        if kind == "kpool":
            shared = _shared_after_full(types, mla_layers, model_type)
        else:
            if types and types[0] != "full":
                raise ValueError("indexer_types: expected layer 0 to be 'full' (a shared layer reuses an earlier "
                                 f"layer's top-k), got {types[0]!r}")
            shared = tuple(i for i, t in enumerate(types) if t == "shared")
    return dict(out, index_rope_interleave=kind == "interleave", index_shared_layers=shared)


def _kpool(c: dict, model_type: str, topk: int) -> dict:
    """GLM-5.3-Flash's pool size; its open pool's tokens are always selected (a query then always
    sees itself): without them a query before its first complete pool sees no key, where
    transformers averages every key of the cache, and mla refuses that."""
    P = c.get("index_kpool")
    if not isinstance(P, int) or isinstance(P, bool) or P <= 0 or topk % P:
        raise ValueError(f"index_kpool: expected a positive int dividing index_topk ({topk}), got {P!r}"[:200])
    if P > 1 and not _flag("index_kpool_always_select_tail", c.get("index_kpool_always_select_tail", True)):
        raise NotImplementedError(f"index_kpool_always_select_tail: mla does not implement the k-pool indexer without "
                                  f"its open pool's tokens (model_type {model_type!r}; queries before a complete pool "
                                  "would see no key)")
    return dict(index_kpool=P)


def _indexer_types(c: dict):
    """GLM-5.3-Flash's indexer_types, or for a config.json without them what its config class
    derives: an index_topk_pattern ("F"ull / "S"hared a layer), else every layer i is "full"
    where max(i - index_skip_topk_offset + 1, 0) is a multiple of index_topk_freq."""
    types = c.get("indexer_types")
    if types is not None:
        return types
    pattern = c.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str) and set(pattern) <= {"F", "S"}:
            return [{"F": "full", "S": "shared"}[ch] for ch in pattern]
        return pattern
    freq, offset = c.get("index_topk_freq", 1), c.get("index_skip_topk_offset", 2)
    if not (isinstance(freq, int) and isinstance(offset, int)) or isinstance(freq, bool) or isinstance(offset, bool):
        raise ValueError(f"index_topk_freq, index_skip_topk_offset: expected ints, got {freq!r}, {offset!r}"[:200])
    return ["full" if max(i - offset + 1, 0) % max(freq, 1) == 0 else "shared" for i in range(c["num_hidden_layers"])]


def _shared_after_full(types, mla_layers: tuple[int, ...] | None, model_type: str) -> tuple[int, ...]:
    """The MLA layers marked "shared" (a linear-attention layer's entry means nothing). Each
    reuses the top-k of the decoder layer right before it, which must be a "full" MLA layer:
    transformers hands a top-k to the next decoder layer only (through a shared or a
    linear-attention layer it is lost, and its shared layer raises)."""
    layers = range(len(types)) if mla_layers is None else mla_layers
    shared = tuple(i for i in layers if i < len(types) and types[i] == "shared")
    for i in shared:
        if i == 0 or (mla_layers is not None and i - 1 not in mla_layers) or types[i - 1] != "full":
            raise ValueError(f"indexer_types: layer {i} of {model_type!r} is 'shared', expected layer {i - 1} "
                             "before it to be a 'full' MLA layer (the one whose top-k it reuses)")
    return shared


def _gate_fields(c: dict, family: dict) -> dict:
    """Hy4's and A.X-K2's attention beyond DeepSeek-V3.2's (FAMILIES["hy_v4"], FAMILIES["axk2"])."""
    out = {}
    if family.get("index_rope_last"):
        out["index_rope_last"] = True
    if family.get("index_norm_eps"):
        out["index_k_norm_eps"] = _number("rms_norm_eps", c.get("rms_norm_eps", 1e-6))
    if family.get("sinks"):
        out["attention_sinks"] = True
    if family.get("gate"):
        out["output_gate"] = family["gate"]
    if family.get("q_gate_fused"):
        out["q_gate_fused"] = True
    return out


def _mla_layers(c: dict, model_type: str, family: dict) -> tuple[int, ...] | None:
    """The indices of the MLA layers when layer_types mixes in other attention (Kimi Linear,
    GLM-5.3-Flash). Kimi Linear's config.json lists them (from 1) in
    linear_attn_config.full_attn_layers; without either, transformers makes layer i full
    attention where i > 0 and i % 4 == 0 (Kimi Linear), i % 4 == 3 (GLM-5.3-Flash)."""
    types = c.get("layer_types")
    if types is None and (family.get("kimi_layers") or family.get("every_fourth_layer")):
        n = c.get("num_hidden_layers")
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise ValueError(f"num_hidden_layers: expected a positive int for {model_type!r}'s layer list, got {n!r}")
        if family.get("every_fourth_layer"):
            return tuple(i for i in range(n) if i % 4 == 3)
        lin = c.get("linear_attn_config") or {}
        full = lin.get("full_attn_layers") if isinstance(lin, Mapping) else None
        if full is not None:
            if not all(isinstance(i, int) and 1 <= i <= n for i in full):
                raise ValueError(f"linear_attn_config.full_attn_layers: expected layer numbers in 1..{n}, got {full!r}")
            return tuple(sorted(i - 1 for i in set(full)))
        return tuple(i for i in range(n) if i and i % 4 == 0)
    if types is None:
        return None
    if not isinstance(types, (list, tuple)) or not all(isinstance(t, str) for t in types):
        raise ValueError(f"layer_types: expected a list of strings, got {types!r}"[:200])
    mla_types = _MLA_LAYER_TYPES + ((_SPARSE_LAYER_TYPE,) if family.get("indexer") else ())
    unknown = sorted(set(types) - set(mla_types) - {"linear_attention"})
    if unknown:
        raise NotImplementedError(f"layer_types: mla does not implement {unknown} layers (model_type {model_type!r})")
    layers = tuple(i for i, t in enumerate(types) if t in mla_types)
    return None if len(layers) == len(types) else layers
