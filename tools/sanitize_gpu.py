"""Under compute-sanitizer: every GPU kernel the library launches, once or a few times, on
small shapes: ragged lengths with zeros, shuffled block tables, NaN in every cache slot no query
sees, odd head counts, one split and many (the combine), PDL on and off. Each case forces the
kernel it is meant to reach (decode: the launcher by name; prefill: ``kernel=``; the FP8 GEMM:
the shape its rule sends there) and checks the result against the reference (backend "torch") on
host copies of the inputs, so a run also proves each case ran and computed the right thing, and
the oracle's own kernels stay out of the sanitizer's report.

    PYTHONPATH=src python3 tools/sanitize_gpu.py [--only PATTERN[,PATTERN...]] [--no-peers] [--list]
    tools/sanitize.sh [plain memcheck racecheck synccheck initcheck] [-- options of this script]

PATTERN: a glob or a substring of case names ("decode/seesaw", "*fp8-tile*"). --no-peers leaves
out the cases whose kernels are other projects' (cuDNN, cuBLAS, FlashInfer). Prints "-- NAME"
as each case starts (so a sanitizer report lands under its case in the log), then one line per
case: ok (with its errors against the reference), FAIL (with the reason) or skip. Exit status:
0 when every case ran ok or skipped, 1 when any failed, 2 without CUDA or without a matching case.

The sparse ops (indexer_logits, topk_indices, sparse_mla_decode, sparse_prefill_attention) run
through the public ops with the default backend: whatever serves them on CUDA (their kernels,
or the reference where none takes the inputs) is what the sanitizer sees.
"""
from __future__ import annotations

import argparse
import fnmatch
import math
import sys
from dataclasses import replace
from functools import partial

import torch

DV, DR = 512, 64                  # DeepSeek's latent and RoPE widths: the Hopper kernels take only these
D = DV + DR
SCALE = 1 / math.sqrt(128 + DR)   # DeepSeek's softmax scale (no YaRN)
KV_SCALE = 0.5                    # FP8 per-tensor rows: a power of two, so the scale itself is exact
PAGE = 64
RAGGED = [0, 1, 64, 130, 300]     # empty, one key, one whole page, a partial tail, several pages
EMPTY = [0, 0]


class Skip(Exception):
    """A case this machine cannot run (an optional peer absent, not an sm90 GPU)."""


# ---- inputs and checks ---------------------------------------------------------------------------

def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def cuda(*ts):
    return tuple(None if t is None else t.cuda() for t in ts)


def offsets(lengths) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def int32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def reference(op: str, *args, **kw):
    """The op on the host through backend "torch": the reference of ``mla.ops.reference``, with the
    public op's checks of the index values (which CUDA tensors skip)."""
    from mla import ops
    return getattr(ops, op)(*args, backend="torch", **kw)


def expect_close(got: torch.Tensor, want: torch.Tensor, bound: float, what: str) -> float:
    """got (from the GPU) against want (the host's reference): the same shape, NaN and inf at the
    same places (with the same signs), and the finite rest within a norm-wise relative error of
    bound. The tests hold each kernel to 2x PyTorch's own error; here the bound only has to show
    that the case computed the right thing. Returns the relative error."""
    got, want = got.cpu().double(), want.double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: NaN at other places than the reference's"
    inf = want.isinf()
    assert torch.equal(got.isinf(), inf) and torch.equal(got[inf], want[inf]), f"{what}: inf at other places"
    fin = want.isfinite()
    err = ((got[fin] - want[fin]).norm() / want[fin].norm().clamp_min(1e-30)).item()
    assert err <= bound, f"{what}: relative error {err:.2e} > {bound:.0e}"
    return err


def expect_bytes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """The same bytes (NaN rows compare equal as bytes)."""
    got = got.cpu()
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {got.shape} {got.dtype}, expected " \
                                                                f"{want.shape} {want.dtype}"
    assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), f"{what}: bytes differ"


def tol(dtype: torch.dtype) -> float:
    """The bound of ``expect_close`` for outputs in dtype: a few roundings of a 16-bit output, or
    float32 sums in another order."""
    return 1e-4 if dtype == torch.float32 else 2e-2


def paged(H: int, s_q: int, lens: list[int], dtype=torch.bfloat16, kv: str = "plain", r: int = DV,
          page: int = PAGE, seed: int = 0):
    """``mla.bench.decode_case``'s queries and shuffled paged cache (on the host), cut to ragged
    ``lens``: NaN in every slot past a sequence's end, the tail of its last block and the blocks
    its table row still names past it (at least one: the table holds max(lens) + page), so a
    stray read shows. Rows stored in ``kv``'s format (mla.quant; NaN rows stay NaN there).
    Returns q [B, s_q, H, r + DR] in dtype, the stored cache, block_table, cache_seqlens."""
    from mla import quant
    from mla.bench.decode import decode_case

    c = decode_case(H, len(lens), max(lens) + page, s_q, page, seed=seed, r=r, dr=DR, device="cpu")
    rows, table, seqlens = c["kv"], c["table"], int32(lens)
    slots = (table.long()[:, :, None] * page + torch.arange(page)).flatten(1)      # [B, capacity]
    past = torch.arange(slots.shape[1])[None] >= seqlens[:, None]
    rows.view(-1, r + DR)[slots[past]] = float("nan")
    if kv == "plain":
        stored = rows.to(dtype)
    else:
        stored = quant.quantize_rows(rows.view(-1, r + DR), kv, r, KV_SCALE).view(*rows.shape[:2], -1)
    return c["q"].to(dtype), stored, table, seqlens


def pick(n: int, topk: int, g: torch.Generator) -> torch.Tensor:
    """topk key positions below n in random order, at least a quarter of them -1 (none): -1 may
    stand anywhere in FlashMLA's sparse indices."""
    k = min(n, topk - topk // 4)
    row = torch.full((topk,), -1, dtype=torch.long)
    row[:k] = torch.randperm(n, generator=g)[:k]
    return row[torch.randperm(topk, generator=g)]


# ---- decode --------------------------------------------------------------------------------------

def launch_decode(kernel, q, kv, table, seqlens, causal, splits, kv_scale, pdl, block_n):
    """One decode kernel by name, whatever ``mla.ops.decode.choose_kernel`` would pick (as
    ``mla.bench.decode_providers`` calls them; ``portable-persistent``: the portable kernel on the
    persistent schedule). splits None: the launcher's default count;
    block_n (the seesaw's key tile) None: its default."""
    from mla.ops.decode import portable

    if kernel in ("portable", "portable-persistent"):
        cfg = portable.default_config(q, table.shape[1] * kv.shape[1])
        cfg = replace(cfg, persistent=kernel == "portable-persistent")
        cfg = cfg if splits is None else replace(cfg, num_splits=splits)
        return portable.launch(q, kv, table, seqlens, DV, SCALE, causal, cfg, kv_scale, pdl=pdl)
    if torch.cuda.get_device_capability()[0] != 9:
        raise Skip(f"the {kernel} kernel needs an sm90 GPU")
    from mla.ops.decode.gluon import fp8, narrow, seesaw

    launch = {"seesaw": seesaw.launch, "narrow": narrow.launch, "fp8": fp8.launch}[kernel]
    tile = {} if block_n is None else {"block_n": block_n}
    return launch(q, kv, table, seqlens, DV, SCALE, causal, num_splits=splits, kv_scale=kv_scale, pdl=pdl, **tile)


def decode(kernel, dtype=torch.bfloat16, kv="plain", H=16, s_q=1, lens=RAGGED, splits=None, pdl=True, causal=True,
           page=PAGE, block_n=None):
    q, cache, table, seqlens = paged(H, s_q, lens, dtype, kv, page=page)
    kv_scale = KV_SCALE if kv == "fp8" else 1.0
    out, lse = launch_decode(kernel, *cuda(q, cache, table, seqlens), causal, splits, kv_scale, pdl, block_n)
    want_out, want_lse = reference("mla_decode", q, cache, table, seqlens, DV, SCALE, causal, kv_scale=kv_scale)
    return (f"out {expect_close(out, want_out, tol(dtype), 'out'):.1e}, "
            f"lse {expect_close(lse, want_lse, tol(dtype), 'lse'):.1e}")


# ---- prefill -------------------------------------------------------------------------------------

def prefill(kernel, lq, lk, causal=True, H=16, dtype=torch.bfloat16):
    """Varlen prefill on DeepSeek's head dims (q/k 192, v 128), the kernel forced by ``kernel=``.
    The host offsets and longest lengths go with the call (the layer gives them): cuDNN and
    FlashInfer serve only with them."""
    from mla import ops

    if kernel == "flashinfer":
        try:
            import flashinfer  # noqa: F401 - optional peer
        except Exception as e:  # noqa: BLE001 - absent, or a build that does not load here
            raise Skip(f"flashinfer does not import ({type(e).__name__})") from None
    g = gen(sum(lq) * 7 + sum(lk) + H)
    q = torch.randn(sum(lq), H, 192, generator=g).to(dtype)
    k = torch.randn(sum(lk), H, 192, generator=g).to(dtype)
    v = torch.randn(sum(lk), H, 128, generator=g).to(dtype)
    oq, ok = offsets(lq), offsets(lk)
    cu_q, cu_k = int32(oq), int32(ok)
    out, lse = ops.prefill_attention(*cuda(q, k, v, cu_q, cu_k), SCALE, causal, max_seqlen_q=max(lq),
                                     max_seqlen_k=max(lk), offsets_q=oq, offsets_k=ok, kernel=kernel)
    want_out, want_lse = reference("prefill_attention", q, k, v, cu_q, cu_k, SCALE, causal)
    return (f"out {expect_close(out, want_out, tol(dtype), 'out'):.1e}, "
            f"lse {expect_close(lse, want_lse, tol(dtype), 'lse'):.1e}")


# ---- the memory-bound ops ------------------------------------------------------------------------

def rope_append(fmt, H, interleave, dtype=torch.bfloat16, T=37, nan=False, q_out=False):
    """RoPE + append into a 4-block cache; every fifth slot -1 (skipped). q_pe, k_pe and c_kv are
    column slices of wider rows, as the layer passes them. nan: a NaN in one token's c_kv (its
    FP8 tile's scale becomes NaN, mla.quant). q_out: the rotated queries into the RoPE columns of
    an absorbed query buffer [H, T, 576] (as the layer's decode step writes them), q_pe only read."""
    from mla import ops, quant

    g = gen(T * 131 + H)
    q = torch.randn(T, H, 128 + DR, generator=g).to(dtype)
    kv_a = torch.randn(T, D, generator=g).to(dtype)
    if nan:
        kv_a[3, 7] = float("nan")
    ang = torch.rand(T, DR // 2, generator=g) * 100
    cos, sin = ang.cos(), ang.sin()
    slots = torch.randperm(4 * PAGE, generator=g)[:T]
    slots[::5] = -1
    cache = torch.zeros(4, PAGE, quant.row_width(fmt, DV, DR), dtype=quant.storage_dtype(fmt, dtype))
    kv_scale = KV_SCALE if fmt == "fp8" else 1.0
    q_g, kv_g, cache_g, cos_g, sin_g, slots_g = cuda(q, kv_a, cache, cos, sin, slots)
    out = torch.full((H, T, D), float("nan"), dtype=dtype, device="cuda").transpose(0, 1) if q_out else None
    ops.rope_append(q_g[..., 128:], kv_g[:, DV:], kv_g[:, :DV], cos_g, sin_g, cache_g, slots_g, interleave,
                    kv_scale=kv_scale, q_out=None if out is None else out[..., DV:])
    if out is not None:
        expect_bytes(q_g, q, "q_pe (only read)")
        q_g = q_g.clone()
        q_g[..., 128:] = out[..., DV:]
    reference("rope_append", q[..., 128:], kv_a[:, DV:], kv_a[:, :DV], cos, sin, cache, slots, interleave,
              kv_scale=kv_scale)

    def values(c):
        return quant.dequantize_rows(c.cpu().view(-1, c.shape[-1]), fmt, DV, torch.float32, kv_scale)
    t = tol(dtype)
    return (f"q_pe {expect_close(q_g, q, t, 'q_pe'):.1e}, k_pe {expect_close(kv_g, kv_a, t, 'k_pe'):.1e}, "
            f"cache {expect_close(values(cache_g), values(cache), t, 'cache'):.1e}")


def gather(kv):
    """Ragged chunks of each sequence (from its start, from the middle of a page) out of the
    shuffled, NaN-padded cache, FP8 rows as their bytes: the same bytes as the reference."""
    from mla import ops

    _, cache, table, _ = paged(1, 1, RAGGED, kv=kv, seed=1)
    starts, counts = [0, 0, 10, 64, 17], [0, 1, 54, 66, 283]       # inside each of RAGGED's sequences
    cu, n = int32(offsets(counts)), sum(counts)
    got = ops.gather_latent(*cuda(cache, table, int32(starts), cu), n)
    expect_bytes(got, reference("gather_latent", cache, table, int32(starts), cu, n), "rows")
    return f"{n} rows identical"


def merge(dtype, shape):
    """Two partial results; a third of part a's and a quarter of part b's rows empty (lse -inf),
    every twelfth row both (out 0, lse -inf)."""
    from mla import ops

    g = gen(sum(shape))
    out_a, out_b = (torch.randn(*shape, generator=g).to(dtype) for _ in range(2))
    lse_a, lse_b = (torch.randn(*shape[:-1], generator=g) * 4 for _ in range(2))
    lse_a.view(-1)[::3] = float("-inf")
    lse_b.view(-1)[::4] = float("-inf")
    out, lse = ops.merge_attention(*cuda(out_a, lse_a, out_b, lse_b))
    want_out, want_lse = reference("merge_attention", out_a, lse_a, out_b, lse_b)
    return (f"out {expect_close(out, want_out, tol(dtype), 'out'):.1e}, "
            f"lse {expect_close(lse, want_lse, tol(dtype), 'lse'):.1e}")


def rms_norm(dtype, T, N):
    """Rows of a strided view (every other column of a wider buffer), one with a NaN."""
    from mla import ops

    g = gen(T + N)
    x = torch.randn(T, 2 * N, generator=g).to(dtype)[:, ::2]
    x[T // 2, 0] = float("nan")
    w = torch.randn(N, generator=g).to(dtype)
    got = ops.rms_norm(*cuda(x, w), 1e-6)
    return f"out {expect_close(got, reference('rms_norm', x, w, 1e-6), tol(dtype), 'out'):.1e}"


def rms_norm_pair(dtype, T, N1, N2):
    """Two column slices of one buffer (the layer's query and KV latents), a NaN in one row of x1."""
    from mla import ops

    g = gen(T + N1 + 3 * N2)
    a = torch.randn(T, N1 + N2 + 64, generator=g).to(dtype)
    a[T // 2, 1] = float("nan")
    x1, x2 = a[:, :N1], a[:, N1: N1 + N2]
    w1, w2 = torch.randn(N1, generator=g).to(dtype), torch.randn(N2, generator=g).to(dtype)
    a_g, w1_g, w2_g = cuda(a, w1, w2)
    y1, y2 = ops.rms_norm_pair(a_g[:, :N1], w1_g, 1e-6, a_g[:, N1: N1 + N2], w2_g, 1e-5)
    return (f"y1 {expect_close(y1, reference('rms_norm', x1, w1, 1e-6), tol(dtype), 'y1'):.1e}, "
            f"y2 {expect_close(y2, reference('rms_norm', x2, w2, 1e-5), tol(dtype), 'y2'):.1e}")


# ---- FP8 GEMMs -----------------------------------------------------------------------------------

def quantize(dtype, M, K, nan=False):
    """Per-token 1x128 quantization; K not a multiple of 128 (a partial last group). nan: a NaN
    in one group (its scale becomes NaN)."""
    from mla import ops

    x = torch.randn(M, K, generator=gen(M * K)).to(dtype) * 3
    if nan:
        x[min(1, M - 1), K // 2] = float("nan")
    x_q, x_s = ops.quantize_act_1x128(*cuda(x))
    want_q, want_s = reference("quantize_act_1x128", x)
    return (f"x_q {expect_close(x_q.float(), want_q.float(), tol(dtype), 'x_q'):.1e}, "
            f"scale {expect_close(x_s, want_s, tol(dtype), 'scale'):.1e}")


def fp8_weight(N, K, g, batch=()):
    """A block-scaled FP8 weight [*batch, N, K] and its float32 scales (partial edge blocks)."""
    w = (torch.randn(*batch, N, K, generator=g) * 0.5).to(torch.float8_e4m3fn)
    s = torch.rand(*batch, math.ceil(N / 128), math.ceil(K / 128), generator=g) * 0.01 + 0.001
    return w, s


def fp8_linear(gemm, M, N, K):
    """fp8_linear on the GEMM its rule (``fp8_gemm.choose_kernel``) picks for the shape: the case
    asserts it is ``gemm`` ("triton": this library's kernel, split-K at small M; "scaled_mm":
    cuBLAS after this library's quantization kernel)."""
    from mla import ops
    from mla.ops import fp8_gemm

    g = gen(M * 7 + N + K)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    w, s = fp8_weight(N, K, g)
    x_g, w_g, s_g = cuda(x, w, s)
    chosen = fp8_gemm.choose_kernel(x_g, w_g, torch.bfloat16)
    if chosen != gemm:
        if gemm == "scaled_mm":   # this torch has no block-scaled scaled_mm: the library never calls it here
            raise Skip(f"fp8_linear's rule picks {chosen} here")
        raise AssertionError(f"fp8_linear's rule picks {chosen}, not {gemm}")
    got = ops.fp8_linear(x_g, w_g, s_g)
    return f"y {expect_close(got, reference('fp8_linear', x, w, s), 2e-2, 'y'):.1e}"


def fp8_bmm(H, T, N, K):
    from mla import ops

    g = gen(H * T + N + K)
    x = torch.randn(H, T, K, generator=g).to(torch.bfloat16)
    w, s = fp8_weight(N, K, g, (H,))
    got = ops.fp8_bmm(*cuda(x, w, s))
    return f"y {expect_close(got, reference('fp8_bmm', x, w, s), 2e-2, 'y'):.1e}"


# ---- sparse MLA ----------------------------------------------------------------------------------

INDEX_HEADS, INDEX_DIM = 64, 128   # DeepSeek-V3.2's indexer
QUERIES = [0, 1, 2, 1, 3]          # indexer queries of each of RAGGED's sequences (at most its length)


def indexer_inputs():
    """Packed indexer queries and head weights, and the paged index keys: ``paged``'s rows of
    r + DR = 128 values stand in for the indexer's keys, NaN past each sequence's end."""
    g = gen(2)
    _, keys, table, seqlens = paged(1, 1, RAGGED, r=INDEX_DIM - DR, seed=2)
    Tq = sum(QUERIES)
    q = torch.randn(Tq, INDEX_HEADS, INDEX_DIM, generator=g).to(torch.bfloat16)
    w = torch.randn(Tq, INDEX_HEADS, generator=g) * INDEX_HEADS ** -0.5
    return q, w, keys, table, seqlens, int32(offsets(QUERIES))


def indexer_logits(keys="bf16"):
    """keys "fp8": DeepSeek's FP8 key rows (132 bytes, read 4 at a time) and queries quantized alike."""
    from mla import ops, quant

    q, w, k, table, seqlens, cu_q = indexer_inputs()
    if keys == "fp8":
        n, page = k.shape[:2]
        k = quant.quantize_index(quant.rotate(k.view(n * page, -1)), "fp8").view(n, page, -1)
        q = quant.fake_quant(quant.rotate(q), "fp8").to(q.dtype)
    args = (q, w, k, table, seqlens, cu_q)
    got = ops.indexer_logits(*cuda(*args), max(RAGGED), INDEX_DIM ** -0.5)
    want = reference("indexer_logits", *args, max(RAGGED), INDEX_DIM ** -0.5)
    return f"logits {expect_close(got, want, 2e-2, 'logits'):.1e}"


def topk_indices(topk=64, repeat=1):
    """The top-k of the reference's logits: the same slots (random scores have no ties), -1 past
    the keys a query sees. ``repeat``: the queries that many times over (past 132 queries the op
    runs its one-program kernel, below its chunked passes)."""
    from mla import ops

    args = indexer_inputs()
    _, _, _, table, _, cu_q = args
    logits = reference("indexer_logits", *args, max(RAGGED), INDEX_DIM ** -0.5).repeat(repeat, 1)
    cu_q = torch.cat((cu_q[:1], cu_q[1:].repeat(repeat) + (torch.arange(repeat) * cu_q[-1]).repeat_interleave(
        len(RAGGED)))).int()
    table = table.repeat(repeat, 1)
    got = ops.topk_indices(*cuda(logits), topk, *cuda(table, cu_q), PAGE)
    want = reference("topk_indices", logits, topk, table, cu_q, PAGE)
    assert torch.equal(got.cpu(), want), "indices differ from the reference's"
    return f"{(want >= 0).sum().item()} indices identical"


def sparse_decode(kv="plain", H=16, s_q=2, topk=64, sink=False):
    """Each query attends to random keys of its sequence (as cache slots through the shuffled
    table) and -1s; the empty sequence's queries to -1s only."""
    from mla import ops

    g = gen(H * s_q + topk)
    q, cache, table, seqlens = paged(H, s_q, RAGGED, kv=kv, seed=4)
    indices = torch.full((len(RAGGED), s_q, topk), -1, dtype=torch.int32)
    for b, n in enumerate(RAGGED):
        for i in range(s_q):
            pos = pick(n, topk, g)
            slots = table[b].long()[pos.clamp(min=0) // PAGE] * PAGE + pos.clamp(min=0) % PAGE
            indices[b, i] = torch.where(pos >= 0, slots, -1).int()
    attn_sink = torch.randn(H, generator=g) if sink else None
    kv_scale = KV_SCALE if kv == "fp8" else 1.0
    out, lse = ops.sparse_mla_decode(*cuda(q, cache, indices), DV, SCALE, kv_scale=kv_scale,
                                     attn_sink=cuda(attn_sink)[0])
    want_out, want_lse = reference("sparse_mla_decode", q, cache, indices, DV, SCALE, kv_scale=kv_scale,
                                   attn_sink=attn_sink)
    return f"out {expect_close(out, want_out, 2e-2, 'out'):.1e}, lse {expect_close(lse, want_lse, 2e-2, 'lse'):.1e}"


def sparse_prefill(H=16, s_q=20, s_kv=200, valid=150, topk=64):
    """Queries over a contiguous latent kv whose rows from ``valid`` on are NaN and named by no
    index; query 0 has only -1s."""
    from mla import ops

    g = gen(H + s_q + s_kv)
    q = torch.randn(s_q, H, D, generator=g).to(torch.bfloat16)
    kv = torch.randn(s_kv, 1, D, generator=g).to(torch.bfloat16)
    kv[valid:] = float("nan")
    indices = torch.stack([pick(valid if i else 0, topk, g) for i in range(s_q)]).int()[:, None]
    out, lse = ops.sparse_prefill_attention(*cuda(q, kv, indices), SCALE, DV)
    want_out, want_lse = reference("sparse_prefill_attention", q, kv, indices, SCALE, DV)
    return f"out {expect_close(out, want_out, 2e-2, 'out'):.1e}, lse {expect_close(lse, want_lse, 2e-2, 'lse'):.1e}"


# ---- the cases -----------------------------------------------------------------------------------

bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
P = partial

CASES = {
    # portable Triton kernel: every dtype and row format, the gather path (page 16 < its 64-key tile)
    "decode/portable-bf16-h16-s1": P(decode, "portable", H=16, s_q=1),
    "decode/portable-bf16-h3-s2-1split-nopdl": P(decode, "portable", H=3, s_q=2, splits=1, pdl=False),
    "decode/portable-bf16-h128-s2-page16": P(decode, "portable", H=128, s_q=2, page=16),
    "decode/portable-fp16-h16-s2-full": P(decode, "portable", fp16, H=16, s_q=2, causal=False),
    "decode/portable-fp32-h3-s2": P(decode, "portable", fp32, H=3, s_q=2),
    "decode/portable-fp32-h16-s1-1split": P(decode, "portable", fp32, H=16, s_q=1, splits=1),
    "decode/portable-fp8-h16-s1": P(decode, "portable", kv="fp8", H=16, s_q=1),
    "decode/portable-fp8-h3-s2-1split-nopdl": P(decode, "portable", kv="fp8", H=3, s_q=2, splits=1, pdl=False),
    "decode/portable-fp8tile-h16-s2": P(decode, "portable", kv="fp8_tile", H=16, s_q=2),
    "decode/portable-fp8tile-h3-s1-1split": P(decode, "portable", kv="fp8_tile", H=3, s_q=1, splits=1),
    "decode/portable-bf16-empty": P(decode, "portable", H=16, lens=EMPTY),
    "decode/portable-persistent-bf16-h16-s1": P(decode, "portable-persistent", H=16, s_q=1, splits=3),
    "decode/portable-persistent-fp8tile-h3-s2": P(decode, "portable-persistent", kv="fp8_tile", H=3, s_q=2,
                                                  splits=2),
    # seesaw: TMA output (64-row tiles, one split and 16-bit partials), float32 partials otherwise;
    # key tiles of 32 (its default at these batches) and 64
    "decode/seesaw-bf16-h128-s1-1split": P(decode, "seesaw", H=128, s_q=1, splits=1),
    "decode/seesaw-bf16-h128-s1-splits5-bn64": P(decode, "seesaw", H=128, s_q=1, splits=5, block_n=64),
    "decode/seesaw-bf16-h3-s2-nopdl": P(decode, "seesaw", H=3, s_q=2, pdl=False),
    "decode/seesaw-fp16-h64-s2-full": P(decode, "seesaw", fp16, H=64, s_q=2, causal=False),
    "decode/seesaw-fp8-h128-s1": P(decode, "seesaw", kv="fp8", H=128, s_q=1),
    "decode/seesaw-fp8-fp16-h64-s1-1split": P(decode, "seesaw", fp16, kv="fp8", H=64, s_q=1, splits=1),
    "decode/seesaw-fp8tile-h128-s1-nopdl": P(decode, "seesaw", kv="fp8_tile", H=128, s_q=1, pdl=False),
    "decode/seesaw-fp8tile-h3-s2-1split": P(decode, "seesaw", kv="fp8_tile", H=3, s_q=2, splits=1),
    "decode/seesaw-bf16-empty": P(decode, "seesaw", H=16, lens=EMPTY),
    # a grid wider than equal lengths use (idle programs store nothing: TMA rows past the
    # tensor's end, masked stores) and sequences of one program writing the output themselves
    "decode/seesaw-bf16-h128-idle": P(decode, "seesaw", H=128, s_q=1, lens=[130] * 3, splits=(3, 1)),
    "decode/seesaw-fp8-h128-idle": P(decode, "seesaw", kv="fp8", H=128, s_q=1, lens=[130] * 3, splits=(2, 1)),
    "decode/seesaw-bf16-h128-direct-mixed": P(decode, "seesaw", H=128, s_q=1, lens=[300, 1, 0, 64], splits=(3, 1)),
    # narrow (keys on M): 16 and 32 query rows, FP8 staging of 3 and 2 stages
    "decode/narrow-bf16-h16-s1": P(decode, "narrow", H=16, s_q=1),
    "decode/narrow-bf16-h3-s2-1split-nopdl": P(decode, "narrow", H=3, s_q=2, splits=1, pdl=False),
    "decode/narrow-bf16-h16-s2-splits5": P(decode, "narrow", H=16, s_q=2, splits=5),
    "decode/narrow-fp16-h16-s1-full": P(decode, "narrow", fp16, H=16, s_q=1, causal=False),
    "decode/narrow-fp8-h16-s1": P(decode, "narrow", kv="fp8", H=16, s_q=1),
    "decode/narrow-fp8-h16-s2-1split": P(decode, "narrow", kv="fp8", H=16, s_q=2, splits=1),
    "decode/narrow-fp8tile-h16-s1-nopdl": P(decode, "narrow", kv="fp8_tile", H=16, s_q=1, pdl=False),
    "decode/narrow-fp8tile-h3-s2-splits5": P(decode, "narrow", kv="fp8_tile", H=3, s_q=2, splits=5),
    "decode/narrow-bf16-h16-idle": P(decode, "narrow", H=16, s_q=1, lens=[130] * 3, splits=(3, 1)),
    # fp8 (e4m3 MMAs): one and two row groups
    "decode/fp8-tensor-h16-s1": P(decode, "fp8", kv="fp8", H=16, s_q=1),
    "decode/fp8-tensor-h16-s2-1split-nopdl": P(decode, "fp8", kv="fp8", H=16, s_q=2, splits=1, pdl=False),
    "decode/fp8-tensor-fp16-h3-s1-full": P(decode, "fp8", fp16, kv="fp8", H=3, s_q=1, causal=False),
    "decode/fp8-tile-h16-s1": P(decode, "fp8", kv="fp8_tile", H=16, s_q=1),
    "decode/fp8-tile-h16-s2-splits5": P(decode, "fp8", kv="fp8_tile", H=16, s_q=2, splits=5),
    "decode/fp8-tile-h3-s2-1split-nopdl": P(decode, "fp8", kv="fp8_tile", H=3, s_q=2, splits=1, pdl=False),
    "decode/fp8-tile-empty": P(decode, "fp8", kv="fp8_tile", H=16, lens=EMPTY),
    "decode/fp8-tile-h16-idle": P(decode, "fp8", kv="fp8_tile", H=16, lens=[130] * 3, splits=(3, 1)),
    "decode/fp8-tensor-h16-direct-mixed": P(decode, "fp8", kv="fp8", H=16, lens=[300, 1, 0, 64], splits=(3, 1)),
    # prefill: a sequence with no queries, one with no keys, queries past the keys (causal: none seen)
    "prefill/triton-bf16-causal": P(prefill, "triton", [5, 0, 70, 33], [5, 40, 70, 200]),
    "prefill/triton-bf16-full": P(prefill, "triton", [3, 20, 0], [0, 50, 9], causal=False),
    "prefill/triton-fp16-h3-causal": P(prefill, "triton", [40, 1], [10, 1], H=3, dtype=fp16),
    "prefill/triton-fp32-causal": P(prefill, "triton", [17, 0, 9], [17, 4, 30], dtype=fp32),
    "prefill/cudnn-bf16-causal": P(prefill, "cudnn", [64, 64], [64, 64]),
    "prefill/cudnn-fp16-h3-full": P(prefill, "cudnn", [50], [50], causal=False, H=3, dtype=fp16),
    "prefill/flashinfer-bf16-causal": P(prefill, "flashinfer", [5, 70], [5, 200]),
    # RoPE + append: plain, FP8 per-tensor and tile rows; -1 slots; a NaN token
    "rope_append/plain-bf16-h128-interleave": P(rope_append, "plain", 128, True),
    "rope_append/plain-fp32-h3-neox": P(rope_append, "plain", 3, False, fp32),
    "rope_append/fp8-bf16-h16-interleave": P(rope_append, "fp8", 16, True),
    "rope_append/fp8tile-bf16-h16-neox-nan": P(rope_append, "fp8_tile", 16, False, nan=True),
    "rope_append/plain-bf16-h16-q_out": P(rope_append, "plain", 16, True, q_out=True),
    "gather/bf16": P(gather, "plain"),
    "gather/fp8": P(gather, "fp8"),
    "gather/fp8tile": P(gather, "fp8_tile"),
    "rms_norm/bf16-t5-n1536": P(rms_norm, bf16, 5, 1536),
    "rms_norm/fp32-t1-n33": P(rms_norm, fp32, 1, 33),
    "rms_norm/pair-bf16-t5-n1536-n512": P(rms_norm_pair, bf16, 5, 1536, 512),
    "merge/bf16-h3": P(merge, bf16, (37, 3, 128)),
    "merge/fp32-h16-d512": P(merge, fp32, (9, 16, 512)),
    "quantize_act/bf16-k300-nan": P(quantize, bf16, 5, 300, nan=True),
    "quantize_act/fp32-m1-k128": P(quantize, fp32, 1, 128),
    "fp8_linear/triton-m3": P(fp8_linear, "triton", 3, 200, 300),
    "fp8_linear/triton-m80-n200": P(fp8_linear, "triton", 80, 200, 256),
    "fp8_linear/scaled_mm-m80": P(fp8_linear, "scaled_mm", 80, 256, 384),
    "fp8_bmm/h3-k512-n128": P(fp8_bmm, 3, 2, 128, 512),
    "fp8_bmm/h3-k128-n512": P(fp8_bmm, 3, 5, 512, 128),
    # sparse MLA, through the public ops with the default backend
    "sparse/indexer_logits": indexer_logits,
    "sparse/indexer_logits-fp8": P(indexer_logits, "fp8"),
    "sparse/topk_indices": topk_indices,
    "sparse/topk_indices-one-program": P(topk_indices, 64, 30),
    "sparse/decode-bf16-h128-s2": P(sparse_decode, "plain", 128, 2),
    "sparse/decode-bf16-h16-s2": P(sparse_decode, "plain", 16, 2),
    "sparse/decode-fp8-h16-s2": P(sparse_decode, "fp8", 16, 2),
    "sparse/decode-fp8tile-h128-s1": P(sparse_decode, "fp8_tile", 128, 1),
    "sparse/decode-bf16-h16-s1-sink": P(sparse_decode, "plain", 16, 1, sink=True),
    "sparse/prefill-bf16-h16": sparse_prefill,
}

# cases whose kernels are other projects' (cuDNN, cuBLAS, FlashInfer): --no-peers leaves them out
PEERS = {"prefill/cudnn-bf16-causal", "prefill/cudnn-fp16-h3-full", "prefill/flashinfer-bf16-causal",
         "fp8_linear/scaled_mm-m80"}


def select(only: str | None, no_peers: bool) -> list[str]:
    patterns = [p for p in (only or "").split(",") if p] or ["*"]
    return [n for n in CASES if any(fnmatch.fnmatchcase(n, f"*{p}*") for p in patterns)
            and not (no_peers and n in PEERS)]


def run(name: str) -> tuple[str, str]:
    print(f"-- {name}", flush=True)
    try:
        detail = CASES[name]()
        torch.cuda.synchronize()     # a fault of a kernel whose output was not read shows at its own case
        return "ok", detail
    except Skip as e:
        return "skip", str(e)
    except Exception as e:  # noqa: BLE001 - every failure is reported by its case, the run goes on
        return "FAIL", f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Every GPU kernel of mla once on small hostile shapes, checked "
                                            "against the reference: the driver of tools/sanitize.sh.")
    p.add_argument("--only", metavar="PATTERN", help="comma-separated globs or substrings of case names")
    p.add_argument("--no-peers", action="store_true", help="leave out the cases of cuDNN, cuBLAS and FlashInfer")
    p.add_argument("--list", action="store_true", help="list the selected cases and exit (no GPU needed)")
    p.add_argument("--poison", action="store_true",
                   help="fill every tensor torch allocates uninitialized (torch.empty) with NaN, integers with "
                        "their maximum, so that a read of a byte no kernel wrote shows in the case's result")
    args = p.parse_args(argv)
    names = select(args.only, args.no_peers)
    if not names:
        print(f"sanitize_gpu.py: no case matches --only {args.only!r} (see --list)", file=sys.stderr)
        return 2
    if args.list:
        for n in names:
            print(n + ("  (peer)" if n in PEERS else ""))
        return 0
    if not torch.cuda.is_available():
        print("sanitize_gpu.py: needs a CUDA GPU (torch.cuda.is_available() is False); --list runs anywhere",
              file=sys.stderr)
        return 2
    if args.poison:
        # initcheck's stand-in where it cannot see the writes (compute-sanitizer 2026.4 does not
        # count TMA stores, which the Gluon kernels' partials and outputs are): every buffer the
        # ops allocate starts as NaN (floats) or the largest value (integers), and each case's
        # check against the reference would see a byte that no kernel wrote. warn_only: the
        # ops that have no deterministic CUDA kernel still run (with a warning)
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = True
        if not (torch.empty(8, device="cuda").isnan().all()
                and (torch.empty(8, device="cuda", dtype=torch.int32) == 2 ** 31 - 1).all()):
            print("sanitize_gpu.py: --poison: torch.empty does not fill (this torch lacks "
                  "fill_uninitialized_memory)", file=sys.stderr)
            return 2
    torch.manual_seed(0)
    results = {n: run(n) for n in names}
    width = max(map(len, names))
    for n, (status, detail) in results.items():
        print(f"{status:<4}  {n:<{width}}  {detail}")
    counts = {s: sum(r[0] == s for r in results.values()) for s in ("ok", "FAIL", "skip")}
    print(f"sanitize_gpu: {counts['ok']} ok, {counts['FAIL']} FAIL, {counts['skip']} skip")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
