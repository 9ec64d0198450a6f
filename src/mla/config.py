"""MLA configuration: a frozen dataclass read from a Hugging Face config, and presets.

Notation (DeepSeek-V2 paper): hidden D, heads H, q_lora_rank rq (None for "lite"
models), kv_lora_rank r, qk_nope_head_dim dn, qk_rope_head_dim dr, v_head_dim dv.

``from_hf`` reads every MLA family transformers ships. What a family's attention does beyond
DeepSeek-V3's is either a field here (RoPE pairing and type, a query temperature, LongCat's
latent scales, the layers that are MLA) or refused with ``NotImplementedError`` naming the
feature and the ``model_type``: a config key that changes the attention is never ignored.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["MLAConfig", "RopeScaling", "yarn_mscale"]


def _real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention-magnitude correction: 0.1 * mscale * ln(factor) + 1 (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters (the only scaling DeepSeek and Kimi checkpoints use).

    ``mscale``/``mscale_all_dim`` None means the key was missing: cos/sin are then scaled by
    ``yarn_mscale(factor)`` as transformers does; ``attention_factor`` overrides that scale.
    """
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        for name in ("factor", "beta_fast", "beta_slow"):
            v = getattr(self, name)
            if not _real(v) or not 0 < v < math.inf:
                raise ValueError(f"rope_scaling.{name}: expected a finite number > 0, got {v!r}")
        for name in ("mscale", "mscale_all_dim", "attention_factor"):
            v = getattr(self, name)
            if v is not None and (not _real(v) or not 0 <= v < math.inf):
                raise ValueError(f"rope_scaling.{name}: expected a finite number >= 0 or None, got {v!r}")
        o = self.original_max_position_embeddings
        if not isinstance(o, int) or isinstance(o, bool) or o <= 0:
            raise ValueError(f"rope_scaling.original_max_position_embeddings: expected a positive int, got {o!r}")

    @property
    def cos_sin_scale(self) -> float:
        """The factor cos and sin are multiplied by."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)


ROPE_TYPES = ("default", "yarn", "none")


@dataclass(frozen=True)
class MLAConfig:
    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # "default", "yarn" (with rope_scaling) or "none" (NoPE: q_pe and k_pe stay unrotated, as in
    # Kimi Linear); None derives "yarn" or "default" from rope_scaling
    rope_type: str | None = None
    rope_interleave: bool = True        # DeepSeek pairs (2i, 2i+1); False: neox pairs (i, i + dr/2)
    attention_bias: bool = False        # bias on q_a_proj (or q_proj), kv_a_proj_with_mqa and o_proj
    q_norm_eps: float = 1e-6            # transformers and DeepSeek use 1e-6 for both latent norms
    kv_norm_eps: float = 1e-6
    # Llama-4 style query temperature as Mistral 4 applies it, at position p:
    # q *= log(floor(p / floor_scale) + 1) * beta + 1
    temperature_floor_scale: float | None = None
    temperature_beta: float = 0.1
    # LongCat-Flash multiplies q by sqrt(D / rq) and c_kv by sqrt(D / r); load_hf_state_dict folds
    # them into q_b_proj and kv_a_layernorm, so the attention itself never sees them
    q_lora_scale: float = 1.0
    kv_lora_scale: float = 1.0
    # the layers whose attention is MLA (Kimi Linear interleaves linear-attention layers); None: all
    mla_layers: tuple[int, ...] | None = None
    # DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): a lightning indexer scores every visible key
    # per query token, score(t, s) = sum_h w_h(t) * relu(q_h(t) . k(s) * index_head_dim^-0.5) with
    # w = weights_proj(x) * index_weights_scale, and each query attends to its index_topk best keys
    # only. index_topk None: dense MLA (the other index_* fields are then unused).
    index_topk: int | None = None
    index_n_heads: int | None = None
    index_head_dim: int | None = None
    # RoPE of the indexer's first qk_rope_head_dim values: neox halves in DeepSeek-V3.2 (False),
    # interleaved pairs in GLM-5 (True), whatever rope_interleave says for the main attention
    index_rope_interleave: bool = False
    index_weights_scale: float | None = None   # None: index_n_heads ** -0.5 (both families)
    index_k_norm_eps: float = 1e-6             # the indexer's key LayerNorm
    # GLM-5's indexer_types: the layers that reuse the top-k of the nearest earlier layer with an
    # indexer ("shared") instead of running their own; empty: every layer runs its indexer
    index_shared_layers: tuple[int, ...] = ()
    name: str = field(default="custom", compare=False)

    def __post_init__(self):
        for f in ("hidden_size", "num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                  "v_head_dim", "max_position_embeddings"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{f}: expected a positive int, got {v!r}")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or isinstance(self.q_lora_rank, bool)
                                             or self.q_lora_rank <= 0):
            raise ValueError(f"q_lora_rank: expected a positive int or None, got {self.q_lora_rank!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim: expected an even number, got {self.qk_rope_head_dim}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"rope_scaling: expected a RopeScaling or None, got {type(self.rope_scaling).__name__}")
        if self.rope_type is None:
            object.__setattr__(self, "rope_type", "yarn" if self.rope_scaling is not None else "default")
        if self.rope_type not in ROPE_TYPES or (self.rope_type == "yarn") != (self.rope_scaling is not None):
            raise ValueError(f"rope_type: expected one of {ROPE_TYPES}, 'yarn' exactly when rope_scaling is set, "
                             f"got {self.rope_type!r} with rope_scaling={self.rope_scaling}")
        for f in ("rope_theta", "q_norm_eps", "kv_norm_eps", "q_lora_scale", "kv_lora_scale", "temperature_beta"):
            v = getattr(self, f)
            if not _real(v) or not 0 < v < math.inf:
                raise ValueError(f"{f}: expected a finite number > 0, got {v!r}")
        t = self.temperature_floor_scale
        if t is not None and (not _real(t) or not 0 < t < math.inf):
            raise ValueError(f"temperature_floor_scale: expected a finite number > 0 or None, got {t!r}")
        if not isinstance(self.rope_interleave, bool) or not isinstance(self.attention_bias, bool):
            raise ValueError(f"rope_interleave, attention_bias: expected bools, got {self.rope_interleave!r}, "
                             f"{self.attention_bias!r}")
        if self.q_lora_scale != 1.0 and self.q_lora_rank is None:
            raise ValueError("q_lora_scale: expected 1.0 without a q_lora_rank (it scales q_b_proj's output)")
        m = self.mla_layers
        if m is not None and (not isinstance(m, tuple)
                              or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in m)):
            raise ValueError(f"mla_layers: expected a tuple of layer indices >= 0 or None, got {m!r}")
        self._check_indexer()

    def _check_indexer(self) -> None:
        if self.index_topk is None:
            return
        for f in ("index_topk", "index_n_heads", "index_head_dim"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{f}: expected a positive int with index_topk set, got {v!r}")
        if self.q_lora_rank is None:
            raise ValueError("index_topk: the sparse indexer reads the normed q latent: expected a q_lora_rank")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(f"index_head_dim: expected >= qk_rope_head_dim ({self.qk_rope_head_dim}: its RoPE part), "
                             f"got {self.index_head_dim}")
        if not isinstance(self.index_rope_interleave, bool):
            raise ValueError(f"index_rope_interleave: expected a bool, got {self.index_rope_interleave!r}")
        if self.index_weights_scale is None:
            object.__setattr__(self, "index_weights_scale", self.index_n_heads ** -0.5)
        for f in ("index_weights_scale", "index_k_norm_eps"):
            v = getattr(self, f)
            if not _real(v) or not 0 < v < math.inf:
                raise ValueError(f"{f}: expected a finite number > 0, got {v!r}")
        s = self.index_shared_layers
        if not isinstance(s, tuple) or not all(isinstance(i, int) and not isinstance(i, bool) and i > 0 for i in s):
            raise ValueError(f"index_shared_layers: expected a tuple of layer indices > 0 (layer 0 runs its "
                             f"indexer), got {s!r}")

    @property
    def has_indexer(self) -> bool:
        """Whether the attention is sparse (DeepSeek Sparse Attention)."""
        return self.index_topk is not None

    @property
    def index_softmax_scale(self) -> float:
        """The scale of q . k inside the indexer's relu: index_head_dim^-0.5."""
        return self.index_head_dim ** -0.5

    def index_source_layer(self, layer_idx: int) -> int:
        """The layer whose top-k selection ``layer_idx`` attends with: itself, or for a GLM-5
        "shared" layer the nearest earlier layer that runs its indexer."""
        while layer_idx in self.index_shared_layers:
            layer_idx -= 1
        return layer_idx

    # Derived sizes.
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_dim(self) -> int:
        """Values per cached latent row: [c_kv | k_pe]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """mscale^2 / sqrt(dn + dr), mscale from mscale_all_dim under YaRN; used by both paths."""
        scale = self.qk_head_dim ** -0.5
        s = self.rope_scaling
        if s is not None and s.mscale_all_dim:
            scale *= yarn_mscale(s.factor, s.mscale_all_dim) ** 2
        return scale

    def replace(self, **changes) -> "MLAConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, hf_config: Any) -> "MLAConfig":
        """From a config.json dict or a transformers PretrainedConfig of an MLA family (see
        FAMILIES). Raises ValueError for a config without MLA fields or with invalid values, and
        NotImplementedError naming the feature and the model_type for what the library does not
        implement (a sparse indexer outside DeepSeek-V3.2 and GLM-5, an output gate, attention sinks, a RoPE type)."""
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
        missing = [k for k in ("hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                               "qk_rope_head_dim", "v_head_dim") if c.get(k) is None]
        if missing:
            raise ValueError(f"hf_config: expected MLA fields {missing} (an MLA family's config), "
                             f"got model_type {model_type!r} without them")
        family = FAMILIES.get(model_type, {})
        _refuse_unimplemented(c, model_type, _INDEXER_KEYS if family.get("indexer") else ())
        rope = _rope_parameters(c)
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
        max_pos = c.get("max_position_embeddings")
        if max_pos is None:
            max_pos = c.get("model_max_length")    # Kimi Linear's key
        scaling = None
        if family.get("nope"):
            rope_type = "none"
        elif rope_type == "yarn":
            scaling = _yarn(rope, max_pos)
        elif rope_type != "default":
            raise NotImplementedError(f"rope_parameters.rope_type: {rope_type!r} RoPE of model_type {model_type!r} "
                                      "is not implemented (the library has 'default' and 'yarn')")
        temperature = _temperature(c, rope if family.get("temperature") else {})
        interleave = c.get("rope_interleave")
        if isinstance(interleave, str) or (interleave is not None and not isinstance(interleave, (bool, int))):
            raise ValueError(f"rope_interleave: expected a bool, got {interleave!r}")
        interleave = family.get("interleave", True if interleave is None else bool(interleave))
        scales = {}
        if family.get("latent_scales"):
            if c.get("q_lora_rank") is None:
                raise NotImplementedError(f"model_type {model_type!r}: latent scales without q_lora_rank")
            scales = dict(q_lora_scale=(c["hidden_size"] / c["q_lora_rank"]) ** 0.5,
                          kv_lora_scale=(c["hidden_size"] / c["kv_lora_rank"]) ** 0.5)
        return cls(
            hidden_size=c["hidden_size"], num_heads=c["num_attention_heads"], q_lora_rank=c.get("q_lora_rank"),
            kv_lora_rank=c["kv_lora_rank"], qk_nope_head_dim=c["qk_nope_head_dim"],
            qk_rope_head_dim=c["qk_rope_head_dim"], v_head_dim=c["v_head_dim"],
            max_position_embeddings=4096 if max_pos is None else max_pos, rope_theta=_number("rope_theta", theta),
            rope_scaling=scaling, rope_type="none" if rope_type == "none" else None, rope_interleave=interleave,
            attention_bias=_flag("attention_bias", c.get("attention_bias", False)),
            temperature_floor_scale=temperature[0], temperature_beta=temperature[1],
            mla_layers=_mla_layers(c, model_type, family.get("kimi_layers", False), bool(family.get("indexer"))),
            **scales, **(_indexer(c, model_type, family["indexer"]) if family.get("indexer") else {}),
            name=str(c.get("_name_or_path") or model_type))

    @classmethod
    def preset(cls, name: str) -> "MLAConfig":
        """Published attention dimensions: deepseek-v3, deepseek-v2, deepseek-v2-lite, kimi-k2, tiny."""
        if name not in PRESETS:
            raise ValueError(f"name: expected one of {sorted(PRESETS)}, got {name!r}")
        return dataclasses.replace(PRESETS[name], name=name)


# model_type -> what its attention does beyond DeepSeek-V3's, where from_hf must know it:
# interleave: the RoPE pairing its module always uses, whatever rope_interleave says (DeepSeek-V2
# rotates complex pairs, MiniCPM3 neox halves, LongCat interleaved pairs); the other families read
# rope_interleave (default True). nope: no RoPE at all. latent_scales: LongCat's sqrt(D / rank).
# temperature: the module applies rope_parameters' llama_4_scaling_beta (the others ignore it).
# kimi_layers: Kimi Linear's layer list (layer_types, else linear_attn_config, else its default).
FAMILIES: dict[str, dict] = {
    "deepseek_v3": {}, "kimi_k2": {}, "axk1": {}, "youtu": {}, "glm4_moe_lite": {},
    "mistral4": {"temperature": True},
    "deepseek_v2": {"interleave": True},
    "minicpm3": {"interleave": False},
    "longcat_flash": {"interleave": True, "latent_scales": True},
    "kimi_linear": {"nope": True, "kimi_layers": True},
    # DeepSeek Sparse Attention: the main attention always interleaved; indexer: its RoPE pairing
    "deepseek_v32": {"interleave": True, "indexer": "neox"},
    "glm_moe_dsa": {"interleave": True, "indexer": "interleave"},
}

# model_type -> the attention feature the library does not implement (NotImplementedError)
REFUSED: dict[str, str] = {
    "glm5_next": "the sparse indexer, qk_rope_head_dim 0 and linear-attention layers",
    "glm5_next_text": "the sparse indexer, qk_rope_head_dim 0 and linear-attention layers",
    "hy_v4": "the sigmoid output gate (gate_proj), attention sinks and the sparse indexer",
    "axk2": "the fused q_gate_proj, the output gate and the sparse indexer",
    "deepseek_v4": "DeepSeek-V4's attention (one 512-wide KV head with compressed and sliding-window "
                   "layers: not MLA)",
}

# keys whose presence (not None) changes the attention in a way the library does not implement
_UNIMPLEMENTED_KEYS = {
    "index_topk": "the sparse indexer (index_topk)",
    "index_n_heads": "the sparse indexer (index_n_heads)",
    "indexer_types": "the sparse indexer (indexer_types)",
    "learnable_sink_init": "attention sinks (learnable_sink_init)",
    "attention_sinks": "attention sinks",
    "gated_attention": "an output gate (gated_attention)",
    "sliding_window": "sliding-window attention",
}

# the sparse indexer's keys: read by the families with an indexer, refused elsewhere
_INDEXER_KEYS = ("index_topk", "index_n_heads", "indexer_types")

# layer_types entries that are MLA layers this library serves
_MLA_LAYER_TYPES = ("full_attention", "attention", "mla")
_SPARSE_LAYER_TYPE = "deepseek_sparse_attention"    # DeepSeek-V3.2 / GLM-5: MLA with the indexer


def _refuse_unimplemented(c: dict, model_type: str, read: tuple[str, ...] = ()) -> None:
    for key, feature in _UNIMPLEMENTED_KEYS.items():
        if key not in read and c.get(key) is not None:
            raise NotImplementedError(f"{key}: mla does not implement {feature} (model_type {model_type!r})")
    rope = _rope_parameters(c)
    for key in ("short_factor", "long_factor"):
        if rope.get(key) is not None:
            raise NotImplementedError(f"rope_parameters.{key}: longrope RoPE of model_type {model_type!r} "
                                      "is not implemented")


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
    if not _real(v) or not 0 < v < math.inf:
        raise ValueError(f"{name}: expected a finite number > 0, got {v!r}"[:200])
    return float(v)


def _flag(name: str, v) -> bool:
    if not isinstance(v, bool) and v not in (0, 1):
        raise ValueError(f"{name}: expected a bool, got {v!r}"[:200])
    return bool(v)


def _yarn(rope: dict, max_pos) -> RopeScaling:
    factor, original = rope.get("factor"), rope.get("original_max_position_embeddings")
    if original is None:
        raise ValueError("rope_scaling: expected original_max_position_embeddings for YaRN")
    if factor is None:   # transformers' rule for configs without a factor
        if max_pos is None:
            raise ValueError("rope_scaling: expected a YaRN factor, or max_position_embeddings to derive it")
        factor = _number("max_position_embeddings", max_pos) / _number("rope_scaling.original_max_position_embeddings",
                                                                        original)
    return RopeScaling(
        factor=_number("rope_scaling.factor", factor), original_max_position_embeddings=original,
        beta_fast=_number("rope_scaling.beta_fast", rope.get("beta_fast") or 32),
        beta_slow=_number("rope_scaling.beta_slow", rope.get("beta_slow") or 1),
        mscale=rope.get("mscale"), mscale_all_dim=rope.get("mscale_all_dim"),
        attention_factor=rope.get("attention_factor"), truncate=_flag("rope_scaling.truncate", rope.get("truncate", True)))


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


def _indexer(c: dict, model_type: str, pairing: str) -> dict:
    """The indexer fields of a DeepSeek Sparse Attention family. GLM-5's indexer_types marks
    the layers that reuse an earlier layer's top-k ("shared") instead of running their own."""
    out = {}
    for key in ("index_topk", "index_n_heads", "index_head_dim"):
        v = c.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{key}: expected a positive int for {model_type!r}'s sparse indexer, got {v!r}"[:200])
        out[key] = v
    if c.get("q_lora_rank") is None:
        raise NotImplementedError(f"q_lora_rank: a sparse indexer without a q latent (model_type {model_type!r})")
    types = c.get("indexer_types")
    shared: tuple[int, ...] = ()
    if types is not None:
        if not isinstance(types, (list, tuple)) or not all(t in ("full", "shared") for t in types):
            raise ValueError(f"indexer_types: expected a list of 'full' and 'shared', got {types!r}"[:200])
        if types and types[0] != "full":
            raise ValueError("indexer_types: expected layer 0 to be 'full' (a shared layer reuses an earlier "
                             f"layer's top-k), got {types[0]!r}")
        shared = tuple(i for i, t in enumerate(types) if t == "shared")
    return dict(out, index_rope_interleave=pairing == "interleave", index_shared_layers=shared)


def _mla_layers(c: dict, model_type: str, kimi: bool, sparse: bool = False) -> tuple[int, ...] | None:
    """The indices of the MLA layers when layer_types mixes in other attention (Kimi Linear).
    Kimi Linear's config.json lists them (from 1) in linear_attn_config.full_attn_layers; without
    either, transformers makes layer i full attention where i > 0 and i % 4 == 0."""
    types = c.get("layer_types")
    if types is None and kimi:
        n = c.get("num_hidden_layers")
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise ValueError(f"num_hidden_layers: expected a positive int for {model_type!r}'s layer list, got {n!r}")
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
    mla_types = _MLA_LAYER_TYPES + ((_SPARSE_LAYER_TYPE,) if sparse else ())
    unknown = sorted(set(types) - set(mla_types) - {"linear_attention"})
    if unknown:
        raise NotImplementedError(f"layer_types: mla does not implement {unknown} layers (model_type {model_type!r})")
    layers = tuple(i for i, t in enumerate(types) if t in mla_types)
    return None if len(layers) == len(types) else layers


_V3_YARN = RopeScaling(factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                       mscale=1.0, mscale_all_dim=1.0)
_V2_YARN = RopeScaling(factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                       mscale=0.707, mscale_all_dim=0.707)
_KIMI_YARN = RopeScaling(factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0, beta_slow=1.0,
                         mscale=1.0, mscale_all_dim=1.0)

PRESETS: dict[str, MLAConfig] = {
    # config.json of deepseek-ai/DeepSeek-V3 (and V3.1/V3.2: same attention dimensions)
    "deepseek-v3": MLAConfig(hidden_size=7168, num_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                             max_position_embeddings=163840, rope_theta=10000.0, rope_scaling=_V3_YARN),
    # deepseek-ai/DeepSeek-V2
    "deepseek-v2": MLAConfig(hidden_size=5120, num_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                             max_position_embeddings=163840, rope_theta=10000.0, rope_scaling=_V2_YARN),
    # deepseek-ai/DeepSeek-V2-Lite: no query compression
    "deepseek-v2-lite": MLAConfig(hidden_size=2048, num_heads=16, q_lora_rank=None, kv_lora_rank=512,
                                  qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                  max_position_embeddings=163840, rope_theta=10000.0, rope_scaling=_V2_YARN),
    # moonshotai/Kimi-K2-Instruct: DeepSeek-V3's architecture with 64 heads, rope_theta 50000
    "kimi-k2": MLAConfig(hidden_size=7168, num_heads=64, q_lora_rank=1536, kv_lora_rank=512,
                         qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                         max_position_embeddings=131072, rope_theta=50000.0, rope_scaling=_KIMI_YARN),
    # a small DeepSeek-shaped config for tests and the demo
    "tiny": MLAConfig(hidden_size=256, num_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
                      qk_rope_head_dim=16, v_head_dim=32, max_position_embeddings=4096, rope_theta=10000.0,
                      rope_scaling=RopeScaling(factor=4.0, original_max_position_embeddings=64,
                                               mscale=1.0, mscale_all_dim=1.0)),
}
