"""MLA configuration: a frozen dataclass read from a Hugging Face config, and presets.

Notation (DeepSeek-V2 paper): hidden D, heads H, q_lora_rank rq (None for "lite"
models), kv_lora_rank r, qk_nope_head_dim dn, qk_rope_head_dim dr, v_head_dim dv.

``from_hf`` reads every MLA family transformers ships (``families.py`` knows how). What a
family's attention does beyond DeepSeek-V3's is either a field here (RoPE pairing and type: YaRN
or MiniCPM3's LongRoPE; a query temperature, LongCat's latent scales, the layers that are MLA,
the sparse indexer (DeepSeek's, or GLM-5.3-Flash's k-pool indexer), Hy4's attention sinks and
output gate, A.X-K2's fused q and gate projection) or refused with ``NotImplementedError``
naming the feature and the ``model_type``.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from . import families
from .families import is_real

__all__ = ["MLAConfig", "RopeScaling", "LongRope", "yarn_mscale"]


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
            if not is_real(v) or not 0 < v < math.inf:
                raise ValueError(f"rope_scaling.{name}: expected a finite number > 0, got {v!r}")
        for name in ("mscale", "mscale_all_dim", "attention_factor"):
            v = getattr(self, name)
            if v is not None and (not is_real(v) or not 0 <= v < math.inf):
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


@dataclass(frozen=True)
class LongRope:
    """LongRoPE parameters (MiniCPM3): the default RoPE frequencies divided per frequency by
    ``short_factor`` or ``long_factor`` (dr / 2 values each), cos and sin times
    ``attention_factor``. Which factors a step takes follows transformers' rule for one forward
    call: the long ones once the step's largest position + 1 exceeds
    original_max_position_embeddings (``rope.cos_sin``). Keys keep the rotation of the step that
    wrote them, as in transformers' KV cache."""
    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float = 1.0

    def __post_init__(self):
        for name in ("short_factor", "long_factor"):
            v = getattr(self, name)
            if not isinstance(v, tuple) or not v or not all(is_real(x) and 0 < x < math.inf for x in v):
                raise ValueError(f"longrope.{name}: expected a non-empty tuple of finite numbers > 0, got {v!r}"[:200])
        if len(self.short_factor) != len(self.long_factor):
            raise ValueError(f"longrope.long_factor: expected {len(self.short_factor)} values (as short_factor), "
                             f"got {len(self.long_factor)}")
        o = self.original_max_position_embeddings
        if not isinstance(o, int) or isinstance(o, bool) or o <= 0:
            raise ValueError(f"longrope.original_max_position_embeddings: expected a positive int, got {o!r}")
        a = self.attention_factor
        if not is_real(a) or not 0 <= a < math.inf:
            raise ValueError(f"longrope.attention_factor: expected a finite number >= 0, got {a!r}")

    @property
    def cos_sin_scale(self) -> float:
        """The factor cos and sin are multiplied by."""
        return float(self.attention_factor)


ROPE_TYPES = ("default", "yarn", "longrope", "none")
OUTPUT_GATES = (None, "sigmoid")


@dataclass(frozen=True)
class MLAConfig:
    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int               # 0: no RoPE part (GLM-5.3-Flash); a cache row is c_kv alone
    v_head_dim: int
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # "default", "yarn" (with rope_scaling), "longrope" (with longrope) or "none" (NoPE: q_pe and
    # k_pe stay unrotated, as in Kimi Linear); None derives it from rope_scaling and longrope
    rope_type: str | None = None
    longrope: LongRope | None = None    # MiniCPM3's LongRoPE factors
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
    # Hy4's indexer rotates the *last* qk_rope_head_dim values of its head (DeepSeek-V3.2 and
    # GLM-5 the first)
    index_rope_last: bool = False
    # GLM-5.3-Flash's k-pool indexer (mla.kpool), no RoPE in it: the cache keeps per token the
    # index row [k | gate] (gate = x @ index_kpool_compress_gate^T); pools of index_kpool
    # consecutive tokens (from the sequence's first) are scored by their pooled key
    # sum_i softmax_i(gate_i + index_kpool_compress_ape_i) * k_i, each query keeps the
    # index_topk / index_kpool best complete pools it sees and the tokens of its open pool.
    # None: DeepSeek's indexer (a score per key).
    index_kpool: int | None = None
    # Attention sinks (Hy4): one learnable logit per head (checkpoint tensor ``sinks`` [H]) in the
    # softmax's denominator, FlashMLA's attn_sink. Only the sparse ops take a sink, so a config
    # with sinks needs a sparse indexer and every sequence takes the sparse path (up to
    # index_topk keys the top-k selects every key: the same attention as the dense paths).
    attention_sinks: bool = False
    # The output gate applied per head to the attention output before o_proj (mla.projections):
    # None, or "sigmoid": attn * sigmoid(gate_proj(x)), gate_proj.weight [H * dv, D] (Hy4); with
    # q_gate_fused the logits are q_gate_proj's gate half instead (A.X-K2)
    output_gate: str | None = None
    # A.X-K2: no q_b_proj; one q_gate_proj [H * (dn + dr + dv), 2 * rq] over cat(q_a_norm(q_a), q_a)
    # gives per head the query then the output gate's logits (needs output_gate "sigmoid")
    q_gate_fused: bool = False
    name: str = field(default="custom", compare=False)

    def __post_init__(self):
        for f in ("hidden_size", "num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
                  "max_position_embeddings"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{f}: expected a positive int, got {v!r}")
        dr = self.qk_rope_head_dim
        if not isinstance(dr, int) or isinstance(dr, bool) or dr < 0:
            raise ValueError(f"qk_rope_head_dim: expected an int >= 0 (0: no RoPE part, GLM-5.3-Flash), got {dr!r}")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or isinstance(self.q_lora_rank, bool)
                                             or self.q_lora_rank <= 0):
            raise ValueError(f"q_lora_rank: expected a positive int or None, got {self.q_lora_rank!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim: expected an even number, got {self.qk_rope_head_dim}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"rope_scaling: expected a RopeScaling or None, got {type(self.rope_scaling).__name__}")
        if self.longrope is not None and not isinstance(self.longrope, LongRope):
            raise ValueError(f"longrope: expected a LongRope or None, got {type(self.longrope).__name__}")
        if self.rope_type is None:
            derived = "longrope" if self.longrope is not None else "default"
            object.__setattr__(self, "rope_type", "yarn" if self.rope_scaling is not None else derived)
        if self.rope_type not in ROPE_TYPES or (self.rope_type == "yarn") != (self.rope_scaling is not None) \
                or (self.rope_type == "longrope") != (self.longrope is not None):
            raise ValueError(f"rope_type: expected one of {ROPE_TYPES}, 'yarn' exactly when rope_scaling is set and "
                             f"'longrope' exactly when longrope is, got {self.rope_type!r} with "
                             f"rope_scaling={self.rope_scaling}, longrope={self.longrope}")
        if self.longrope is not None and 2 * len(self.longrope.short_factor) != dr:
            raise ValueError(f"longrope.short_factor: expected qk_rope_head_dim / 2 = {dr // 2} values (one a "
                             f"frequency), got {len(self.longrope.short_factor)}")
        for f in ("rope_theta", "q_norm_eps", "kv_norm_eps", "q_lora_scale", "kv_lora_scale", "temperature_beta"):
            v = getattr(self, f)
            if not is_real(v) or not 0 < v < math.inf:
                raise ValueError(f"{f}: expected a finite number > 0, got {v!r}")
        t = self.temperature_floor_scale
        if t is not None and (not is_real(t) or not 0 < t < math.inf):
            raise ValueError(f"temperature_floor_scale: expected a finite number > 0 or None, got {t!r}")
        if not isinstance(self.rope_interleave, bool) or not isinstance(self.attention_bias, bool):
            raise ValueError(f"rope_interleave, attention_bias: expected bools, got {self.rope_interleave!r}, "
                             f"{self.attention_bias!r}")
        if self.q_lora_scale != 1.0 and self.q_lora_rank is None:
            raise ValueError("q_lora_scale: expected 1.0 without a q_lora_rank (it scales q_b_proj's output)")
        if self.output_gate not in OUTPUT_GATES:
            raise ValueError(f"output_gate: expected one of {OUTPUT_GATES}, got {self.output_gate!r}")
        if not isinstance(self.attention_sinks, bool) or not isinstance(self.index_rope_last, bool):
            raise ValueError(f"attention_sinks, index_rope_last: expected bools, got {self.attention_sinks!r}, "
                             f"{self.index_rope_last!r}")
        if not isinstance(self.q_gate_fused, bool):
            raise ValueError(f"q_gate_fused: expected a bool, got {self.q_gate_fused!r}")
        if self.q_gate_fused and (self.q_lora_rank is None or self.output_gate != "sigmoid"
                                  or self.q_lora_scale != 1.0):
            raise ValueError("q_gate_fused: expected a q_lora_rank, output_gate 'sigmoid' and q_lora_scale 1.0 "
                             f"with it, got {self.q_lora_rank!r}, {self.output_gate!r}, {self.q_lora_scale!r}")
        if self.attention_sinks and self.index_topk is None:
            raise ValueError("attention_sinks: expected a sparse indexer (index_topk) with them: only the sparse "
                             "path takes a sink")
        m = self.mla_layers
        if m is not None and (not isinstance(m, tuple)
                              or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in m)):
            raise ValueError(f"mla_layers: expected a tuple of layer indices >= 0 or None, got {m!r}")
        self._check_indexer()

    def _check_indexer(self) -> None:
        if self.index_topk is None:
            if self.index_kpool is not None:
                raise ValueError(f"index_kpool: expected None without a sparse indexer (index_topk), got "
                                 f"{self.index_kpool!r}")
            return
        for f in ("index_topk", "index_n_heads", "index_head_dim"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{f}: expected a positive int with index_topk set, got {v!r}")
        if self.q_lora_rank is None:
            raise ValueError("index_topk: the sparse indexer reads the normed q latent: expected a q_lora_rank")
        if self.index_kpool is None and self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(f"index_head_dim: expected >= qk_rope_head_dim ({self.qk_rope_head_dim}: its RoPE part), "
                             f"got {self.index_head_dim}")
        if not isinstance(self.index_rope_interleave, bool):
            raise ValueError(f"index_rope_interleave: expected a bool, got {self.index_rope_interleave!r}")
        if self.index_weights_scale is None:
            object.__setattr__(self, "index_weights_scale", self.index_n_heads ** -0.5)
        for f in ("index_weights_scale", "index_k_norm_eps"):
            v = getattr(self, f)
            if not is_real(v) or not 0 < v < math.inf:
                raise ValueError(f"{f}: expected a finite number > 0, got {v!r}")
        s = self.index_shared_layers
        if not isinstance(s, tuple) or not all(isinstance(i, int) and not isinstance(i, bool) and i > 0 for i in s):
            raise ValueError(f"index_shared_layers: expected a tuple of layer indices > 0 (layer 0 runs its "
                             f"indexer), got {s!r}")
        P = self.index_kpool
        if P is not None and (not isinstance(P, int) or isinstance(P, bool) or P <= 0 or self.index_topk % P):
            raise ValueError(f"index_kpool: expected None or a positive int dividing index_topk ({self.index_topk}: "
                             f"whole pools are selected), got {P!r}")

    @property
    def has_indexer(self) -> bool:
        """Whether the attention is sparse (DeepSeek Sparse Attention)."""
        return self.index_topk is not None

    @property
    def index_row_dim(self) -> int:
        """Values the cache keeps per token for the indexer: its key (index_head_dim), or the
        k-pool indexer's row [k | gate] (2 * index_head_dim)."""
        return self.index_head_dim * (1 if self.index_kpool is None else 2)

    @property
    def sparse_max_keys(self) -> int:
        """The most keys a sparse query attends to: index_topk, or with the k-pool indexer its
        index_topk / index_kpool pools and up to index_kpool - 1 tokens of its open pool. A
        query that sees at most this many keys attends to all of them (with k-pool: all its
        complete pools are selected and the rest is its open pool), so up to this length the
        dense paths give the sparse path's result."""
        return self.index_topk + (0 if self.index_kpool is None else self.index_kpool - 1)

    def index_logits_width(self, num_keys: int) -> int:
        """Columns of the indexer's logits over a sequence of num_keys keys: one a key, or with
        the k-pool indexer one a complete pool."""
        return num_keys if self.index_kpool is None else num_keys // self.index_kpool

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

    def check_layer_idx(self, layer_idx: int) -> None:
        """ValueError naming ``layer_idx`` unless it is an MLA layer of this config."""
        if not isinstance(layer_idx, int) or isinstance(layer_idx, bool) or layer_idx < 0:
            raise ValueError(f"layer_idx: expected an int >= 0, got {layer_idx!r}")
        if self.mla_layers is not None and layer_idx not in self.mla_layers:
            raise ValueError(f"layer_idx: layer {layer_idx} of {self.name!r} is not an MLA layer (its MLA layers: "
                             f"{list(self.mla_layers)})")

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
        ``mla.families``). Raises ValueError for a config without MLA fields or with invalid values, and
        NotImplementedError naming the feature and the model_type for what the library does not
        implement (a sparse indexer outside DeepSeek-V3.2, GLM-5 and Hy4, an output gate or attention
        sinks outside Hy4, a RoPE type)."""
        fields = families.config_fields(hf_config)
        scaling, longrope = fields.pop("rope_scaling"), fields.pop("longrope")
        return cls(rope_scaling=None if scaling is None else RopeScaling(**scaling),
                   longrope=None if longrope is None else LongRope(**longrope), **fields)

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
