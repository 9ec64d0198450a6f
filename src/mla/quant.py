"""FP8 formats: the latent cache rows and the block-scaled checkpoint weights.

Latent cache rows (one per token, r = kv_lora_rank, dr = qk_rope_head_dim):

- "bf16" (and fp16/fp32): [c_kv | k_pe] in the cache dtype, 2 * (r + dr) bytes in bf16 (1152).
- "fp8": float8_e4m3fn [c_kv | k_pe] with one per-tensor scale ``kv_scale`` (value = fp8 * kv_scale),
  r + dr bytes (576). The scale comes from calibration (a checkpoint's k_scale) or stays 1.0.
- "fp8_tile": the row of FlashMLA's FP8 cache (DeepSeek-V3.2), uint8 storage, byte by byte:
      [0, r)                 c_kv as float8_e4m3fn, tile t of 128 values scaled by scales[t]
      [r, r + 4 * r/128)     r/128 float32 scales (little endian), amax(tile) / 448
      [.., + 2 * dr)         k_pe as bfloat16, unquantized (RoPE is sensitive to rounding)
  656 bytes for r = 512, dr = 64.

Non-finite values (the rule of every backend, ``quantize_rows`` and the kernels of
``mla.ops.rope_append`` / ``quantize_act_1x128`` alike): NaN stays NaN, as a bf16 cache would keep
it, so attention over the row gives NaN rather than invented finite values. In "fp8" rows +-inf
saturate to +-448 (e4m3fn has no inf) and NaN is stored as NaN (0x7F); in "fp8_tile" rows a tile
holding a NaN or an inf has a NaN or inf scale, so the whole tile reads back as NaN.

Indexer keys (DeepSeek Sparse Attention), d = index_head_dim:

- "bf16" (or the cache's float dtype): [d] as they are (transformers keeps them so).
- "fp8" / "fp8_ue8m0": DeepSeek's production indexer cache, uint8 storage, byte by byte:
      [0, d)                 H k as float8_e4m3fn, group g of 128 values (all d if fewer)
                             scaled by scales[g]; H the orthonormal d x d Hadamard matrix
      [d, d + 4 * groups)    the groups' float32 scales, amax / 448 ("fp8_ue8m0": rounded up
                             to a power of two, as DeepSeek's reference does)
  132 bytes for d = 128. The queries get the same rotation and quantization (``fake_quant``):
  H is orthonormal, so q . k is unchanged before rounding, and the rotation spreads outliers
  over the group before the 1-byte rounding.

Checkpoint weights: float8_e4m3fn [out, in] with ``weight_scale_inv`` [ceil(out/128),
ceil(in/128)]: float32 (DeepSeek-V3) or power-of-two "ue8m0" (float8_e8m0fnu, or uint8
exponents with bias 127); each 128 x 128 block dequantizes as w * scale.
"""
from __future__ import annotations

from functools import lru_cache

import torch

__all__ = ["FP8", "FP8_MAX", "TILE", "CACHE_FORMATS", "cache_format", "row_width", "storage_dtype", "quantize_rows",
           "dequantize_rows", "scale_to_float", "INDEX_FORMATS", "index_width", "hadamard", "quantize_index",
           "dequantize_index", "fake_quant", "rotate"]

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
TILE = 128
CACHE_FORMATS = ("plain", "fp8", "fp8_tile")


def cache_format(kv_cache: torch.Tensor) -> str:
    """The format of a cache's rows, from its dtype: "plain" (rows in a float dtype), "fp8"
    (float8_e4m3fn, per-tensor scale) or "fp8_tile" (uint8 rows of the FP8 tile layout above)."""
    if kv_cache.dtype == FP8:
        return "fp8"
    if kv_cache.dtype == torch.uint8:
        return "fp8_tile"
    return "plain"


def row_width(fmt: str, r: int, dr: int) -> int:
    """Elements per stored row (bytes for the fp8 formats)."""
    if fmt == "fp8_tile":
        return r + 4 * (r // TILE) + 2 * dr
    return r + dr


def storage_dtype(fmt: str, dtype: torch.dtype) -> torch.dtype:
    return {"plain": dtype, "fp8": FP8, "fp8_tile": torch.uint8}[fmt]


def quantize_rows(rows: torch.Tensor, fmt: str, r: int, kv_scale: float = 1.0) -> torch.Tensor:
    """Latent rows [N, r + dr] (any float dtype) -> stored rows in the format."""
    # divisions by tensors: PyTorch on CUDA multiplies by the reciprocal of a scalar divisor, which
    # is not correctly rounded; the kernels (mla.ops.rope_append) divide exactly, like the CPU
    if fmt == "fp8":
        x = rows.float()
        return (x / torch.full_like(x, kv_scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    if fmt != "fp8_tile":
        raise ValueError(f"fmt: expected 'fp8' or 'fp8_tile', got {fmt!r}")
    N = rows.shape[0]
    tiles = rows[:, :r].float().view(N, r // TILE, TILE)
    amax = tiles.abs().amax(-1).clamp_min(1e-12)
    scales = amax / torch.full_like(amax, FP8_MAX)                      # [N, r/128] float32
    q = (tiles / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(N, r)
    return torch.cat((q.view(torch.uint8), scales.contiguous().view(torch.uint8).view(N, -1),
                      rows[:, r:].to(torch.bfloat16).contiguous().view(torch.uint8).view(N, -1)), -1)


def dequantize_rows(stored: torch.Tensor, fmt: str, r: int, dtype: torch.dtype = torch.float32,
                    kv_scale: float = 1.0) -> torch.Tensor:
    """Stored rows [N, W] -> latent rows [N, r + dr] in ``dtype``; the scale is applied here, once."""
    if fmt == "plain":
        return stored.to(dtype)
    if fmt == "fp8":
        return (stored.float() * kv_scale).to(dtype)
    N = stored.shape[0]
    n_tiles = r // TILE
    c = stored[:, :r].contiguous().view(FP8).float().view(N, n_tiles, TILE)
    scales = stored[:, r: r + 4 * n_tiles].contiguous().view(torch.float32)
    k_pe = stored[:, r + 4 * n_tiles:].contiguous().view(torch.bfloat16).float()
    return torch.cat(((c * scales[..., None]).view(N, r), k_pe), -1).to(dtype)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """A checkpoint's weight_scale_inv as float32: float32 as is, ue8m0 as 2^(e - 127)."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127.0)
    return scale.float()


# ---------------------------------------------------------------- indexer keys
INDEX_FORMATS = ("fp8", "fp8_ue8m0")


def _groups(d: int) -> int:
    return max(1, d // TILE)


def index_width(d: int) -> int:
    """Bytes of one FP8 indexer key of d values (132 for d = 128)."""
    return d + 4 * _groups(d)


def hadamard(d: int, device=None) -> torch.Tensor:
    """The orthonormal d x d Hadamard matrix (Sylvester's construction, d a power of two), float32."""
    return _hadamard(d, torch.device(device or "cpu"))


@lru_cache(maxsize=None)
def _hadamard(d: int, device: torch.device) -> torch.Tensor:
    # built once per size and device: the indexer rotates its keys and queries in every step
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h / d ** 0.5).to(device)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., d] -> x H in float32 (H symmetric and orthonormal: dot products are kept)."""
    return x.float() @ hadamard(x.shape[-1], x.device)


def _scales(x: torch.Tensor, ue8m0: bool) -> torch.Tensor:
    """x [..., G, g] float32 -> the groups' scales [..., G]: amax / 448, floored at 1e-12 / 448,
    rounded up to a power of two with ``ue8m0`` (NaN and inf stay: the group reads back non-finite)."""
    scale = x.abs().amax(-1).clamp_min(1e-12) / FP8_MAX
    return torch.exp2(torch.ceil(torch.log2(scale))) if ue8m0 else scale


def quantize_index(k: torch.Tensor, fmt: str) -> torch.Tensor:
    """Rotated indexer keys [N, d] (``rotate`` applied) -> stored FP8 rows uint8 [N, index_width(d)]."""
    N, d = k.shape
    G = _groups(d)
    x = k.float().view(N, G, d // G)
    scales = _scales(x, fmt == "fp8_ue8m0")
    q = (x / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(N, d)
    return torch.cat((q.view(torch.uint8), scales.contiguous().view(torch.uint8).view(N, -1)), -1)


def dequantize_index(stored: torch.Tensor, d: int) -> torch.Tensor:
    """Stored FP8 indexer rows uint8 [N, index_width(d)] -> keys [N, d] float32 (still rotated)."""
    N, G = stored.shape[0], _groups(d)
    x = stored[:, :d].contiguous().view(FP8).float().view(N, G, d // G)
    scales = stored[:, d:].contiguous().view(torch.float32)
    return (x * scales[..., None]).view(N, d)


def fake_quant(q: torch.Tensor, fmt: str) -> torch.Tensor:
    """Rotated indexer queries [..., d] quantized as the keys are (per 128 values, e4m3) and read
    back, float32: DeepSeek's reference scores its FP8 queries against its FP8 keys."""
    d = q.shape[-1]
    G = _groups(d)
    x = q.float().unflatten(-1, (G, d // G))
    scales = _scales(x, fmt == "fp8_ue8m0")
    return ((x / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scales[..., None]).flatten(-2)
