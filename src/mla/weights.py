"""Hugging Face checkpoint names -> the layer's parameters.

The one place that knows checkpoint layouts:

- ``kv_b_proj.weight`` is [H * (dn + dv), r], grouped by head: for each head, dn rows of
  K then dv rows of V. ``split_kv_b`` turns it into W_UK [H, dn, r] and W_UV [H, dv, r].
- FP8 checkpoints (DeepSeek-V3, Kimi K2) store ``weight`` as float8_e4m3fn with a
  ``weight_scale_inv`` [ceil(out/128), ceil(in/128)] (float32, or ue8m0 powers of two):
  block (i, j) dequantizes as w * scale.
"""
from __future__ import annotations

from typing import Collection, Mapping

import torch

from .config import MLAConfig
from .quant import scale_to_float

__all__ = ["hf_weight_shapes", "read_hf_weights", "split_kv_b", "dequant_block_fp8", "quantize_block_fp8",
           "quantize_checkpoint_fp8"]

FP8_BLOCK = 128


def hf_weight_shapes(cfg: MLAConfig, layer_idx: int = 0) -> dict[str, tuple[int, ...]]:
    """Expected shape of every tensor of one attention layer, by HF name (no prefix). With a
    sparse indexer (DeepSeek-V3.2, GLM-5) the layer's ``indexer.*`` tensors too (with the k-pool
    indexer also ``index_kpool_compress_gate`` [d, D] and ``_ape`` [index_kpool, d]), unless the
    layer reuses an earlier layer's top-k (GLM-5's "shared" layers have no indexer); with attention sinks
    ``sinks`` [H], with an output gate ``gate_proj.weight`` [H * dv, D] (Hy4); with q_gate_fused
    ``q_gate_proj.weight`` [H * (dn + dr + dv), 2 * rq] instead of q_b_proj and gate_proj (A.X-K2)."""
    H, D = cfg.num_heads, cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {}
    if cfg.q_lora_rank is None:
        shapes["q_proj.weight"] = (H * cfg.qk_head_dim, D)
    else:
        shapes["q_a_proj.weight"] = (cfg.q_lora_rank, D)
        shapes["q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        if cfg.q_gate_fused:   # A.X-K2: per head qk_head_dim query rows then dv gate rows
            shapes["q_gate_proj.weight"] = (H * (cfg.qk_head_dim + cfg.v_head_dim), 2 * cfg.q_lora_rank)
        else:
            shapes["q_b_proj.weight"] = (H * cfg.qk_head_dim, cfg.q_lora_rank)
    shapes["kv_a_proj_with_mqa.weight"] = (cfg.kv_dim, D)
    shapes["kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
    shapes["kv_b_proj.weight"] = (H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
    shapes["o_proj.weight"] = (D, H * cfg.v_head_dim)
    if cfg.attention_bias:
        if cfg.q_lora_rank is not None:
            shapes["q_a_proj.bias"] = (cfg.q_lora_rank,)
        shapes["kv_a_proj_with_mqa.bias"] = (cfg.kv_dim,)
        shapes["o_proj.bias"] = (D,)
    if cfg.has_indexer and layer_idx not in cfg.index_shared_layers:
        n, d = cfg.index_n_heads, cfg.index_head_dim
        shapes["indexer.wq_b.weight"] = (n * d, cfg.q_lora_rank)   # reads the normed q latent
        shapes["indexer.wk.weight"] = (d, D)
        shapes["indexer.k_norm.weight"] = (d,)                     # a LayerNorm: weight and bias
        shapes["indexer.k_norm.bias"] = (d,)
        shapes["indexer.weights_proj.weight"] = (n, D)
        if cfg.index_kpool is not None:                            # GLM-5.3-Flash's pool gate
            shapes["indexer.index_kpool_compress_gate"] = (d, D)
            shapes["indexer.index_kpool_compress_ape"] = (cfg.index_kpool, d)
    if cfg.attention_sinks:
        shapes["sinks"] = (H,)                                     # one logit per head (Hy4)
    if cfg.output_gate is not None and not cfg.q_gate_fused:
        shapes["gate_proj.weight"] = (H * cfg.v_head_dim, D)       # per head: dv gate values
    return shapes


def _check_scale(weight: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK) -> None:
    expected = (-(-weight.shape[0] // block), -(-weight.shape[1] // block))
    if not isinstance(scale_inv, torch.Tensor) or tuple(scale_inv.shape) != expected:
        got = tuple(scale_inv.shape) if isinstance(scale_inv, torch.Tensor) else type(scale_inv).__name__
        raise ValueError(f"weight_scale_inv: expected shape {expected} for a weight of shape "
                         f"{tuple(weight.shape)}, got {got}")


def dequant_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """float8 weight [out, in] with scale [ceil(out/block), ceil(in/block)] -> float32 [out, in].

    Each block x block tile is multiplied by its scale; tiles past the edge are partial.
    """
    out_f, in_f = weight.shape
    _check_scale(weight, scale_inv, block)
    s = scale_to_float(scale_inv).repeat_interleave(block, 0)[:out_f].repeat_interleave(block, 1)[:, :in_f]
    return weight.float() * s


def quantize_block_fp8(weight: torch.Tensor, ue8m0: bool = False, block: int = FP8_BLOCK):
    """The inverse of dequant_block_fp8, as DeepSeek's FP8 checkpoints are made: float weight
    [out, in] -> (float8_e4m3fn [out, in], scale [ceil(out/block), ceil(in/block)]), each block
    scaled by amax / 448. ``ue8m0``: scales rounded up to powers of two, stored as uint8
    exponents with bias 127."""
    out_f, in_f = weight.shape
    bo, bi = -(-out_f // block), -(-in_f // block)
    padded = weight.new_zeros(bo * block, bi * block, dtype=torch.float32)
    padded[:out_f, :in_f] = weight
    tiles = padded.view(bo, block, bi, block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (tiles / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    q = q.view(bo * block, bi * block)[:out_f, :in_f].contiguous()
    return q, ((torch.log2(scale) + 127).to(torch.uint8) if ue8m0 else scale)


def quantize_checkpoint_fp8(sd: dict[str, torch.Tensor], ue8m0: bool = False) -> dict[str, torch.Tensor]:
    """A float state dict made into an FP8 checkpoint as DeepSeek ships them: every 2-D
    ``*weight`` -> block FP8 (``quantize_block_fp8``) with its ``*weight_scale_inv`` beside it;
    other tensors (norms, biases) as they are."""
    out = {}
    for name, t in sd.items():
        if t.dim() == 2 and name.endswith("weight"):
            out[name], out[name + "_scale_inv"] = quantize_block_fp8(t, ue8m0)
        else:
            out[name] = t
    return out


def read_hf_weights(cfg: MLAConfig, sd: Mapping[str, torch.Tensor], prefix: str = "",
                    keep_fp8: Collection[str] = (), strict: bool = True, layer_idx: int = 0
                    ) -> dict[str, torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
    """Every tensor of one layer from a state dict, checked and dequantized (float32 where FP8),
    except the names in ``keep_fp8`` stored as float8_e4m3fn: those come as they are stored,
    (weight, float32 block scales), ue8m0 scales turned to float32. LongCat's latent scales
    (``cfg.q_lora_scale``, ``cfg.kv_lora_scale``) are folded into q_b_proj and kv_a_layernorm.

    Raises ValueError naming the first missing or mis-shaped tensor and, with ``strict``, every
    tensor under ``prefix`` that the layer does not use (an indexer, a gate, sinks, a bias the
    config does not have: loading without them would compute another attention), before
    anything is loaded. ``strict=False`` skips such extras on purpose.
    """
    out, used = {}, set()
    for name, shape in hf_weight_shapes(cfg, layer_idx).items():
        key = prefix + name
        if key not in sd:
            raise ValueError(f"state dict: expected tensor {key!r} of shape {shape}, it is missing")
        t = sd[key]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"state dict: expected {key!r} of shape {shape}, got {got}")
        if t.is_meta:
            raise ValueError(f"state dict: expected {key!r} with data, got a meta tensor")
        used.add(key)
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            scale_key = key[: -len("weight")] + "weight_scale_inv"
            if scale_key not in sd:
                raise ValueError(f"state dict: expected {scale_key!r} beside the FP8 tensor {key!r}")
            scale = sd[scale_key]
            if not isinstance(scale, torch.Tensor) or scale.is_meta:
                raise ValueError(f"state dict: expected {scale_key!r} to be a tensor with data, got "
                                 f"{type(scale).__name__ if not isinstance(scale, torch.Tensor) else 'a meta tensor'}")
            used.add(scale_key)
            if name in keep_fp8 and t.dtype == torch.float8_e4m3fn:
                _check_scale(t, scale)
                t = (t, scale_to_float(scale).float())
            else:
                t = dequant_block_fp8(t, scale)
        elif not t.is_floating_point():
            raise ValueError(f"state dict: expected a floating-point {key!r}, got {t.dtype}")
        out[name] = t
    if strict:
        unused = sorted(k for k in sd if isinstance(k, str) and k.startswith(prefix) and k not in used)
        if unused:
            raise ValueError(f"state dict: {len(unused)} tensor(s) under prefix {prefix!r} that this layer does not "
                             f"use: {unused[:8]} (pass strict=False to skip them on purpose)")
    return _fold_latent_scales(cfg, out)


def _fold_latent_scales(cfg: MLAConfig, w: dict) -> dict:
    """LongCat's q *= sqrt(D / rq) into q_b_proj (its block scales where it stays FP8) and
    c_kv *= sqrt(D / r) into kv_a_layernorm's weight: the attention then runs unchanged."""
    if cfg.q_lora_scale != 1.0:
        q_b = w["q_b_proj.weight"]
        w["q_b_proj.weight"] = (q_b[0], q_b[1] * cfg.q_lora_scale) if isinstance(q_b, tuple) \
            else q_b.float() * cfg.q_lora_scale
    if cfg.kv_lora_scale != 1.0:
        w["kv_a_layernorm.weight"] = w["kv_a_layernorm.weight"].float() * cfg.kv_lora_scale
    return w


def split_kv_b(kv_b_weight: torch.Tensor, num_heads: int, qk_nope_head_dim: int, v_head_dim: int):
    """kv_b_proj.weight [H * (dn + dv), r] -> (W_UK [H, dn, r], W_UV [H, dv, r]), views."""
    w = kv_b_weight.view(num_heads, qk_nope_head_dim + v_head_dim, -1)
    return w[:, :qk_nope_head_dim], w[:, qk_nope_head_dim:]
