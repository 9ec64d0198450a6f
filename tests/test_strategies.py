"""The plan's cost rule and every context/decode strategy against transformers: chunked
prefill under a workspace budget, absorbed context, the rule."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import mla
from mla import expanded
from mla.strategy import absorb_max_new, choose_strategy
from hf_util import PREFIX, FP32_TOL, hf_reference, make_attention, make_config, rel_err, state_dict


def test_rule_pins_every_path():
    cfg = mla.MLAConfig.preset("deepseek-v3")
    assert absorb_max_new(cfg) == 512 * 256 // 768 == 170
    W = 65536
    assert choose_strategy(cfg, 0, 0, W) is None
    assert choose_strategy(cfg, 0, 1, W) == "prefill"
    assert choose_strategy(cfg, 0, 4096, W) == "prefill"
    assert choose_strategy(cfg, 5000, 1, W) == "absorbed"          # decode
    assert choose_strategy(cfg, 5000, 4, W) == "absorbed"          # 1 + 3 drafts
    assert choose_strategy(cfg, 5000, 170, W) == "absorbed"
    assert choose_strategy(cfg, 5000, 171, W) == "cached"
    assert choose_strategy(cfg, W, 4096, W) == "cached"
    assert choose_strategy(cfg, W + 1, 4096, W) == "chunked"
    assert choose_strategy(cfg, 131072, 4096, W) == "chunked"


def test_rule_overrides():
    """The layer's forced strategy, Helix CP and the sparse indexer are part of the pure rule."""
    cfg, W = mla.MLAConfig.preset("deepseek-v3"), 1024
    assert choose_strategy(cfg, 100, 1, W, force="cached") == "cached"
    assert choose_strategy(cfg, W + 1, 1, W, force="cached") == "chunked"      # past the workspace
    assert choose_strategy(cfg, 100, 500, W, force="absorbed") == "absorbed"
    assert choose_strategy(cfg, 0, 5, W, force="absorbed") == "prefill"        # no prefix to absorb
    assert choose_strategy(cfg, 100, 0, W, force="cached") is None
    assert choose_strategy(cfg, 100, 500, W, cp_size=2) == "absorbed"          # no whole prefix on a rank
    assert choose_strategy(cfg, 0, 500, W, cp_size=2) == "prefill"
    sparse = cfg.replace(index_topk=64, index_n_heads=4, index_head_dim=128)
    assert choose_strategy(sparse, 40, 24, W) == "absorbed"                    # 64 keys: all selected
    assert choose_strategy(sparse, 40, 25, W) == "sparse"
    assert choose_strategy(sparse, 0, 65, W) == "sparse"
    assert choose_strategy(sparse, 0, 5, W, force="sparse") == "sparse"
    assert choose_strategy(sparse.replace(attention_sinks=True), 0, 5, W) == "sparse"


def _setup(variant="v3", workspace=16, seed=0, max_pos=256, strategy=None):
    hf_cfg = make_config(variant, max_position_embeddings=max_pos)
    attn, rotary = make_attention(hf_cfg, seed)
    cfg = mla.MLAConfig.from_hf(hf_cfg)
    layer = mla.MLA(cfg, dtype=torch.float32, backend="torch", max_workspace_tokens=workspace, strategy=strategy)
    layer.load_hf_state_dict(state_dict(attn), prefix=PREFIX)
    return cfg, layer, attn, rotary


@pytest.mark.parametrize("strategy", [None, "cached", "chunked", "absorbed", "prefill"])
def test_long_prefix_every_path_matches_transformers(strategy):
    """150 cached tokens (two sequences, one forked) over a workspace of 16, then 40 new.
    ("prefill" forced is the natural rule: forcing it over a cached prefix dropped the prefix.)"""
    cfg, layer, attn, rotary = _setup(strategy=strategy)
    g = torch.Generator().manual_seed(1)
    cache = mla.PagedLatentCache(cfg, num_blocks=128, block_size=8, dtype=torch.float32)
    hist = {"a": torch.randn(150, cfg.hidden_size, generator=g)}
    layer(hist["a"], cache.prepare([("a", 150)]))
    cache.fork("a", "b")
    hist["b"] = hist["a"][:150].clone()
    _steps_match_transformers(layer, cache, attn, rotary, [[("a", 40), ("b", 23)], [("b", 1), ("a", 3)]], g, hist)


def _steps_match_transformers(layer, cache, attn, rotary, steps, g, hist):
    """Each step (random new tokens for [(seq, n), ...]) through the layer, every sequence's rows
    against transformers over its whole history (hist: seq -> its tokens so far, extended here)."""
    for step in steps:
        batch = cache.prepare(step)
        x = torch.cat([torch.randn(n, layer.cfg.hidden_size, generator=g) for _, n in step])
        out = layer(x, batch)
        off = 0
        for seq, n in step:
            hist[seq] = torch.cat((hist.get(seq, x[:0]), x[off: off + n]))
            assert rel_err(out[off: off + n], hf_reference(attn, rotary, hist[seq])[-n:]) <= FP32_TOL
            off += n


def test_workspace_bound_holds(monkeypatch):
    """The expanded K/V of a prefix never exceeds max_workspace_tokens rows at once."""
    cfg, layer, attn, rotary = _setup(workspace=16)
    sizes = []
    keys_values = expanded._keys_values

    def recording(layer_, c_kv, k_pe):
        sizes.append(c_kv.shape[0])
        return keys_values(layer_, c_kv, k_pe)

    monkeypatch.setattr(expanded, "_keys_values", recording)
    g = torch.Generator().manual_seed(2)
    cache = mla.PagedLatentCache(cfg, num_blocks=64, block_size=8, dtype=torch.float32)
    x0 = torch.randn(150, cfg.hidden_size, generator=g)
    layer(x0, cache.prepare([("s", 150)]))                # prefill: no prefix expanded
    n = absorb_max_new(cfg) + 5                           # past the absorbed crossover
    x1 = torch.randn(n, cfg.hidden_size, generator=g)
    sizes.clear()
    batch = cache.prepare([("s", n)])
    out = layer(x1, batch)
    plan = layer.plan(batch)
    assert plan.strategy == ["chunked"]
    # the new tokens' own expansion (n rows, the caller's chunk) plus prefix chunks of <= 16
    assert sizes[0] == n and max(sizes[1:]) <= 16 and sum(sizes[1:]) == 150
    ref = hf_reference(attn, rotary, torch.cat((x0, x1)))[-n:]
    assert rel_err(out, ref) <= FP32_TOL


def test_chunk_passes_are_shared_by_sequences():
    cfg, layer, _, _ = _setup(workspace=16, strategy="chunked")
    cache = mla.PagedLatentCache(cfg, num_blocks=64, block_size=4, dtype=torch.float32)
    layer(torch.randn(10, cfg.hidden_size), cache.prepare([("a", 10)]))
    layer(torch.randn(5, cfg.hidden_size), cache.prepare([("b", 5)]))
    batch = cache.prepare([("a", 2), ("b", 2)])
    layer(torch.randn(4, cfg.hidden_size), batch)
    plan = layer.plan(batch)
    # 10 + 5 prefix rows fit one pass of 16: both sequences share it
    assert len(plan.chunked.passes) == 1 and plan.chunked.passes[0].num_keys == 15


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_chunked_prefill_peak_memory_gpu():
    """On the GPU the peak allocation of a chunked step grows with the workspace, not the prefix."""
    cfg = mla.MLAConfig.preset("deepseek-v2-lite")
    peaks = {}
    for workspace in (512, 4096):
        layer = mla.MLA(cfg, dtype=torch.bfloat16, device="cuda", max_workspace_tokens=workspace)
        from mla.testing import random_state_dict
        layer.load_hf_state_dict(random_state_dict(cfg, torch.Generator().manual_seed(0)))
        cache = mla.PagedLatentCache(cfg, num_blocks=300, block_size=64, dtype=torch.bfloat16, device="cuda")
        layer(torch.randn(16384, cfg.hidden_size, dtype=torch.bfloat16, device="cuda"), cache.prepare([("s", 16384)]))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        layer(torch.randn(256, cfg.hidden_size, dtype=torch.bfloat16, device="cuda"), cache.prepare([("s", 256)]))
        peaks[workspace] = torch.cuda.max_memory_allocated() - base
    per_row = cfg.num_heads * (cfg.qk_head_dim + cfg.v_head_dim) * 2 * 2     # k and v, bf16 (no kv_b temporary)
    assert peaks[512] < peaks[4096]
    assert peaks[4096] - peaks[512] <= (4096 - 512) * per_row * 1.5


# ------------------------------------------------- the expansion writes in place


class _Ops(TorchDispatchMode):
    """Records every aten op run inside it: (name, args, kwargs, result)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        self.calls.append((func.overloadpacket.__name__, args, kwargs, result))
        return result


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_expansion_writes_into_the_key_and_value_buffers():
    """kv_b_proj writes k_nope and v straight into the k and v that attention reads: no op makes
    storage besides k and v (so no [N, H, dn + dv] temporary), both GEMMs write views of them,
    and the one copy is k_pe broadcast into each head's last dr columns."""
    cfg, layer, _, _ = _setup()
    N, H, r = 11, cfg.num_heads, cfg.kv_lora_rank
    dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    latent = torch.randn(N, r + dr, generator=torch.Generator().manual_seed(3))   # rows as gathered
    with _Ops() as ops:
        k, v = expanded._keys_values(layer, latent[:, :r], latent[:, r:])
    assert k.shape == (N, H, dn + dr) and v.shape == (N, H, dv) and k.is_contiguous() and v.is_contiguous()
    known = {_storage(latent), _storage(layer.w_kv_b), _storage(k), _storage(v)}
    for name, _, _, result in ops.calls:
        assert _storage(result) in known, f"{name} made a tensor of shape {tuple(result.shape)}"
    gemms = [kwargs["out"] for name, _, kwargs, _ in ops.calls if name == "bmm"]
    assert [_storage(t) for t in gemms] == [_storage(k), _storage(v)]
    copies = [args[0] for name, args, _, _ in ops.calls if name == "copy_"]
    assert len(copies) == 1 and copies[0].shape == (N, H, dr) and _storage(copies[0]) == _storage(k)
    # the values: kv_b_proj as one GEMM, split per head (docs/design.md section 1)
    kv = F.linear(latent[:, :r], layer.w_kv_b).view(N, H, dn + dv)
    torch.testing.assert_close(k[..., :dn], kv[..., :dn])
    torch.testing.assert_close(v, kv[..., dn:])
    assert torch.equal(k[..., dn:], latent[:, None, r:].expand(N, H, dr))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_expansion_copies_nothing_gpu():
    """DeepSeek-V3 shapes in bf16: cuBLAS writes both halves in place. The expansion allocates
    exactly k and v, and launches one copy kernel (k_pe's broadcast) beside its two GEMMs.
    (On the CPU, bf16 bmm goes through oneDNN, which copies its inputs; fp32 does not.)"""
    cfg = mla.MLAConfig.preset("deepseek-v3")
    layer = mla.MLA(cfg, dtype=torch.bfloat16, device="cuda")
    torch.nn.init.normal_(layer.w_kv_b, std=cfg.kv_lora_rank ** -0.5)
    N, r, dn = 2048, cfg.kv_lora_rank, cfg.qk_nope_head_dim
    latent = torch.randn(N, r + cfg.qk_rope_head_dim, device="cuda", dtype=torch.bfloat16)
    expanded._keys_values(layer, latent[:, :r], latent[:, r:])     # warm-up: cuBLAS workspace, heuristics
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        k, v = expanded._keys_values(layer, latent[:, :r], latent[:, r:])
        torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base <= k.nbytes + v.nbytes + 1024
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith("Memset")]          # cuBLAS clears its own workspace
    copies = [n for n in kernels if "copy" in n.lower() or "elementwise" in n.lower()]
    assert len(copies) == 1 and len(kernels) == 3, kernels
    kv = F.linear(latent[:, :r], layer.w_kv_b).view(N, cfg.num_heads, -1)   # outputs ~N(0, 1)
    torch.testing.assert_close(k[..., :dn], kv[..., :dn], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(v, kv[..., dn:], atol=2e-2, rtol=2e-2)


def test_plan_carries_the_offsets_on_the_host():
    """Every attention call of a context strategy gets its offsets also as host ints
    (prefill_attention's offsets_q/k), equal to the device offsets."""
    from mla.strategy import build_plan

    cfg = mla.MLAConfig.preset("tiny")
    cache = mla.PagedLatentCache(cfg, num_blocks=64, block_size=8, dtype=torch.float32)
    cache.prepare([("a", 30), ("b", 5)])                          # cached prefixes
    batch = cache.prepare([("a", 7), ("b", 3), ("c", 12), ("d", 9)])
    for force, workspace in (("cached", 64), ("chunked", 16), (None, 64)):
        plan = build_plan(batch, cfg, workspace, force)
        groups = [g for g in (plan.prefill, plan.chunked) if g is not None]
        passes = plan.cached + [p for g in groups for p in g.passes]
        assert groups and (passes or force is None)
        for g in groups:
            assert g.offsets == tuple(g.cu_seqlens.tolist())
        for p in passes:
            assert p.offsets_q == tuple(p.cu_seqlens_q.tolist()) and p.offsets_k == tuple(p.cu_seqlens_k.tolist())


def test_decode_batch_reads_and_writes_its_rows_in_place():
    """A batch of decodes only: its rows are one run, so the absorbed path takes q as a view
    and the W_UV bmm writes the layer's output rows directly (no gather, no scatter)."""
    from mla import absorbed
    from mla.strategy import build_plan

    cfg, layer, _, _ = _setup()
    cache = mla.PagedLatentCache(cfg, num_blocks=64, block_size=8, dtype=torch.float32)
    cache.prepare([("a", 20), ("b", 9)])
    batch = cache.prepare([("a", 1), ("b", 1)])
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(4)))   # latents
    (group,) = build_plan(batch, cfg, 64).absorbed
    assert group.rows == slice(0, 2)
    q = torch.randn(2, cfg.num_heads, cfg.qk_head_dim, generator=torch.Generator().manual_seed(5))
    out = torch.zeros(2, cfg.num_heads, cfg.v_head_dim)
    with _Ops() as ops:
        absorbed.attend(layer, q, group, cache.layer(0), out)
    # (the reference decode gathers cache pages by index: those are the cache's, not q's)
    gathers_q = [n for n, args, _, _ in ops.calls if n == "index" and _storage(args[0]) == _storage(q)]
    scatters = [n for n, *_ in ops.calls if n.startswith("index_put")]
    assert not gathers_q and not scatters
    uv = [kwargs["out"] for name, _, kwargs, _ in ops.calls if name == "bmm" and "out" in kwargs][-1]
    assert _storage(uv) == _storage(out)
    # the same values as through an index tensor (gather q, scatter the output)
    group.rows = torch.arange(2)
    scattered = torch.zeros_like(out)
    absorbed.attend(layer, q, group, cache.layer(0), scattered)
    assert out.abs().sum() > 0 and torch.equal(out, scattered)


def test_pure_decode_steps_rotate_queries_into_the_absorbed_buffer(monkeypatch):
    """rope_append's q_out: a step whose rows are all absorbed decode (one s_q) has the rotated
    queries written into the absorbed query buffer; a prompt, a mixed step and a step of two
    draft counts rotate them in place (other paths read q). Every step matches transformers."""
    from mla import ops

    cfg, layer, attn, rotary = _setup()
    seen = []
    real = ops.rope_append

    def spy(*args, q_out=None, **kwargs):
        seen.append(q_out is not None)
        return real(*args, q_out=q_out, **kwargs)

    monkeypatch.setattr(ops, "rope_append", spy)
    g = torch.Generator().manual_seed(2)
    cache = mla.PagedLatentCache(cfg, num_blocks=64, block_size=8, dtype=torch.float32)
    steps = [[("a", 20), ("b", 9)], [("a", 1), ("b", 1)], [("a", 3), ("b", 3)], [("a", 1), ("c", 5)],
             [("a", 2), ("b", 1)]]
    _steps_match_transformers(layer, cache, attn, rotary, steps, g, {})
    assert seen == [False, True, True, False, False]
