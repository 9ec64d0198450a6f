"""mla.StepGraph: a decode step through static, padded buffers (CPU: eagerly; CUDA: captured
and replayed) against the plain eager step, over a serving trace with fork, truncate and
release between steps, several buckets, s_q 1 and 3, bf16 and FP8 caches, two layers on one
cache; and the refusals."""
from __future__ import annotations

import pytest
import torch

import mla
from mla.ops.reference import rms_norm
from mla.testing import random_state_dict
from mla.weights import quantize_checkpoint_fp8

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class Step(torch.nn.Module):
    """Pre-norm residual attention blocks, one mla.MLA layer each, on one shared cache."""

    def __init__(self, cfg, num_layers, dtype, device="cpu", backend="auto", fp8_weights=False, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.norms = [(torch.rand(cfg.hidden_size, generator=g) + 0.5).to(device, dtype) for _ in range(num_layers)]
        self.layers = torch.nn.ModuleList()
        for i in range(num_layers):
            layer = mla.MLA(cfg, layer_idx=i, dtype=dtype, device=device, backend=backend,
                            fp8_weights="always" if fp8_weights else "never")
            sd = random_state_dict(cfg, torch.Generator().manual_seed(seed + 1 + i))
            if i in cfg.index_shared_layers:    # GLM-5's shared layers have no indexer of their own
                sd = {k: v for k, v in sd.items() if not k.startswith("indexer.")}
            layer.load_hf_state_dict(quantize_checkpoint_fp8(sd) if fp8_weights else sd)
            self.layers.append(layer)

    def forward(self, x, batch):
        for norm, layer in zip(self.norms, self.layers):
            x = x + layer(rms_norm(x, norm, 1e-6), batch)
        return x


def trace(s_q):
    """A serving trace: ("prefill" | "decode", requests), or a cache operation between steps
    (("truncate", seq, tokens to drop): rejected drafts). Decode steps hit buckets 4, 4, 2, 1,
    4, 8 of (1, 2, 4, 8); forks land in partly filled blocks (copy-on-write at the next step)."""
    def dec(*seqs):
        return ("decode", [(s, s_q) for s in seqs])
    return [("prefill", [("a", 5), ("b", 9), ("c", 3)]), dec("a", "b", "c"), ("fork", "a", "d"),
            dec("d", "a", "b", "c"), ("truncate", "b", s_q - 1 or 1), ("release", "c"), dec("b", "d"), dec("d"),
            ("prefill", [("e", 6), ("a", s_q)]), dec("a", "b", "d", "e"), ("fork", "e", "f"), ("truncate", "a", 2),
            dec("a", "b", "d", "e", "f")]


def serve(cache, step, s_q, graph=None, device="cpu", dtype=torch.float32, steps=None):
    """Run the trace on ``cache``: decode steps through ``graph`` where given, the rest (and
    every step without a graph) eagerly. Returns the outputs of the decode steps."""
    g = torch.Generator().manual_seed(7)
    outs = []
    for kind, *args in steps or trace(s_q):
        if kind == "truncate":
            cache.truncate(args[0], cache.length(args[0]) - args[1])
        elif kind in ("fork", "release"):
            getattr(cache, kind)(*args)
        else:
            batch = cache.prepare(args[0])
            x = (torch.randn(batch.num_tokens, cache.cfg.hidden_size, generator=g) * 0.5).to(device, dtype)
            if graph is not None:
                assert graph.fits(batch) == (kind == "decode")
            out = (graph if graph is not None and kind == "decode" else step)(x, batch)
            if kind == "decode":
                outs.append(out.float())
    return outs


def nan_cache(cfg, dtype, device="cpu", block_size=4, num_blocks=64, num_layers=2):
    """A cache whose unused pages hold NaN: a stray read or a padding row's write shows."""
    cache = mla.PagedLatentCache(cfg, num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
                                 dtype=dtype, device=device)
    cache.kv.fill_(float("nan"))
    return cache


def same_kv(a, b, rtol=0.0):
    """The same NaN positions (rows never written), and the same values elsewhere: equal, or
    within ``rtol`` of the largest."""
    a, b = a.float(), b.float()
    a0, b0 = a.nan_to_num(), b.nan_to_num()
    return torch.equal(a.isnan(), b.isnan()) and (a0 - b0).abs().max() <= rtol * b0.abs().max()


def assert_same(got, want, dtype):
    """bf16 and FP8 paths: bit-identical; float32: within its rounding (CPU GEMMs round a row
    differently with the number of rows, and the bucket pads them)."""
    rtol = F32_RTOL if dtype == torch.float32 else 0.0
    assert (got - want).abs().max() <= rtol * want.abs().max()


F32_RTOL = 1e-5   # ~80 float32 ulps of the largest value; measured: at most 1e-6


# ---- CPU: the static-buffer path against the plain eager step -----------------------------

CPU_CASES = [   # (layer dtype, cache dtype, s_q, FP8 weights)
    (torch.float32, torch.float32, 1, False), (torch.float32, torch.float32, 3, False),
    (torch.bfloat16, torch.bfloat16, 1, False), (torch.bfloat16, torch.bfloat16, 3, False),
    (torch.float32, torch.float8_e4m3fn, 1, False), (torch.bfloat16, torch.float8_e4m3fn, 3, False),
    (torch.float32, torch.float32, 1, True),
]


@pytest.mark.parametrize("dtype,cache_dtype,s_q,fp8_weights", CPU_CASES)
def test_static_path_equals_eager_step(dtype, cache_dtype, s_q, fp8_weights):
    cfg = mla.MLAConfig.preset("tiny")
    step = Step(cfg, 2, dtype, fp8_weights=fp8_weights)
    eager_cache, graph_cache = nan_cache(cfg, cache_dtype), nan_cache(cfg, cache_dtype)
    graph = mla.StepGraph(step, graph_cache, max_blocks_per_seq=16, s_q=s_q, buckets=(1, 2, 4, 8), dtype=dtype)
    want = serve(eager_cache, step, s_q, dtype=dtype)
    got = serve(graph_cache, step, s_q, graph, dtype=dtype)
    assert len(got) == 6
    for w, o in zip(want, got):
        assert torch.isfinite(o).all()
        assert_same(o, w, dtype)
    # the same rows written, and nothing else: padding rows wrote no slot
    assert same_kv(graph_cache.kv, eager_cache.kv, F32_RTOL if dtype == torch.float32 else 0.0)
    assert graph.captured == ()   # CPU: no CUDA graphs


def test_padding_rows_stay_finite_and_write_nothing():
    """Every row of the bucket, padding included, comes out finite; the pool past the real
    rows keeps its NaN."""
    cfg = mla.MLAConfig.preset("tiny")
    step = Step(cfg, 1, torch.float32)
    seen = []
    cache = nan_cache(cfg, torch.float32, num_layers=1)
    graph = mla.StepGraph(lambda x, b: seen.append(step(x, b)) or seen[-1], cache, max_blocks_per_seq=8,
                          buckets=(8,), dtype=torch.float32)
    step(torch.randn(7, cfg.hidden_size), cache.prepare([("a", 7)]))
    written = ~cache.kv.isnan()
    out = graph(torch.randn(1, cfg.hidden_size), cache.prepare([("a", 1)]))
    assert out.shape == (1, cfg.hidden_size) and seen[-1].shape == (8, cfg.hidden_size)
    assert torch.isfinite(seen[-1]).all()
    assert (~cache.kv.isnan()).sum() == written.sum() + cache.kv.shape[-1]   # one new row


def test_token_ids_and_tuple_outputs():
    """x may be token ids ([T], input_shape ()), and the step may return several tensors of T rows."""
    cfg = mla.MLAConfig.preset("tiny")
    step = Step(cfg, 1, torch.float32)
    embed = torch.randn(50, cfg.hidden_size, generator=torch.Generator().manual_seed(2))

    def lm_step(ids, batch):
        h = step(embed[ids], batch)
        return h, h.sum(-1)

    caches = [nan_cache(cfg, torch.float32, num_layers=1) for _ in range(2)]
    graph = mla.StepGraph(lm_step, caches[1], max_blocks_per_seq=8, buckets=(4,), dtype=torch.int64,
                          input_shape=())
    for c in caches:
        lm_step(torch.arange(5), c.prepare([("a", 3), ("b", 2)]))
    ids = torch.tensor([4, 9])
    want = lm_step(ids, caches[0].prepare([("a", 1), ("b", 1)]))
    got = graph(ids, caches[1].prepare([("a", 1), ("b", 1)]))
    assert isinstance(got, tuple) and len(got) == 2
    for w, o in zip(want, got):
        assert_same(o, w, torch.float32)


def packed_step(step, width):
    """A step_fn for ``run_packed``: rows [position, slot + 1, length, block table | hidden
    state] (as float32), unpacked into the static batch inside the step; an all-zero row is
    padding (slot -1, length 0)."""
    def run(x, batch):
        meta = x[:, : 3 + width].long()
        batch.positions.copy_(meta[:, 0])
        torch.sub(meta[:, 1], 1, out=batch.slot_mapping)
        batch.cache_seqlens.copy_(meta[:, 2])
        batch.block_table.copy_(meta[:, 3:])
        torch.cumsum(batch.cache_seqlens, 0, out=batch.cu_seqlens_k[1:])
        return step(x[:, 3 + width:].contiguous(), batch)
    return run


def test_run_packed_and_append_tokens_equal_prepare_and_the_eager_step():
    """A decode step whose metadata travels packed in x (``run_packed``), its slots from
    ``cache.append_tokens``: the eager step's outputs and cache rows, through buckets 4 (3 rows
    padded), 2 and 4 again, with a fork (copy-on-write at the next step) between."""
    cfg = mla.MLAConfig.preset("tiny")
    step = Step(cfg, 2, torch.float32)
    caches = [nan_cache(cfg, torch.float32) for _ in range(2)]
    width = 8
    graph = mla.StepGraph(packed_step(step, width), caches[1], max_blocks_per_seq=width, buckets=(2, 4),
                          dtype=torch.float32, input_shape=(3 + width + cfg.hidden_size,))
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(18, cfg.hidden_size, generator=g)
    for c in caches:
        step(x0, c.prepare([("a", 5), ("b", 9), ("c", 4)]))
    for seqs in (["a", "b", "c"], ["c", "a"], "fork", ["a", "b", "c", "d"]):
        if seqs == "fork":
            for c in caches:
                c.fork("a", "d")
            continue
        x = torch.randn(len(seqs), cfg.hidden_size, generator=g)
        batch = caches[0].prepare([(s, 1) for s in seqs])
        want = step(x, batch)
        before = [caches[1].length(s) for s in seqs]
        slots = caches[1].append_tokens(seqs)
        assert slots == batch.slot_mapping.tolist()
        rows = torch.zeros(len(seqs), 3 + width + cfg.hidden_size)
        for b, s in enumerate(seqs):
            blocks = caches[1].blocks(s)
            rows[b, :3] = torch.tensor([before[b], slots[b] + 1, before[b] + 1])
            rows[b, 3:3 + len(blocks)] = torch.tensor(blocks, dtype=torch.float32)
        rows[:, 3 + width:] = x
        got = graph.run_packed(rows, len(seqs))
        assert_same(got, want, torch.float32)
    assert same_kv(caches[1].kv, caches[0].kv, F32_RTOL)
    with pytest.raises(ValueError, match="num_seqs: expected 1 to 4"):
        graph.run_packed(rows, 5)
    with pytest.raises(ValueError, match=r"x: expected shape \(2, "):
        graph.run_packed(rows, 2)
    with pytest.raises(ValueError, match="seq_ids: unknown sequence 'zz'"):
        caches[1].append_tokens(["a", "zz"])
    assert caches[1].length("a") == caches[0].length("a")     # refused before any change


@pytest.mark.parametrize("seed", range(3))
def test_append_tokens_keeps_prepares_books(seed):
    """``append_tokens`` (its in-place path for a token that stays in an unshared last block,
    its full path otherwise) against ``prepare([(s, 1), ...])`` on a twin cache, under random
    forks, truncations, releases and decode steps of random subsets in random order: the same
    slots, lengths, blocks and free blocks after every operation; refusals change nothing."""
    import random
    rng = random.Random(seed)
    cfg = mla.MLAConfig.preset("tiny")
    twins = [mla.PagedLatentCache(cfg, num_layers=1, num_blocks=48, block_size=4) for _ in range(2)]
    for c in twins:
        c.prepare([("a", 3), ("b", 4), ("c", 9)])
    names = iter(f"s{i}" for i in range(1000))
    for _ in range(200):
        seqs = twins[0].seq_ids
        op = rng.random()
        if op < 0.1 and seqs:
            src, dst = rng.choice(seqs), next(names)
            for c in twins:
                c.fork(src, dst)
        elif op < 0.15 and seqs:
            s = rng.choice(seqs)
            n = rng.randint(0, twins[0].length(s))
            for c in twins:
                c.truncate(s, n)
        elif op < 0.2 and len(seqs) > 2:
            s = rng.choice(seqs)
            for c in twins:
                c.release(s)
        elif seqs:
            step = rng.sample(seqs, rng.randint(1, len(seqs)))
            try:
                want = twins[0].prepare([(s, 1) for s in step]).slot_mapping.tolist()
            except mla.CacheFullError:
                with pytest.raises(mla.CacheFullError):
                    twins[1].append_tokens(step)
            else:
                assert twins[1].append_tokens(step) == want
        assert twins[1].seq_ids == twins[0].seq_ids and twins[1].num_free_blocks == twins[0].num_free_blocks
        for s in twins[0].seq_ids:
            assert twins[1].length(s) == twins[0].length(s) and twins[1].blocks(s) == twins[0].blocks(s)
    assert twins[1].lengths(twins[0].seq_ids) == [twins[0].length(s) for s in twins[0].seq_ids]
    s = twins[0].seq_ids[0]
    before = twins[1].lengths([s])
    for bad, message in (([s, s], "appears twice"), ([s, "zz"], "unknown sequence 'zz'"),
                         ([s, ["x"]], "hashable")):
        with pytest.raises(ValueError, match=message):
            twins[1].append_tokens(bad)
        assert twins[1].lengths([s]) == before
    with pytest.raises(ValueError, match="seq_ids: unknown sequence 'zz'"):
        twins[1].lengths(["zz"])


# ---- refusals: ValueError naming the argument, the cache as it was ------------------------

def _decoding(num_seqs=3, block_size=4, length=5):
    cfg = mla.MLAConfig.preset("tiny")
    step = Step(cfg, 1, torch.float32)
    cache = nan_cache(cfg, torch.float32, block_size=block_size, num_layers=1)
    step(torch.randn(num_seqs * length, cfg.hidden_size), cache.prepare([(i, length) for i in range(num_seqs)]))
    return cfg, step, cache


def _snapshot(cache):
    return cache.kv.clone(), {s: cache.length(s) for s in cache.seq_ids}, cache.num_free_blocks


def _unchanged(cache, snap):
    kv, lengths, free = snap
    return same_kv(cache.kv, kv) and {s: cache.length(s) for s in cache.seq_ids} == lengths \
        and cache.num_free_blocks == free


@pytest.mark.parametrize("what,requests,match", [
    ("too many sequences", [(i, 1) for i in range(3)], "batch: expected 1 to 2 sequences.*buckets"),
    ("a prefill", [("new", 4)], "batch: expected pure decode"),
    ("a mixed batch", [(0, 1), ("new", 3)], "batch: expected pure decode"),
    ("other than s_q tokens", [(0, 2), (1, 2)], "batch: expected pure decode.*s_q=1"),
    ("a sequence with no new token", [(0, 1), (1, 0)], "batch: expected pure decode"),
    ("a table past max_blocks_per_seq", [(0, 1), (1, 1)], "batch: its block_table is 2 blocks wide.*"
                                                          "max_blocks_per_seq=1"),
])
def test_batches_the_graph_cannot_serve_are_refused(what, requests, match):
    cfg, step, cache = _decoding()
    graph = mla.StepGraph(step, cache, max_blocks_per_seq=1 if "table" in what else 4, buckets=(1, 2),
                          dtype=torch.float32)
    batch = cache.prepare(requests)
    snap = _snapshot(cache)
    assert not graph.fits(batch)
    with pytest.raises(ValueError, match=match):
        graph(torch.randn(batch.num_tokens, cfg.hidden_size), batch)
    assert _unchanged(cache, snap)
    step(torch.randn(batch.num_tokens, cfg.hidden_size), batch)   # the eager step serves it


def test_bad_calls_are_refused_before_any_write():
    cfg, step, cache = _decoding()
    graph = mla.StepGraph(step, cache, max_blocks_per_seq=4, buckets=(4,), dtype=torch.float32)
    other = nan_cache(cfg, torch.float32, num_layers=1)
    other.prepare([(0, 3)])
    cases = [   # (x, a function that makes the batch, what the call must say)
        (torch.randn(3, cfg.hidden_size), lambda: cache.prepare([(0, 1), (1, 1)]), "hidden_states: expected shape"),
        (torch.randn(2, cfg.hidden_size, dtype=torch.float64), lambda: cache.prepare([(0, 1), (1, 1)]),
         "hidden_states: expected torch.float32"),
        (torch.randn(1, cfg.hidden_size), lambda: other.prepare([(0, 1)]), "batch: prepared by another cache"),
        (torch.randn(1, cfg.hidden_size), lambda: "batch", "batch: expected a mla.Batch"),
        (torch.randn(1, cfg.hidden_size), lambda: graph._batches[4], "batch: expected a mla.Batch"),
        (torch.randn(1, cfg.hidden_size), lambda: (cache.prepare([(0, 1)]), cache.truncate(0, 5))[0], "stale"),
    ]
    for x, make_batch, match in cases:
        batch = make_batch()
        snap = _snapshot(cache)
        with pytest.raises(ValueError, match=match):
            graph(x, batch)
        assert _unchanged(cache, snap)


def test_a_layer_forcing_a_context_path_is_refused():
    cfg, _, cache = _decoding()
    layer = mla.MLA(cfg, dtype=torch.float32, strategy="cached")
    layer.load_hf_state_dict(random_state_dict(cfg, torch.Generator().manual_seed(1)))
    graph = mla.StepGraph(layer, cache, max_blocks_per_seq=4, buckets=(4,), dtype=torch.float32)
    batch = cache.prepare([(0, 1)])
    snap = _snapshot(cache)
    with pytest.raises(ValueError, match="strategy: a static"):
        graph(torch.randn(1, cfg.hidden_size), batch)
    assert _unchanged(cache, snap)


def test_constructor_arguments_are_checked():
    cfg, step, cache = _decoding()
    good = dict(max_blocks_per_seq=4)
    for kwargs, match in [(dict(max_blocks_per_seq=0), "max_blocks_per_seq"), (dict(good, s_q=0), "s_q"),
                          (dict(good, s_q=171 * 8), "s_q: expected at most"),
                          (dict(good, buckets=()), "buckets"), (dict(good, buckets=(0, 2)), "buckets"),
                          (dict(good, buckets=(1.5,)), "buckets"), (dict(good, dtype="bf16"), "dtype"),
                          (dict(good, input_shape=[256]), "input_shape"), (dict(good, pool=3), "pool")]:
        with pytest.raises(ValueError, match=match):
            mla.StepGraph(step, cache, **kwargs)
    with pytest.raises(ValueError, match="step_fn"):
        mla.StepGraph(None, cache, **good)
    with pytest.raises(ValueError, match="cache: expected a mla.PagedLatentCache"):
        mla.StepGraph(step, "cache", **good)
    sparse = cfg.replace(index_topk=8, index_n_heads=2, index_head_dim=16)
    for index_format in (None, "fp8"):     # served
        mla.StepGraph(step, mla.PagedLatentCache(sparse, num_blocks=4, block_size=4, index_format=index_format),
                      **good)
    with pytest.raises(ValueError, match="cache: .*sparse indexer: .*k-pool"):
        mla.StepGraph(step, mla.PagedLatentCache(sparse.replace(index_kpool=4, qk_rope_head_dim=0), num_blocks=4,
                                                 block_size=4), **good)


SPARSE = dict(index_topk=6, index_n_heads=2, index_head_dim=16)


@pytest.mark.parametrize("s_q,shared,index_format", [(1, False, None), (3, False, None), (1, True, None),
                                                     (3, True, None), (1, False, "fp8_ue8m0"), (3, True, "fp8")])
def test_sparse_static_path_equals_eager_step(s_q, shared, index_format):
    """A sparse-indexer config through the static buffers: every sequence on the sparse path
    (those within index_topk keys select all of them: the eager step's dense result), padding
    rows writing neither latent rows nor index keys (bf16 or FP8 key rows); GLM-5's shared
    layer recalls the first layer's top-k from the bucket's batch."""
    cfg = mla.MLAConfig.preset("tiny").replace(**SPARSE, index_shared_layers=(1,) if shared else ())
    step = Step(cfg, 2, torch.float32)
    caches = []
    for _ in range(2):
        cache = mla.PagedLatentCache(cfg, num_layers=2, num_blocks=64, block_size=4, dtype=torch.float32,
                                     index_format=index_format)
        cache.kv.fill_(float("nan"))
        cache.index_kv.fill_(255 if index_format else float("nan"))     # 0xFF bytes: NaN values and scales
        caches.append(cache)
    eager_cache, graph_cache = caches
    graph = mla.StepGraph(step, graph_cache, max_blocks_per_seq=16, s_q=s_q, buckets=(1, 2, 4, 8),
                          dtype=torch.float32)
    want = serve(eager_cache, step, s_q)
    got = serve(graph_cache, step, s_q, graph)
    assert len(got) == 6
    plan = step.layers[0].plan(graph._batches[4])
    assert plan.strategy == ["sparse"] * 4 and plan.sparse[0].max_seqlen_k == 16 * 4 and not plan.absorbed
    for w, o in zip(want, got):
        assert torch.isfinite(o).all()
        assert_same(o, w, torch.float32)
    # the same rows written (layer 1's inputs within float32 rounding of the eager step's), and no other
    assert same_kv(graph_cache.kv, eager_cache.kv, F32_RTOL)
    if index_format is None:
        assert same_kv(graph_cache.index_kv, eager_cache.index_kv, F32_RTOL)
    else:   # FP8 rows: the same rows written (within one e4m3 step: the padded GEMMs round apart), no other
        from mla import quant
        got_rows, want_rows = (c.index_kv.view(-1, c.index_kv.shape[-1]) for c in (graph_cache, eager_cache))
        written = (want_rows != 255).any(-1)
        assert torch.equal((got_rows != 255).any(-1), written) and written.sum() > 0
        got_k, want_k = (quant.dequantize_index(r[written], cfg.index_head_dim) for r in (got_rows, want_rows))
        assert (got_k - want_k).abs().max() <= 0.07 * want_k.abs().max()


def test_eager_decode_plan_is_one_group_on_the_batch_tensors():
    """A batch of decodes only plans one absorbed group on the batch's own table and lengths,
    the plan a StepGraph's bucket runs."""
    cfg, step, cache = _decoding()
    batch = cache.prepare([(0, 1), (1, 1), (2, 1)])
    plan = step.layers[0].plan(batch)
    assert plan.strategy == ["absorbed"] * 3 and len(plan.absorbed) == 1
    group = plan.absorbed[0]
    assert group.rows == slice(0, 3) and group.block_table is batch.block_table
    assert group.cache_seqlens is batch.cache_seqlens


# ---- GPU: captured graphs replayed against the eager step ---------------------------------

def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def gpu_trace(s_q):
    """DeepSeek-V3-sized lengths over 64-token pages; decode steps in buckets 8, 4, 1, 8, 2."""
    def dec(*seqs):
        return ("decode", [(s, s_q) for s in seqs])
    return [("prefill", [("a", 300), ("b", 70), ("c", 129)]), ("prefill", [("d", 520), ("e", 1)]),
            dec("a", "b", "c", "d", "e"), ("fork", "a", "f"), dec("a", "f", "b"), ("truncate", "b", s_q - 1 or 1),
            ("release", "c"), dec("b"), dec("a", "b", "d", "e", "f"), ("truncate", "f", 2), dec("f", "d")]


def run_gpu_trace(cfg, steps, s_q, dtype, backend, graphed, cache_dtype=None, fp8_weights=False,
                  index_format=None):
    """Two layers serving ``steps`` on a NaN-filled cache (its index keys too: NaN, or 0xFF bytes
    for FP8 rows) of 96 pages of 64, through a StepGraph of 32-block tables where ``graphed``:
    (outputs, cache, graph)."""
    step = Step(cfg, 2, dtype, device="cuda", backend=backend, fp8_weights=fp8_weights)
    cache = mla.PagedLatentCache(cfg, num_layers=2, num_blocks=96, block_size=64, dtype=cache_dtype or dtype,
                                 device="cuda", index_format=index_format)
    cache.kv.fill_(float("nan"))
    if cache.index_kv is not None:
        cache.index_kv.fill_(255 if index_format else float("nan"))
    # 32 blocks: bucket 8 of FP8 rows past the portable kernel's 8192 keys (the e4m3 kernel)
    graph = mla.StepGraph(step, cache, max_blocks_per_seq=32, s_q=s_q, dtype=dtype) if graphed else None
    outs = serve(cache, step, s_q, graph, device="cuda", dtype=dtype, steps=steps)
    torch.cuda.synchronize()
    return outs, cache, graph


@cuda
@pytest.mark.parametrize("cache_dtype,s_q,fp8_weights", [(torch.bfloat16, 1, False), (torch.bfloat16, 3, False),
                                                        (torch.float8_e4m3fn, 1, False),
                                                        (torch.float8_e4m3fn, 3, False),
                                                        (torch.bfloat16, 1, True), (torch.float8_e4m3fn, 1, True)])
def test_replayed_graph_matches_eager_step_gpu(cache_dtype, s_q, fp8_weights):
    """Two DeepSeek-V3 layers (16 heads) on one cache: the replays' error against a float32
    reference at most 2x bf16 PyTorch's own, buckets 1 to 8, fork/truncate/release between."""
    cfg = mla.MLAConfig.preset("deepseek-v3").replace(num_heads=16)
    steps = gpu_trace(s_q)

    def run(dtype, backend, graphed):
        rows = cache_dtype if cache_dtype == torch.float8_e4m3fn else dtype   # plain rows in the layer's dtype
        return run_gpu_trace(cfg, steps, s_q, dtype, backend, graphed, rows, fp8_weights)

    ref, _, _ = run(torch.float32, "torch", False)
    low, _, _ = run(torch.bfloat16, "torch", False)
    eager, eager_cache, _ = run(torch.bfloat16, "auto", False)
    got, graph_cache, graph = run(torch.bfloat16, "auto", True)
    assert graph.captured == (1, 2, 4, 8)
    for r, lo, e, o in zip(ref, low, eager, got):
        assert torch.isfinite(o).all()
        assert _rel(e, r) <= 2 * _rel(lo, r) + 1e-3
        assert _rel(o, r) <= 2 * _rel(lo, r) + 1e-3
    # the same slots written as the eager step's, and no other (padding rows write nothing)
    assert torch.equal(graph_cache.kv.float().isnan(), eager_cache.kv.float().isnan())


@cuda
@pytest.mark.parametrize("s_q,index_format", [(1, None), (2, None), (1, "fp8_ue8m0")])
def test_replayed_sparse_graph_matches_eager_step_gpu(s_q, index_format):
    """Two DeepSeek-V3.2 layers (16 heads, top-128 of up to 2048 keys, the second sharing the
    first's top-k as GLM-5 does) captured and replayed against the eager step on the same
    kernels: the first layer selects from the same inputs (the same keys), so the two agree
    within bf16 rounding (the eager step serves sequences within 128 keys densely); the same
    slots written, latent rows and index keys."""
    cfg = mla.MLAConfig.preset("deepseek-v3").replace(num_heads=16, index_topk=128, index_n_heads=8,
                                                      index_head_dim=128, index_shared_layers=(1,))
    steps = gpu_trace(s_q)

    eager, eager_cache, _ = run_gpu_trace(cfg, steps, s_q, torch.bfloat16, "auto", False, index_format=index_format)
    got, graph_cache, graph = run_gpu_trace(cfg, steps, s_q, torch.bfloat16, "auto", True, index_format=index_format)
    assert graph.captured == (1, 2, 4, 8) and len(got) == 5
    for e, o in zip(eager, got):
        assert torch.isfinite(o).all()
        assert _rel(o, e) <= 2e-2
    assert torch.equal(graph_cache.kv.float().isnan(), eager_cache.kv.float().isnan())
    unwritten = (lambda c: (c.index_kv == 255).all(-1)) if index_format else (lambda c: c.index_kv.float().isnan())
    assert torch.equal(unwritten(graph_cache), unwritten(eager_cache))


@cuda
def test_capture_all_then_replay_gpu():
    """capture() captures every bucket up front; a later call replays it, and replaying the
    same batch again rewrites the same slots with the same rows."""
    cfg = mla.MLAConfig.preset("deepseek-v3").replace(num_heads=16)
    step = Step(cfg, 1, torch.bfloat16, device="cuda")
    cache = nan_cache(cfg, torch.bfloat16, device="cuda", block_size=64, num_blocks=16, num_layers=1)
    graph = mla.StepGraph(step, cache, max_blocks_per_seq=4, buckets=(2, 4), dtype=torch.bfloat16)
    graph.capture()
    assert graph.captured == (2, 4)
    x = torch.randn(100, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    step(x, cache.prepare([("a", 60), ("b", 40)]))
    batch = cache.prepare([("a", 1), ("b", 1)])
    x1 = torch.randn(2, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    first = graph(x1, batch)
    kv = cache.kv.clone()
    again = graph(x1, batch)
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    assert same_kv(cache.kv, kv)
    eager = step(x1, batch)
    assert _rel(first, eager) <= 2e-2


@cuda
def test_failed_capture_leaves_the_generator_usable_gpu():
    """A step that cannot be captured (it reads a value back on the host) raises from capture;
    the device's random generator is as before it, not left in capture mode (every random op
    would raise), and a capturable step captures afterwards."""
    cfg = mla.MLAConfig.preset("deepseek-v3").replace(num_heads=16)
    step = Step(cfg, 1, torch.bfloat16, device="cuda")
    cache = nan_cache(cfg, torch.bfloat16, device="cuda", block_size=64, num_blocks=16, num_layers=1)

    def host_read(x, batch):
        out = step(x, batch)
        return out if out.float().sum().item() != 0.5 else out
    torch.cuda.manual_seed(7)
    torch.rand(3, device="cuda")
    state = torch.cuda.get_rng_state()
    bad = mla.StepGraph(host_read, cache, max_blocks_per_seq=4, buckets=(2,), dtype=torch.bfloat16)
    with pytest.raises(RuntimeError):
        bad.capture()
    assert torch.equal(torch.cuda.get_rng_state(), state)
    after = torch.rand(5, device="cuda")
    torch.cuda.set_rng_state(state)
    assert torch.equal(torch.rand(5, device="cuda"), after)
    good = mla.StepGraph(step, cache, max_blocks_per_seq=4, buckets=(2,), dtype=torch.bfloat16)
    good.capture()
    assert good.captured == (2,)
