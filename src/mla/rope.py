"""Rotary position embedding for the decoupled RoPE part of MLA (q_pe, k_pe).

Angles are computed in float32 from ``inv_freq`` for the positions of the step,
exactly as transformers does (position * inv_freq, then cos/sin, times the YaRN or
LongRoPE cos/sin scale). Pairing is DeepSeek's interleaved (2i, 2i+1) or neox (i, i + dr/2);
the rotated tensor keeps its input layout, so queries and keys always agree.
"""
from __future__ import annotations

import math

import torch

from .config import MLAConfig

__all__ = ["inv_freq", "cos_sin", "longrope_freqs", "apply_rope", "query_temperature"]


def inv_freq(cfg: MLAConfig) -> torch.Tensor:
    """[dr / 2] float32 inverse frequencies (default RoPE, or YaRN's per-frequency ramp); zeros
    for NoPE, so that every angle is 0 and the rotation is the identity (cos 1, sin 0, exactly).
    LongRoPE: [2, dr / 2], the short factors' frequencies, then the long ones' (``cos_sin``
    picks one row per step)."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    if cfg.rope_type == "none":
        return torch.zeros(dim // 2, dtype=torch.float32)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if cfg.longrope is not None:
        factors = torch.tensor((cfg.longrope.short_factor, cfg.longrope.long_factor), dtype=torch.float32)
        return 1.0 / (factors * pos_freqs)
    s = cfg.rope_scaling
    if s is None:
        return 1.0 / pos_freqs

    def correction_dim(rotations: float) -> float:
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:   # transformers and DeepSeek floor and ceil the ramp's bounds
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp   # 1: extrapolate (high frequencies kept), 0: interpolate by `factor`
    return (1.0 / (s.factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def cos_sin(cfg: MLAConfig, positions: torch.Tensor, freqs: torch.Tensor | None = None):
    """cos, sin [T, dr / 2] float32 for the integer positions [T] of one step, times YaRN's or
    LongRoPE's cos/sin scale."""
    if freqs is None:
        freqs = inv_freq(cfg)
    freqs = freqs.to(positions.device)
    scale = 1.0
    if cfg.longrope is not None:
        freqs, scale = longrope_freqs(cfg, positions, freqs), cfg.longrope.cos_sin_scale
    elif cfg.rope_scaling is not None:
        scale = cfg.rope_scaling.cos_sin_scale
    angles = positions.to(torch.float32)[:, None] * freqs[None, :]
    return angles.cos() * scale, angles.sin() * scale


def longrope_freqs(cfg: MLAConfig, positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """The LongRoPE frequencies [dr / 2] of one step from ``inv_freq``'s [2, dr / 2]: the long
    factors' once the step's largest position + 1 exceeds original_max_position_embeddings,
    else the short ones', as transformers decides for one forward call (from its position_ids'
    maximum; keys already cached keep the rotation they were written with). Chosen on the
    device, so a step stays free of host syncs (a CUDA graph replays the choice)."""
    if positions.numel() == 0:
        return freqs[0]
    long = positions.max() + 1 > cfg.longrope.original_max_position_embeddings
    return torch.where(long, freqs[1], freqs[0])


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate x [T, ..., dr] by cos/sin [T, dr / 2] in float32; returns x's dtype and layout."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    xf = x.float()
    if interleave:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2).to(x.dtype)
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def query_temperature(cfg: MLAConfig, positions: torch.Tensor) -> torch.Tensor | None:
    """Llama-4 style per-position query scale [T] float32, or None when the config has none:
    log(floor(p / floor_scale) + 1) * beta + 1 at position p, as Mistral 4's module computes it."""
    if cfg.temperature_floor_scale is None:
        return None
    floor = torch.floor(positions.to(torch.float32) / cfg.temperature_floor_scale)
    return torch.log(floor + 1.0) * cfg.temperature_beta + 1.0
