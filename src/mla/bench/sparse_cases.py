"""The inputs of ``mla bench sparse``: latent rows, shuffled block tables and top-k indices in
FlashMLA's conventions (``indices`` = block * page + offset, -1 = none). No GPU needed.

Every query token gets ``topk`` distinct random token positions of its sequence's context,
mapped to flat cache slots through the sequence's row of a shuffled block table; every
``HOLE_EVERY``-th query has its last ``HOLES`` entries set to -1, where ``topk_indices`` puts
them for a query that sees fewer keys than topk. Cache rows that no index names hold NaN, so
a kernel that reads a row it was not given shows it in its error.
"""
from __future__ import annotations

import math

import torch

from mla import quant

__all__ = ["R", "DR", "D", "HOLE_EVERY", "HOLES", "random_positions", "slots", "punch_holes", "nan_unindexed",
           "store_rows", "decode_cache", "decode_case", "prefill_case", "indexer_case"]

R, DR = 512, 64        # DeepSeek-V3.2: kv_lora_rank, qk_rope_head_dim (FlashMLA's only sparse dims)
D = R + DR
HOLE_EVERY, HOLES = 7, 5
QUANT_CHUNK = 1 << 20  # rows quantized at once: bounds the float32 copy quantize_rows makes


def _generator(device, *shape: int) -> torch.Generator:
    """A generator seeded by the shape, so every run and tree sees the same values on a device."""
    seed = 0
    for n in shape:
        seed = (seed * 1_000_003 + n) % (1 << 62)
    return torch.Generator(device=device).manual_seed(seed)


def random_positions(n: int, context: int, topk: int, g: torch.Generator) -> torch.Tensor:
    """[n, topk] int64: for each of n queries, topk distinct positions in [0, context), in random
    order (the top-k of uniform noise: distinct by construction)."""
    noise = torch.rand(n, context, generator=g, device=g.device)
    return noise.topk(topk, dim=-1).indices


def slots(positions: torch.Tensor, block_table: torch.Tensor, page: int) -> torch.Tensor:
    """Token positions [B, ..., topk] of sequence b -> flat slots (int32, same shape):
    block_table[b, s // page] * page + s % page."""
    B = positions.shape[0]
    flat = positions.reshape(B, -1)
    blocks = torch.gather(block_table.long(), 1, flat // page)
    return (blocks * page + flat % page).to(torch.int32).view(positions.shape)


def punch_holes(indices: torch.Tensor, every: int = HOLE_EVERY, holes: int = HOLES) -> torch.Tensor:
    """indices [..., topk] with the last ``holes`` entries of every ``every``-th query (query
    q of the flattened leading dims, q % every == every - 1) set to -1; in place, returned."""
    rows = indices.view(-1, indices.shape[-1])
    rows[every - 1::every, max(0, rows.shape[1] - holes):] = -1
    return indices


def nan_unindexed(rows: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """rows [N, d] with NaN in every row no entry of ``indices`` names (-1 names none); in place."""
    used = torch.zeros(rows.shape[0], dtype=torch.bool, device=rows.device)
    idx = indices.flatten().long()
    used[idx[idx >= 0]] = True
    rows[~used] = float("nan")
    return rows


def store_rows(rows: torch.Tensor, kv_format: str) -> torch.Tensor:
    """bf16 latent rows [N, R + DR] -> stored rows: as they are ("bf16"), per-tensor FP8 rows
    ("fp8", float8_e4m3fn [N, 576], scale 1) or FlashMLA's 656-byte FP8 rows ("fp8_tile", uint8
    [N, 656]), quantized by ``mla.quant`` in chunks."""
    if kv_format == "bf16":
        return rows
    out = torch.empty(rows.shape[0], quant.row_width(kv_format, R, DR), device=rows.device,
                      dtype=quant.storage_dtype(kv_format, rows.dtype))
    for i in range(0, rows.shape[0], QUANT_CHUNK):
        out[i:i + QUANT_CHUNK] = quant.quantize_rows(rows[i:i + QUANT_CHUNK], kv_format, R)
    return out


def decode_cache(B: int, context: int, page: int, s_q: int, topk: int, kv_format: str, device="cuda") -> dict:
    """What every decode shape of one (B, format) shares: a cache of B * ceil(context / page)
    blocks of ``page`` rows (bf16 or e4m3 [blocks, page, 576], uint8 [blocks, page, 656]), the shuffled
    block table [B, ceil(context / page)] int32 and indices [B, s_q, topk] int32 (fewer query
    tokens take the first ones). Rows no index names are NaN."""
    g = _generator(device, B, context, page, s_q, topk)
    per_seq = math.ceil(context / page)
    table = torch.randperm(B * per_seq, generator=g, device=device).to(torch.int32).view(B, per_seq)
    pos = random_positions(B * s_q, context, topk, g).view(B, s_q, topk)
    indices = punch_holes(slots(pos, table, page))
    rows = torch.randn(B * per_seq * page, D, generator=g, device=device, dtype=torch.bfloat16)
    kv = store_rows(nan_unindexed(rows, indices), kv_format)
    return dict(B=B, context=context, page=page, topk=topk, kv_format=kv_format, table=table, indices=indices,
                kv=kv.view(B * per_seq, page, -1))


def decode_case(cache: dict, H: int, s_q: int) -> dict:
    """One decode shape over ``cache`` (``decode_cache``): q [B, s_q, H, 576] bf16, the first s_q
    query tokens' indices [B, s_q, topk], scale 1 / sqrt(128 + 64) (DeepSeek's absorbed scale)."""
    B = cache["B"]
    g = _generator(cache["kv"].device, B, H, s_q, cache["topk"])
    q = torch.randn(B, s_q, H, D, generator=g, device=g.device, dtype=torch.bfloat16)
    return dict(cache, H=H, s_q=s_q, q=q, indices=cache["indices"][:, :s_q].contiguous(),
                scale=1 / math.sqrt(128 + DR))


def prefill_case(H: int, s_q: int, s_kv: int, topk: int, device="cuda") -> dict:
    """q [s_q, H, 576] and kv [s_kv, 1, 576] bf16, indices [s_q, 1, topk] int32: topk distinct
    random rows of kv per query (no causal structure), holes as in decode."""
    g = _generator(device, H, s_q, s_kv, topk)
    q = torch.randn(s_q, H, D, generator=g, device=device, dtype=torch.bfloat16)
    indices = punch_holes(random_positions(s_q, s_kv, topk, g).to(torch.int32)).view(s_q, 1, topk)
    kv = nan_unindexed(torch.randn(s_kv, D, generator=g, device=device, dtype=torch.bfloat16), indices)
    return dict(H=H, s_q=s_q, s_kv=s_kv, topk=topk, q=q, kv=kv.view(s_kv, 1, D), indices=indices,
                scale=1 / math.sqrt(128 + DR))


def indexer_case(B: int, K: int, n_heads: int, head_dim: int, page: int, device="cuda") -> dict:
    """The lightning indexer's inputs for B decode queries (one each) over K cached keys per
    sequence: q [B, n_heads, head_dim] bf16, weights [B, n_heads] float32, index keys
    [B * ceil(K / page), page, head_dim] bf16 behind a shuffled block table [B, ceil(K / page)],
    cache_seqlens [B] = K, cu_seqlens_q [B + 1] = 0, 1, .., B; scale head_dim^-0.5."""
    g = _generator(device, B, K, n_heads, head_dim, page)
    per_seq = math.ceil(K / page)
    table = torch.randperm(B * per_seq, generator=g, device=device).to(torch.int32).view(B, per_seq)
    return dict(B=B, K=K, n_heads=n_heads, head_dim=head_dim, page=page, table=table,
                q=torch.randn(B, n_heads, head_dim, generator=g, device=device, dtype=torch.bfloat16),
                weights=torch.randn(B, n_heads, generator=g, device=device) * n_heads ** -0.5,
                keys=torch.randn(B * per_seq, page, head_dim, generator=g, device=device, dtype=torch.bfloat16),
                seqlens=torch.full((B,), K, dtype=torch.int32, device=device),
                cu_seqlens_q=torch.arange(B + 1, dtype=torch.int32, device=device), scale=head_dim ** -0.5)
