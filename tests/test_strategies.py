"""The plan's cost rule and every context/decode strategy against transformers
(issue 3: chunked prefill under a workspace budget, absorbed context, the rule)."""
from __future__ import annotations

import pytest
import torch

import mla
from mla import context
from mla.plan import absorb_max_new, choose_strategy
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


def _setup(variant="v3", workspace=16, seed=0, max_pos=256):
    hf_cfg = make_config(variant, max_position_embeddings=max_pos)
    attn, rotary = make_attention(hf_cfg, seed)
    cfg = mla.MLAConfig.from_hf(hf_cfg)
    layer = mla.MLA(cfg, dtype=torch.float32, backend="torch", max_workspace_tokens=workspace)
    layer.load_hf_state_dict(state_dict(attn), prefix=PREFIX)
    return cfg, layer, attn, rotary


@pytest.mark.parametrize("strategy", [None, "cached", "chunked", "absorbed"])
def test_long_prefix_every_path_matches_transformers(strategy):
    """150 cached tokens (two sequences, one forked) over a workspace of 16, then 40 new."""
    cfg, layer, attn, rotary = _setup()
    layer.force_strategy = strategy
    g = torch.Generator().manual_seed(1)
    cache = mla.PagedLatentCache(cfg, num_blocks=128, block_size=8, dtype=torch.float32)
    hist = {"a": torch.randn(150, cfg.hidden_size, generator=g)}
    layer(hist["a"], cache.prepare([("a", 150)]))
    cache.fork("a", "b")
    hist["b"] = hist["a"][:150].clone()
    steps = [[("a", 40), ("b", 23)], [("b", 1), ("a", 3)]]
    for step in steps:
        batch = cache.prepare(step)
        x = torch.cat([torch.randn(n, cfg.hidden_size, generator=g) for _, n in step])
        out = layer(x, batch)
        off = 0
        for seq, n in step:
            hist[seq] = torch.cat((hist[seq], x[off: off + n]))
            ref = hf_reference(attn, rotary, hist[seq])[-n:]
            assert rel_err(out[off: off + n], ref) <= FP32_TOL
            off += n


def test_workspace_bound_holds(monkeypatch):
    """The expanded K/V of a prefix never exceeds max_workspace_tokens rows at once."""
    cfg, layer, attn, rotary = _setup(workspace=16)
    expanded = []
    keys_values = context._keys_values

    def recording(layer_, latent):
        expanded.append(latent.shape[0])
        return keys_values(layer_, latent)

    monkeypatch.setattr(context, "_keys_values", recording)
    g = torch.Generator().manual_seed(2)
    cache = mla.PagedLatentCache(cfg, num_blocks=64, block_size=8, dtype=torch.float32)
    x0 = torch.randn(150, cfg.hidden_size, generator=g)
    layer(x0, cache.prepare([("s", 150)]))                # prefill: no prefix expanded
    n = absorb_max_new(cfg) + 5                           # past the absorbed crossover
    x1 = torch.randn(n, cfg.hidden_size, generator=g)
    expanded.clear()
    batch = cache.prepare([("s", n)])
    out = layer(x1, batch)
    plan = next(v for k, v in batch._memo.items() if k[0] == "plan")
    assert plan.strategy == ["chunked"]
    # the new tokens' own expansion (n rows, the caller's chunk) plus prefix chunks of <= 16
    assert expanded[0] == n and max(expanded[1:]) <= 16 and sum(expanded[1:]) == 150
    ref = hf_reference(attn, rotary, torch.cat((x0, x1)))[-n:]
    assert rel_err(out, ref) <= FP32_TOL


def test_chunk_passes_are_shared_by_sequences():
    cfg, layer, _, _ = _setup(workspace=16)
    layer.force_strategy = "chunked"
    cache = mla.PagedLatentCache(cfg, num_blocks=64, block_size=4, dtype=torch.float32)
    layer(torch.randn(10, cfg.hidden_size), cache.prepare([("a", 10)]))
    layer(torch.randn(5, cfg.hidden_size), cache.prepare([("b", 5)]))
    batch = cache.prepare([("a", 2), ("b", 2)])
    layer(torch.randn(4, cfg.hidden_size), batch)
    plan = next(v for k, v in batch._memo.items() if k[0] == "plan")
    # 10 + 5 prefix rows fit one pass of 16: both sequences share it
    assert len(plan.chunked.passes) == 1 and plan.chunked.passes[0].num_keys == 15


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_chunked_prefill_peak_memory_gpu():
    """On the GPU the peak allocation of a chunked step grows with the workspace, not the prefix."""
    cfg = mla.MLAConfig.preset("deepseek-v2-lite")
    peaks = {}
    for workspace in (512, 4096):
        layer = mla.MLA(cfg, dtype=torch.bfloat16, device="cuda", max_workspace_tokens=workspace)
        from mla.demo import random_state_dict
        layer.load_hf_state_dict(random_state_dict(cfg, torch.Generator().manual_seed(0)))
        cache = mla.PagedLatentCache(cfg, num_blocks=300, block_size=64, dtype=torch.bfloat16, device="cuda")
        layer(torch.randn(16384, cfg.hidden_size, dtype=torch.bfloat16, device="cuda"), cache.prepare([("s", 16384)]))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        layer(torch.randn(256, cfg.hidden_size, dtype=torch.bfloat16, device="cuda"), cache.prepare([("s", 256)]))
        peaks[workspace] = torch.cuda.max_memory_allocated() - base
    per_row = cfg.num_heads * (cfg.qk_head_dim + cfg.v_head_dim) * 2 * 3     # k, v and kv_b output, bf16
    assert peaks[512] < peaks[4096]
    assert peaks[4096] - peaks[512] <= (4096 - 512) * per_row * 1.5
