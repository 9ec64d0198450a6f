"""mla.hf.engine: transformers' continuous batching (generate_batch, the manager) on the latent
cache gives every request the tokens transformers' own ``generate`` gives that prompt alone.

Tiny random float32 models of tests/test_hf_patch.py on CPU (identical tokens expected). Every
test records the steps the engine ran (through ``handle.engine_step``) to check what it claims
about them: mixed prefill + decode steps, chunked prefills, shared prefixes, and that no request
ever lost its rows (each request's steps continue where its last one ended).
"""
from __future__ import annotations

import pytest
import torch

import mla
import mla.hf
from test_hf_patch import CASES as PATCH_CASES, make_model
from transformers import ContinuousBatchingConfig, GenerationConfig

BLOCK = 4
# every exact and sparse family the patch serves, and DeepSeek-V2-Lite; Kimi Linear and GLM-5.3-Flash
# are refused (their linear-attention layers keep a state the engine's cache cannot page)
LINEAR = ("kimi_linear", "glm5_next_text")
CASES = {**{c: {} for c in PATCH_CASES if c not in LINEAR}, "deepseek_v2_lite": dict(q_lora_rank=None)}


def family(case: str) -> str:
    return "deepseek_v2" if case == "deepseek_v2_lite" else case


def prompts(lengths, seed: int, vocab: int = 32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def reference(model, prompt, new_tokens: int, **kw):
    """transformers' own greedy generate of one prompt alone (unpatched)."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, **kw)
    return out[0, len(prompt):].tolist()


class Steps:
    """Records each engine step's (request, cached, new) rows."""

    def __init__(self, handle):
        self.steps, self.graphed, plan = [], [], handle.engine_step

        def recording(kwargs):
            step = plan(kwargs)
            self.steps.append(list(step.requests))
            if step.batch is not None:      # the eager forward's rows are the requests'
                b = step.batch
                assert list(zip(b.seq_ids, b.num_cached, b.num_new)) == self.steps[-1]
            self.graphed.append(step.run is not None)
            return step
        handle.engine_step = recording

    def check_continuous(self):
        """Each request's rows continue its last step's: nothing was dropped and recomputed."""
        end = {}
        for step in self.steps:
            for rid, c, n in step:
                assert rid not in end or c == end[rid], (rid, c, end[rid])
                end[rid] = c + n

    def kinds(self):
        """Per step: the set of 'prefill' (c == 0), 'chunk' (c > 0, n > 1), 'decode' (n == 1, c > 0) rows."""
        return [{"prefill" if c == 0 else "decode" if n == 1 else "chunk" for _, c, n in s} for s in self.steps]


def finished(manager, count: int) -> dict:
    """Each of count requests' generated tokens, by request id, as the manager finishes them."""
    done = {}
    while len(done) < count:
        out = manager.get_result(timeout=30)
        assert out is not None, "the engine stopped answering"
        if out.is_finished():
            done[out.request_id] = out.generated_tokens
    return done


def serve(case, lengths, new_tokens=8, seed=0, graphs=None, **cb):
    model = make_model(family(case), **CASES[case])
    ps = prompts(lengths, seed)
    refs = [reference(model, p, new_tokens) for p in ps]
    handle = mla.hf.patch(model, num_blocks=16, block_size=BLOCK)
    mla.hf.enable(handle, graphs=graphs)
    steps = Steps(handle)
    config = ContinuousBatchingConfig(**{"block_size": BLOCK, "num_blocks": 64, "max_batch_tokens": 16, **cb})
    out = model.generate_batch(ps, GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1),
                               continuous_batching_config=config)
    return model, handle, refs, out, steps


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_generate_batch_matches_generate(case, graphs):
    """Six prompts (one longer than max_batch_tokens): each request's greedy tokens are generate's;
    the engine mixed prefills, a chunked prefill and decodes in its steps. graphs=True: every
    pure decode step ran the whole model on static buffers (on CPU eagerly, the buffers a CUDA
    graph replays), every other step the eager forward."""
    model, handle, refs, out, steps = serve(case, [7, 20, 5, 11, 3, 9], graphs=graphs)
    assert [o.generated_tokens for o in out.values()] == refs
    assert all(o.error is None for o in out.values())
    kinds = steps.kinds()
    assert any({"prefill", "decode"} <= k or {"chunk", "decode"} <= k for k in kinds), kinds
    assert any("chunk" in k for k in kinds), kinds
    steps.check_continuous()
    decode = [k == {"decode"} for k in kinds]
    assert sum(decode) >= 4 and steps.graphed == (decode if graphs else [False] * len(kinds))


def test_decode_steps_run_the_whole_step():
    """graphs=True: the decode-only steps, and only they, run the whole model on static buffers
    (no Batch of the tables); requests leaving and joining move rows, and a sequence entering a
    new block extends its packed row: the tokens are generate's."""
    model, handle, refs, out, steps = serve("deepseek_v3", [7, 20, 5, 3, 13], new_tokens=10, graphs=True,
                                            max_batch_tokens=8)
    assert [o.generated_tokens for o in out.values()] == refs
    kinds = steps.kinds()
    decode = [k == {"decode"} for k in kinds]
    mixed = [len(k) > 1 for k in kinds]
    assert sum(decode) >= 4 and any(mixed) and steps.graphed == decode
    assert len({len(s) for s, d in zip(steps.steps, decode) if d}) > 1      # several batch sizes
    steps.check_continuous()


@pytest.mark.parametrize("case", LINEAR)
def test_linear_attention_families_refused(case):
    handle = mla.hf.patch(make_model(case), num_blocks=16, block_size=BLOCK)
    with pytest.raises(ValueError, match="linear-attention"):
        mla.hf.enable(handle)


GREEDY = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1)


def cb_config():
    return ContinuousBatchingConfig(block_size=BLOCK, num_blocks=64, max_batch_tokens=16)


@pytest.mark.parametrize("case", ["deepseek_v3", "deepseek_v32"])
def test_patch_alone_serves_generate_batch(case):
    """transformers' documented path, without mla.hf.enable: patch, then generate_batch, runs on
    mla's engine (made at the first call) and gives generate's tokens."""
    model = make_model(case)
    ps = prompts([7, 12, 5], seed=3)
    refs = [reference(model, p, 6) for p in ps]
    handle = mla.hf.patch(model, num_blocks=16, block_size=BLOCK)
    out = model.generate_batch(ps, GREEDY, continuous_batching_config=cb_config())
    assert [o.generated_tokens for o in out.values()] == refs and all(o.error is None for o in out.values())
    assert isinstance(handle.engine, mla.hf.Engine)
    with pytest.raises(ValueError, match="enabled already"):
        mla.hf.enable(handle)


@pytest.mark.parametrize("case", LINEAR)
def test_patch_alone_refuses_linear_families_before_any_request(case):
    model = make_model(case)
    handle = mla.hf.patch(model, num_blocks=16, block_size=BLOCK)
    with pytest.raises(ValueError, match="linear-attention.*generate serves this one"):
        model.generate_batch(prompts([5], seed=0), GREEDY, continuous_batching_config=cb_config())
    assert handle.engine is None and handle.cache.num_free_blocks == 16


def test_disabled_engine_refused_by_name_then_enabled_again():
    model = make_model("deepseek_v3")
    ps = prompts([6, 9], seed=4)
    refs = [reference(model, p, 6) for p in ps]
    handle = mla.hf.patch(model, num_blocks=16, block_size=BLOCK)
    mla.hf.enable(handle).disable()
    for call in (lambda: model.generate_batch(ps, GREEDY, continuous_batching_config=cb_config()),
                 lambda: model.init_continuous_batching(GREEDY, cb_config())):
        with pytest.raises(ValueError, match=r"disabled.*mla\.hf\.enable\(handle\)"):
            call()
    mla.hf.enable(handle, graphs=False)
    out = model.generate_batch(ps, GREEDY, continuous_batching_config=cb_config())
    assert [o.generated_tokens for o in out.values()] == refs


def test_unpatch_gives_transformers_engine_back():
    model = make_model("deepseek_v3")
    own = type(model).init_continuous_batching
    handle = mla.hf.patch(model, num_blocks=16, block_size=BLOCK)
    assert "init_continuous_batching" in vars(model)
    handle.unpatch()
    assert "init_continuous_batching" not in vars(model) and model.init_continuous_batching.__func__ is own
    assert handle.engine is None
    with pytest.raises(ValueError, match="unpatch"):
        mla.hf.enable(handle)


def test_waits_never_evicts():
    """A pool of 10 blocks (40 tokens) holds one request's life at a time (~27 tokens): the others
    wait, none loses rows, all get generate's tokens, and the pool is whole at the end."""
    model, handle, refs, out, steps = serve("deepseek_v3", [14, 12, 15, 13], new_tokens=12, num_blocks=10)
    assert [o.generated_tokens for o in out.values()] == refs
    steps.check_continuous()
    at_once = max(len({rid for rid, _, _ in s}) for s in steps.steps)
    assert at_once == 1


def test_never_fits_is_refused():
    model = make_model("deepseek_v3")
    handle = mla.hf.patch(model, num_blocks=16, block_size=BLOCK)
    mla.hf.enable(handle)
    gen = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-1)
    small = ContinuousBatchingConfig(block_size=BLOCK, num_blocks=4, max_batch_tokens=16)
    with pytest.raises(ValueError, match="can never fit"):
        model.generate_batch(prompts([6, 14], 0), gen, continuous_batching_config=small)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.generate_batch(prompts([60], 0), gen, continuous_batching_config=ContinuousBatchingConfig(
            block_size=BLOCK, num_blocks=64))
    manager = model.init_continuous_batching(gen, small)
    with pytest.raises(ValueError, match="can never fit"):
        manager.add_request(prompts([14], 1)[0])
    # async batching needs CUDA streams: refused for a model on the CPU
    for bad in (dict(use_cuda_graph=True), dict(max_blocks_per_request=8), dict(cpu_offload_space=1.0),
                *([dict(use_async_batching=True)] if model.device.type == "cpu" else [])):
        with pytest.raises(ValueError, match=next(iter(bad))):
            model.init_continuous_batching(gen, ContinuousBatchingConfig(**bad))


def test_manager_stream_cancel_and_prefix_sharing():
    """The manager: a request streams token by token; a second request sharing its 12-token prefix
    starts from the 3 blocks the first one filled (latent rows shared, not recomputed) and gets
    generate's tokens; a cancelled request ends and frees its blocks while another completes."""
    model = make_model("deepseek_v3")
    base = prompts([12], 3)[0]
    a, b = base + [1, 2, 3], base + [4, 5]
    long = prompts([9], 4)[0]
    refs = [reference(model, p, 8) for p in (a, b)] + [reference(model, long, 20)]
    handle = mla.hf.patch(model, num_blocks=16, block_size=BLOCK)
    mla.hf.enable(handle)
    steps = Steps(handle)
    gen = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-1)
    manager = model.init_continuous_batching(gen, ContinuousBatchingConfig(block_size=BLOCK, num_blocks=32))
    cache = manager.cache
    manager.start()
    try:
        rid = manager.add_request(a, streaming=True)
        seen = [len(o.generated_tokens) for o in manager.request_id_iter(rid)]
        assert seen[-1] == 8 and len(seen) >= 2, seen
        rid_b = manager.add_request(b)
        out_b = next(o for o in manager.request_id_iter(rid_b) if o.is_finished())
        assert out_b.generated_tokens == refs[1]
        first_b = next(s for s in steps.steps if any(r == rid_b for r, _, _ in s))
        assert [(c, n) for r, c, n in first_b if r == rid_b] == [(12, 2)]
        assert cache._total_prefix_length >= 12

        victim = manager.add_request(long, max_new_tokens=20, streaming=True)
        keep = manager.add_request(long, max_new_tokens=20)
        for o in manager.request_id_iter(victim):
            if len(o.generated_tokens) >= 2:
                manager.cancel_request(victim)
                break
        out_keep = next(o for o in manager.request_id_iter(keep) if o.is_finished())
        assert out_keep.generated_tokens == refs[2]
        assert victim not in manager.batch_processor.scheduler.active_requests
    finally:
        manager.stop(block=True, timeout=10)
    assert cache.get_num_free_blocks() == cache.num_blocks and not cache._reserved
    steps.check_continuous()


def test_stop_tokens_sampling_and_num_return_sequences():
    """An EOS ends a request where generate ends it; top_k=1 sampling is greedy; three returned
    sequences of one prompt (forks of its blocks; transformers samples them, top_k=1 here) each
    carry generate's greedy tokens."""
    model = make_model("deepseek_v3")
    ps = prompts([7, 10], 5)
    refs = [reference(model, p, 8) for p in ps]
    at = next(i for i in range(2, 8) if refs[0][i] not in refs[0][:i])
    eos = refs[0][at]
    stopped = [reference(model, p, 8, eos_token_id=eos, pad_token_id=0) for p in ps]
    handle = mla.hf.patch(model, num_blocks=16, block_size=BLOCK)
    mla.hf.enable(handle)
    cb = ContinuousBatchingConfig(block_size=BLOCK, num_blocks=64)
    out = model.generate_batch(ps, GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=eos),
                               continuous_batching_config=cb)
    got = [o.generated_tokens for o in out.values()]
    want = [s[:s.index(eos) + 1] if eos in s else s for s in stopped]
    assert got == want and len(got[0]) == at + 1
    out = model.generate_batch(ps, GenerationConfig(max_new_tokens=8, do_sample=True, top_k=1, eos_token_id=-1),
                               continuous_batching_config=cb)
    assert [o.generated_tokens for o in out.values()] == refs
    # generate_batch returns the parent requests only: the manager hands out every sequence
    manager = model.init_continuous_batching(GenerationConfig(max_new_tokens=8, do_sample=True, top_k=1,
                                                              eos_token_id=-1, num_return_sequences=3), cb)
    manager.start()
    try:
        manager.add_request(ps[0])
        outs = [manager.get_result(timeout=30) for _ in range(3)]
    finally:
        manager.stop(block=True, timeout=10)
    assert sorted(o.request_id for o in outs) == ["req_0", "req_0__child#0", "req_0__child#1"]
    assert all(o.generated_tokens == refs[0] for o in outs), outs


@pytest.mark.parametrize("graphs", [False, True])
def test_persistent_manager_serves_again(graphs):
    """generate_batch(persistent_manager=True) keeps the manager and its latent pool; the second
    call reuses them (and the request ids, on other blocks), on the latent attention again, and
    the model's own is back after each."""
    model = make_model("deepseek_v3")
    ps = prompts([6, 9], 7)
    refs = [reference(model, p, 6) for p in ps]
    handle = mla.hf.patch(model, num_blocks=16, block_size=BLOCK)
    mla.hf.enable(handle, graphs=graphs)
    gen = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1)
    cb = ContinuousBatchingConfig(block_size=BLOCK, num_blocks=64)
    first = model.generate_batch(ps, gen, continuous_batching_config=cb, persistent_manager=True)
    kept = model._cached_continuous_batching_manager
    assert model.config._attn_implementation == "eager"
    second = model.generate_batch(ps[::-1], gen, continuous_batching_config=cb, persistent_manager=True)
    assert model._cached_continuous_batching_manager is kept
    assert [o.generated_tokens for o in first.values()] == refs
    assert [o.generated_tokens for o in second.values()] == refs[::-1]
    assert model.config._attn_implementation == "eager"
    model.destroy_cached_continuous_batching_manager()


def test_pool_sized_by_latent_rows():
    """DeepSeek-V3 (61 layers, 128 heads): the memory that holds N expanded K/V tokens holds ~71x
    more latent rows; the step's activations and workspace come off first."""
    cfg = mla.MLAConfig.preset("deepseek-v3")
    kw = dict(num_layers=61, dtype=torch.bfloat16, vocab_size=129280, block_size=64, max_batch_tokens=8192,
              max_workspace_tokens=65536)
    available = 100 * 2 ** 30
    blocks = mla.hf.engine.pool_blocks(cfg, available=available, **kw)
    expanded = 61 * cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * 2
    latent = 61 * 576 * 2 + 8
    fixed = 65536 * 128 * 256 * 2 + 8192 * (2 * (4 * 7168 + 128 * (256 + 64 + 256)) + 4 * 129280 + 64)
    assert blocks == (available - fixed) // latent // 64
    assert blocks * 64 > 60 * (available - fixed) // expanded
    assert mla.hf.engine.pool_blocks(cfg, available=fixed, **kw) == 0
    # FP8 tile rows: 656 bytes a token and layer (the activations stay bf16)
    tile = mla.hf.engine.pool_blocks(cfg, available=available, cache_format="fp8_tile", **kw)
    assert tile == (available - fixed) // (61 * 656 + 8) // 64


def test_engine_cache_keeps_the_patch_cache_format():
    """The engine's latent pool stores the rows the patch's cache does: FP8 rows stay FP8 with
    their scale, and the tokens equal the patched generate's on that format."""
    model = make_model("deepseek_v3")
    ps = prompts([5, 9], seed=3)
    cfg = mla.hf.patch_config(model)
    cache = mla.PagedLatentCache(cfg, num_layers=model.config.num_hidden_layers, num_blocks=16, block_size=BLOCK,
                                 dtype=torch.float8_e4m3fn, kv_scale=0.5)
    handle = mla.hf.patch(model, cache, dtype=torch.float32)
    refs = [model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False)[0, len(p):].tolist() for p in ps]
    mla.hf.enable(handle)
    manager = model.init_continuous_batching(GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1),
                                             ContinuousBatchingConfig(block_size=BLOCK, num_blocks=32))
    latent = manager.cache.latent
    assert (latent.format, latent.kv_scale, latent.kv.dtype) == ("fp8", 0.5, torch.float8_e4m3fn)
    out = model.generate_batch(ps, GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1),
                               continuous_batching_config=ContinuousBatchingConfig(block_size=BLOCK, num_blocks=32))
    assert [o.generated_tokens for o in out.values()] == refs


def test_request_id_used_again_on_other_blocks():
    """graphs=True: a request id used again after its request ended (transformers lets a caller
    name requests) is packed from its new blocks, not the row its earlier request left."""
    model = make_model("deepseek_v3")
    first, second, other = prompts([6, 7, 9], 8)
    refs = [reference(model, p, 8) for p in (first, second)]
    handle = mla.hf.patch(model, num_blocks=16, block_size=BLOCK)
    mla.hf.enable(handle, graphs=True)
    steps = Steps(handle)
    gen = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-1)
    manager = model.init_continuous_batching(gen, ContinuousBatchingConfig(block_size=BLOCK, num_blocks=32))
    manager.start()
    try:
        manager.add_request(first, request_id="x")
        got = [next(o for o in manager.request_id_iter("x") if o.is_finished()).generated_tokens]
        manager.add_request(other, request_id="y", max_new_tokens=4)   # takes the blocks "x" freed
        manager.add_request(second, request_id="x")
        got.append(next(o for o in manager.request_id_iter("x") if o.is_finished()).generated_tokens)
    finally:
        manager.stop(block=True, timeout=10)
    assert got == refs
    assert sum(steps.graphed) >= 8


def test_warm_up_sweep_then_serves_the_same_tokens():
    """LatentCache.warm_up's eager sweep (it runs on a GPU; here directly, on CPU) runs the
    layer over 1..16 decode rows, 15 absorbed chunk lengths, 1..64 prompts and 1..16 expanded
    chunks on scratch rows of the empty pool (NaN-filled before it): afterwards the engine's
    tokens equal transformers' own, so no request reads a scratch row."""
    model = make_model("deepseek_v3", num_hidden_layers=1)
    ps = prompts([7, 20, 5, 11, 30], 2)
    refs = [reference(model, p, 6) for p in ps]
    handle = mla.hf.patch(model, num_blocks=16, block_size=BLOCK)
    mla.hf.enable(handle)
    gen = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1)
    manager = model.init_continuous_batching(gen, ContinuousBatchingConfig(block_size=BLOCK, num_blocks=64,
                                                                           max_batch_tokens=16))
    calls = []
    hook = handle.layers[0].register_forward_pre_hook(lambda m, a: calls.append(a[1].num_seqs))
    manager.cache.latent.kv.fill_(float("nan"))
    manager.cache._sweep(256)
    hook.remove()
    assert len(calls) == 16 + 15 + 64 + 16 and max(calls) == 65     # 64 prompts beside a decode row
    assert manager.cache.get_num_free_blocks() == 64
    manager.start()
    try:
        for i, p in enumerate(ps):
            manager.add_request(p, request_id=f"r{i}")
        done = finished(manager, len(ps))
    finally:
        manager.stop(block=True, timeout=30)
    assert [done[f"r{i}"] for i in range(len(ps))] == refs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("use_async", [None, False])
def test_decode_steps_graphed_on_gpu(use_async):
    """On a GPU (graphs on by default): the pure decode steps replay the whole model's CUDA graph
    of their bucket, the other steps run eagerly; float32 tokens equal the unpatched generate's,
    with the engine's async double-buffering (on by default: step N+1 launched before step N's
    tokens are read, requests ending while the next step is in flight) and without. One dense
    layer: transformers' float32 grouped MoE cannot be captured on the H200
    (test_uncapturable_model_decodes_eagerly)."""
    model = make_model("deepseek_v3", num_hidden_layers=1).cuda()
    ps = prompts([7, 20, 5, 11, 3, 16], 0)
    budgets = [8, 3, 8, 5, 2, 8]         # requests end at different steps, with others running
    refs = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=n, do_sample=False)[0, len(p):].tolist()
            for p, n in zip(ps, budgets)]
    handle = mla.hf.patch(model, num_blocks=16, block_size=BLOCK)
    mla.hf.enable(handle)
    steps = Steps(handle)
    config = ContinuousBatchingConfig(block_size=BLOCK, num_blocks=64, max_batch_tokens=16,
                                      use_async_batching=use_async)
    manager = model.init_continuous_batching(GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-1),
                                             config)
    assert manager.batch_processor.use_async_batching is (use_async is None)
    manager.start()
    cache = manager.cache               # stop() lets the batch processor go
    try:
        for i, (p, n) in enumerate(zip(ps, budgets)):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=n)
        done = finished(manager, len(ps))
    finally:
        manager.stop(block=True, timeout=30)
    assert [done[f"r{i}"] for i in range(len(ps))] == refs
    assert cache.get_num_free_blocks() == cache.num_blocks
    decode = [k == {"decode"} for k in steps.kinds()]
    assert sum(decode) >= 4 and steps.graphed == decode


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_warmup_compiles_what_the_eager_steps_run():
    """After the manager's warm-up (graphs captured, LatentCache.warm_up's eager steps of 1..256
    decode rows beside a prompt and a chunk) no Triton or Gluon kernel compiles while serving a
    mixed trace: prompts of 2-40 tokens chunked under max_batch_tokens 24, 6-14 new tokens each,
    so that the steps mix prefills, chunks and 1-16 decode rows."""
    from triton.runtime.jit import JITFunction
    model = make_model("deepseek_v3", num_hidden_layers=1).cuda()
    handle = mla.hf.patch(model, num_blocks=16, block_size=BLOCK)
    mla.hf.enable(handle)
    steps = Steps(handle)
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(2, 41, (16,), generator=g).tolist()
    budgets = torch.randint(6, 15, (16,), generator=g).tolist()
    gen = GenerationConfig(max_new_tokens=14, do_sample=False, eos_token_id=-1)
    manager = model.init_continuous_batching(gen, ContinuousBatchingConfig(block_size=BLOCK, num_blocks=256,
                                                                           max_batch_tokens=24))
    manager.warmup()
    assert manager.warmup_s > 0
    compiled, compile_fn = [], JITFunction._do_compile

    def counting(fn, *a, **k):
        compiled.append(fn.__name__)
        return compile_fn(fn, *a, **k)
    JITFunction._do_compile = counting
    try:
        manager.start()
        for i, (p, n) in enumerate(zip(prompts(lengths, 4), budgets)):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=n)
        done = finished(manager, len(lengths))
    finally:
        JITFunction._do_compile = compile_fn
        manager.stop(block=True, timeout=30)
    assert [len(done[f"r{i}"]) for i in range(len(lengths))] == budgets
    kinds = steps.kinds()
    assert any(len(k) > 1 and "decode" in k for k in kinds), kinds        # mixed steps ran eagerly
    assert compiled == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_uncapturable_model_decodes_eagerly():
    """A model whose decode step cannot be captured (here a hook that reads its logits back on
    the host, which no capture allows): with graphs on by default the warm-up warns and every
    step runs eagerly, with the same tokens; with graphs=True it raises ValueError."""
    model = make_model("deepseek_v3", num_hidden_layers=1).cuda()
    model.lm_head.register_forward_hook(lambda m, i, o: None if o.sum().item() else None)
    ps = prompts([7, 20, 5], 1)
    refs = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=6, do_sample=False)[0, len(p):].tolist()
            for p in ps]
    gen = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1)
    config = ContinuousBatchingConfig(block_size=BLOCK, num_blocks=64, max_batch_tokens=16)
    handle = mla.hf.patch(model, num_blocks=16, block_size=BLOCK)
    engine = mla.hf.enable(handle)
    steps = Steps(handle)
    with pytest.warns(RuntimeWarning, match="cannot be captured"):
        out = model.generate_batch(ps, gen, continuous_batching_config=config)
    assert [o.generated_tokens for o in out.values()] == refs
    assert not any(steps.graphed) and {"decode"} in steps.kinds()
    engine.disable()
    handle.unpatch()
    handle = mla.hf.patch(model, num_blocks=16, block_size=BLOCK)
    mla.hf.enable(handle, graphs=True)
    with pytest.raises(ValueError, match="graphs: the model's decode step cannot be captured"):
        model.generate_batch(ps, gen, continuous_batching_config=config)


def test_prefill_tokens_keep_decode_steps_short():
    """enable(prefill_tokens=3): while requests decode, a step takes at most 3 prompt tokens beside
    their one token each (a long prompt arriving is chunked), the tokens are generate's; a step
    with nothing decoding still fills max_batch_tokens."""
    model = make_model("deepseek_v3")
    ps = prompts([5, 6, 30, 4], seed=8)
    refs = [reference(model, p, 8) for p in ps]
    handle = mla.hf.patch(model, num_blocks=16, block_size=BLOCK)
    mla.hf.enable(handle, graphs=False, prefill_tokens=3)
    steps = Steps(handle)
    out = model.generate_batch(ps, GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-1),
                               continuous_batching_config=ContinuousBatchingConfig(block_size=BLOCK, num_blocks=64,
                                                                                   max_batch_tokens=16))
    assert [o.generated_tokens for o in out.values()] == refs
    steps.check_continuous()
    mixed = [s for s in steps.steps if any(n == 1 and c > 0 for _, c, n in s)]
    assert mixed and all(sum(n for _, c, n in s if not (n == 1 and c > 0)) <= 3 for s in mixed)
    assert sum(n for _, _, n in steps.steps[0]) == 16      # the first step: prompts only, the whole budget
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="prefill_tokens"):
            mla.hf.enable(mla.hf.patch(make_model("deepseek_v3"), num_blocks=16, block_size=BLOCK), prefill_tokens=bad)
