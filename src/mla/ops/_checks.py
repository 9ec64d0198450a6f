"""Argument validation of the public ops: each helper raises ``ValueError`` with a message that
names the argument and the expected value, before anything runs."""
from __future__ import annotations

import math

import torch

from .. import quant

FLOAT = (torch.float32, torch.float16, torch.bfloat16)


def check(cond: bool, msg) -> None:
    """ValueError(msg) unless cond; msg a string or a callable that builds it, called only on
    failure (an f-string describing tensors costs microseconds, and an eager decode step runs
    dozens of checks)."""
    if not cond:
        raise ValueError(msg() if callable(msg) else msg)


def check_int_vector(name: str, t: torch.Tensor, length: int | None, device: torch.device) -> None:
    """A 1-D int32 tensor on ``device``, of ``length`` entries (any strides: see ``dense``)."""
    check(isinstance(t, torch.Tensor) and t.dim() == 1 and t.dtype == torch.int32,
           lambda: f"{name}: expected a 1-D int32 tensor, got {describe(t)}")
    check(length is None or t.shape[0] == length, lambda: f"{name}: expected length {length}, got {t.shape[0]}")
    check(t.device == device, lambda: f"{name}: expected device {device}, got {t.device}")


def as_float(name: str, x, positive: bool = False) -> float:
    """A scale as a Python float: any real number (int, float, numpy or 0-d tensor), not a string
    nor a bool (True is a flag, not the scale 1.0); ``positive``: also > 0 (a divisor)."""
    try:
        f = None if isinstance(x, (str, bytes, bool)) else float(x)
    except (TypeError, ValueError, RuntimeError):
        f = None
    ok = f is not None and math.isfinite(f) and (f > 0 or not positive)
    check(ok, lambda: f"{name}: expected a finite real number{' > 0' if positive else ''}, got {x!r}"[:200])
    return f


def check_int(name: str, x, lo: int | None = None, hi: int | None = None) -> None:
    """An int argument: a Python int, not a bool (True would count as 1), in lo..hi."""
    ok = isinstance(x, int) and not isinstance(x, bool) and (lo is None or x >= lo) and (hi is None or x <= hi)
    if not ok:   # the message only on failure: torch.compile cannot repr a traced (symbolic) int
        where = "" if lo is None and hi is None else f" in {'' if lo is None else lo}..{'' if hi is None else hi}"
        raise ValueError(f"{name}: expected an int{where}, got {x!r}"[:200])


def check_flag(name: str, x) -> None:
    """A switch: True or False only (bool("false") and bool(tensor) would silently read as True)."""
    check(isinstance(x, bool), lambda: f"{name}: expected a bool, got {x!r}"[:200])


def check_writable(name: str, t: torch.Tensor) -> None:
    """A tensor an op writes in place: no two elements at one address (an expanded view), where
    the last write would win at random on the GPU."""
    check(torch._debug_has_internal_overlap(t) != 1,
          lambda: f"{name}: expected a tensor without overlapping elements (written in place), got strides "
                  f"{t.stride()}")


def check_apart(name: str, t: torch.Tensor, other_name: str, other: torch.Tensor) -> None:
    """A tensor an op writes while it reads ``other``: the same view (in place), or memory apart
    from it (the byte ranges the two span do not meet), where a program's write could land on
    what another still reads."""
    def span(x):
        if x.numel() == 0:
            return 0, 0
        start = x.data_ptr()
        return start, start + (sum((n - 1) * st for n, st in zip(x.shape, x.stride())) + 1) * x.element_size()

    same = t.data_ptr() == other.data_ptr() and t.shape == other.shape and t.stride() == other.stride()
    (a0, a1), (b0, b1) = span(t), span(other)
    check(same or a1 <= b0 or b1 <= a0,
          lambda: f"{name}: expected {other_name} itself or memory apart from it, got a view that overlaps it")


def dense(t: torch.Tensor) -> torch.Tensor:
    """An index tensor (block table, lengths, offsets, slots, cos/sin) laid out as the kernels
    read it: row-major with unit stride. The kernels take only the row stride of a table, or
    none, so a strided or column-major view is copied (a small device copy: no host sync, and
    capturable in a CUDA graph); a contiguous one is passed as it is."""
    return t.contiguous()


def check_paged_values(block_table, cache_seqlens, num_blocks: int, block_size: int) -> None:
    """CPU tensors only: every length fits the table, and every block a length reaches is in the
    pool (a table's tail past a sequence's last block may hold anything, e.g. -1). On CUDA,
    reading the values back would sync the stream and break CUDA-graph capture of decode."""
    if block_table.device.type != "cpu":
        return
    cap = block_table.shape[1] * block_size
    lens = cache_seqlens.long()
    bad = ((lens < 0) | (lens > cap)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"cache_seqlens: expected lengths in 0..{cap} (block_table.shape[1] * block_size), "
                         f"got {lens[bad[0]].item()} at index {bad[0]}")
    reached = torch.arange(block_table.shape[1]) < (lens[:, None] + block_size - 1) // max(block_size, 1)
    bad = (reached & ((block_table < 0) | (block_table >= num_blocks))).nonzero().tolist()
    if bad:
        b, j = bad[0]
        raise ValueError(f"block_table: expected block ids in [0, {num_blocks}) for the blocks cache_seqlens "
                         f"reach, got block_table[{b}, {j}] = {block_table[b, j].item()}")


def offsets_ok(h: list, total: int) -> bool:
    """Host offsets of packed rows: from 0 to ``total``, never decreasing."""
    return h[0] == 0 and h[-1] == total and all(a <= b for a, b in zip(h, h[1:]))


def host_offsets(name: str, cu: torch.Tensor, rows: str, total: int, hint_name: str, hint) -> list:
    """cu's values on the host (``offsets_ok``); a host copy the caller gave (``hint``) must hold
    the same values."""
    h = cu.tolist()
    check(offsets_ok(h, total),
          lambda: f"{name}: expected non-decreasing offsets from 0 to {rows} = {total}, got {h}"[:300])
    check(hint is None or list(hint) == h, lambda: f"{hint_name}: expected {name}'s values {h}, got {hint!r}"[:300])
    return h


def describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"
    return type(t).__name__


def check_interpretable(op: str, is_reference: bool, device: torch.device, *tensors: torch.Tensor) -> None:
    """Triton's interpreter (3.6 to 3.9) computes ``tl.dot`` on bfloat16 operands wrongly: refuse the
    kernels on CPU bf16 tensors rather than return garbage (docs/kernels.md, compiler facts)."""
    check(device.type != "cpu" or is_reference or all(t.dtype != torch.bfloat16 for t in tensors),
          lambda: f"backend: expected 'torch' for bfloat16 {op} on CPU (Triton's interpreter computes bfloat16 dot "
          "products wrongly; its kernels run float32 and float16 there)")


def check_fp8_tensor_cores(name: str, device) -> None:
    """A CUDA device with e4m3 tensor cores (compute capability >= 8.9), for the FP8 context
    kernels; CPU devices (the interpreter, the reference) pass."""
    device = torch.device(device)
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        check(cap >= (8, 9), lambda: f"{name}: needs FP8 tensor cores (compute capability >= 8.9), {device} has "
                                     f"{cap[0]}.{cap[1]}")


def check_act(x, dims: str) -> None:
    ndim = dims.count(",") + 1
    check(isinstance(x, torch.Tensor) and x.dim() == ndim,
          lambda: f"x: expected a {ndim}-D tensor {dims}, got {describe(x)}")
    check(x.dtype in FLOAT, lambda: f"x: expected float16, bfloat16 or float32, got {x.dtype}")


def check_fp8_weight(x, weight, weight_scale_inv, out_dtype) -> torch.dtype:
    """Checks of fp8_linear / fp8_bmm (any leading batch dims must match x's); returns out_dtype."""
    lead, K = tuple(x.shape[:-2]), x.shape[-1]
    check(isinstance(weight, torch.Tensor) and weight.dim() == x.dim() and tuple(weight.shape[:-2]) == lead
           and weight.shape[-1] == K,
           lambda: f"weight: expected [{', '.join(map(str, lead + ('N',)))}, {K}], got {describe(weight)}")
    check(weight.dtype == torch.float8_e4m3fn, lambda: f"weight: expected float8_e4m3fn, got {weight.dtype}")
    blocks = lead + (-(-weight.shape[-2] // 128), -(-K // 128))
    check(isinstance(weight_scale_inv, torch.Tensor) and weight_scale_inv.dtype == torch.float32
           and tuple(weight_scale_inv.shape) == blocks,
           lambda: f"weight_scale_inv: expected float32 of shape {blocks}, got {describe(weight_scale_inv)}")
    for name, t in (("weight", weight), ("weight_scale_inv", weight_scale_inv)):
        check(t.device == x.device, lambda: f"{name}: expected device {x.device}, got {t.device}")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    check(out_dtype in FLOAT, lambda: f"out_dtype: expected float16, bfloat16, float32 or None, got {out_dtype}")
    return out_dtype


def check_gather_values(block_table, starts, cu_seqlens, num_tokens: int, num_blocks: int, block_size: int) -> None:
    """CPU tensors only (on CUDA the reads would sync the stream): cu_seqlens runs from 0 to
    num_tokens without decreasing, starts are >= 0, and every block a sequence's rows reach is
    inside its table row and the pool."""
    if block_table.device.type != "cpu":
        return
    cu, st = cu_seqlens.tolist(), starts.tolist()
    check(offsets_ok(cu, num_tokens),
          f"cu_seqlens: expected non-decreasing offsets from 0 to num_tokens = {num_tokens}, got {cu}"[:300])
    table, width = block_table.tolist(), block_table.shape[1]
    for b, (s, n) in enumerate(zip(st, (y - x for x, y in zip(cu, cu[1:])))):
        check(s >= 0, lambda: f"starts: expected ints >= 0, got {s} at index {b}")
        if n == 0:
            continue
        last = (s + n - 1) // block_size
        check(last < width,
              lambda: f"block_table: sequence {b} reads tokens {s}..{s + n - 1}, block {last} of its row, "
                            f"past block_table.shape[1] = {width}")
        for j in range(s // block_size, last + 1):
            check(0 <= table[b][j] < num_blocks,
                  lambda: f"block_table: expected block ids in [0, {num_blocks}) for the "
                                                  f"blocks starts and cu_seqlens reach, got block_table[{b}, {j}] = "
                                                  f"{table[b][j]}")


def check_index_values(name: str, indices: torch.Tensor, limit: int) -> None:
    """CPU tensors only (on CUDA reading them back would sync the stream): every sparse index is
    -1 (none) or a row in [0, limit)."""
    if indices.device.type != "cpu" or not indices.numel():
        return
    bad = ((indices < -1) | (indices >= limit)).nonzero()
    if bad.shape[0]:
        at = tuple(bad[0].tolist())
        raise ValueError(f"{name}: expected -1 (none) or indices in [0, {limit}), got {indices[at].item()} "
                         f"at {list(at)}")


def check_latent_query_cache(q, kv_cache, head_dim_v):
    """The absorbed query q [B, s_q, H, d] and a paged latent cache of one of the row formats
    (``mla.quant``), as mla_decode and sparse_mla_decode take them; a [num_blocks, block_size,
    1, d] cache is viewed as 3-D. Returns (kv_cache, its format)."""
    check(isinstance(q, torch.Tensor) and q.dim() == 4, lambda: f"q: expected [B, s_q, H, d], got {describe(q)}")
    check(q.dtype in FLOAT, lambda: f"q: expected float16, bfloat16 or float32, got {q.dtype}")
    if isinstance(kv_cache, torch.Tensor) and kv_cache.dim() == 4:
        check(kv_cache.shape[2] == 1,
              lambda: f"kv_cache: expected [num_blocks, block_size, 1, d], got {tuple(kv_cache.shape)}")
        kv_cache = kv_cache.squeeze(2)
    d = q.shape[-1]
    check_int("head_dim_v", head_dim_v, 1, d)
    check(isinstance(kv_cache, torch.Tensor), lambda: f"kv_cache: expected a tensor, got {describe(kv_cache)}")
    fmt = quant.cache_format(kv_cache)
    width = quant.row_width(fmt, head_dim_v, d - head_dim_v)
    check(kv_cache.dim() == 3 and kv_cache.shape[-1] == width,
          lambda: f"kv_cache: expected [num_blocks, block_size, {width}] for {fmt} rows, got {describe(kv_cache)}")
    check(fmt != "plain" or kv_cache.dtype == q.dtype,
          lambda: f"kv_cache: expected dtype {q.dtype} (q's), got {kv_cache.dtype}")
    check(fmt != "fp8_tile" or head_dim_v % quant.TILE == 0,
          lambda: f"head_dim_v: expected a multiple of {quant.TILE} for the FP8 tile layout, got {head_dim_v}")
    check(kv_cache.device == q.device, lambda: f"kv_cache: expected device {q.device}, got {kv_cache.device}")
    return kv_cache, fmt
