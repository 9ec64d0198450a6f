"""MLA configuration: a frozen dataclass read from a Hugging Face config, and presets.

Notation (DeepSeek-V2 paper): hidden D, heads H, q_lora_rank rq (None for "lite"
models), kv_lora_rank r, qk_nope_head_dim dn, qk_rope_head_dim dr, v_head_dim dv.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["MLAConfig", "RopeScaling", "yarn_mscale"]


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
        if not self.factor > 0:
            raise ValueError(f"rope_scaling.factor: expected > 0, got {self.factor}")
        if not self.original_max_position_embeddings > 0:
            raise ValueError("rope_scaling.original_max_position_embeddings: expected > 0, "
                             f"got {self.original_max_position_embeddings}")

    @property
    def cos_sin_scale(self) -> float:
        """The factor cos and sin are multiplied by."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)


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
    rope_interleave: bool = True        # DeepSeek pairs (2i, 2i+1); False: neox pairs (i, i + dr/2)
    attention_bias: bool = False        # bias on q_a_proj (or q_proj), kv_a_proj_with_mqa and o_proj
    q_norm_eps: float = 1e-6            # transformers and DeepSeek use 1e-6 for both latent norms
    kv_norm_eps: float = 1e-6
    # Llama-4 style query temperature: q *= log(floor((p + 1) / floor_scale) + 1) * beta + 1
    temperature_floor_scale: float | None = None
    temperature_beta: float = 0.1
    name: str = field(default="custom", compare=False)

    def __post_init__(self):
        for f in ("hidden_size", "num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                  "v_head_dim", "max_position_embeddings"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{f}: expected a positive int, got {v!r}")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0):
            raise ValueError(f"q_lora_rank: expected a positive int or None, got {self.q_lora_rank!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim: expected an even number, got {self.qk_rope_head_dim}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"rope_scaling: expected a RopeScaling or None, got {type(self.rope_scaling).__name__}")

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
        """From a config.json dict or a transformers PretrainedConfig of DeepSeek-V2/V3 or Kimi K2."""
        if hasattr(hf_config, "to_dict"):
            hf_config = hf_config.to_dict()
        if not isinstance(hf_config, Mapping):
            raise ValueError(f"hf_config: expected a dict or a transformers config, got {type(hf_config).__name__}")
        c = dict(hf_config)
        if c.get("text_config") and "kv_lora_rank" not in c:   # multimodal wrappers (Kimi-VL style)
            c = dict(c["text_config"])
        missing = [k for k in ("hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                               "qk_rope_head_dim", "v_head_dim") if c.get(k) is None]
        if missing:
            raise ValueError(f"hf_config: expected MLA fields {missing} (a DeepSeek-V2/V3 or Kimi K2 config), "
                             f"got model_type {c.get('model_type')!r} without them")
        rope = dict(c.get("rope_parameters") or {})
        legacy = c.get("rope_scaling") or {}
        if legacy and not rope.get("factor"):
            rope.update(legacy)
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
        scaling = None
        if rope_type == "yarn":
            factor = rope.get("factor")
            original = rope.get("original_max_position_embeddings")
            if original is None:
                raise ValueError("rope_scaling: expected original_max_position_embeddings for YaRN")
            if factor is None:   # transformers' rule for configs without a factor
                if c.get("max_position_embeddings") is None:
                    raise ValueError("rope_scaling: expected a YaRN factor, or max_position_embeddings to derive it")
                factor = c["max_position_embeddings"] / original
            scaling = RopeScaling(
                factor=float(factor), original_max_position_embeddings=int(original),
                beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                mscale=rope.get("mscale"), mscale_all_dim=rope.get("mscale_all_dim"),
                attention_factor=rope.get("attention_factor"), truncate=bool(rope.get("truncate", True)))
        elif rope_type != "default":
            raise ValueError(f"rope_scaling: expected type 'yarn' or 'default', got {rope_type!r}")
        llama4 = c.get("llama_4_scaling")
        if llama4 is not None and not isinstance(llama4, Mapping):
            llama4 = vars(llama4)
        interleave = c.get("rope_interleave")
        return cls(
            hidden_size=c["hidden_size"], num_heads=c["num_attention_heads"], q_lora_rank=c.get("q_lora_rank"),
            kv_lora_rank=c["kv_lora_rank"], qk_nope_head_dim=c["qk_nope_head_dim"],
            qk_rope_head_dim=c["qk_rope_head_dim"], v_head_dim=c["v_head_dim"],
            max_position_embeddings=c.get("max_position_embeddings") or 4096, rope_theta=float(theta),
            rope_scaling=scaling, rope_interleave=True if interleave is None else bool(interleave),
            attention_bias=bool(c.get("attention_bias", False)),
            temperature_floor_scale=(float(llama4.get("original_max_position_embeddings", 8192))
                                     if llama4 is not None else None),
            temperature_beta=float(llama4.get("beta", 0.1)) if llama4 is not None else 0.1,
            name=str(c.get("_name_or_path") or c.get("model_type") or "custom"))

    @classmethod
    def preset(cls, name: str) -> "MLAConfig":
        """Published attention dimensions: deepseek-v3, deepseek-v2, deepseek-v2-lite, kimi-k2, tiny."""
        if name not in PRESETS:
            raise ValueError(f"name: expected one of {sorted(PRESETS)}, got {name!r}")
        return dataclasses.replace(PRESETS[name], name=name)


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
