"""LongRoPE (MiniCPM3-4B's RoPE): ``from_hf`` reads it, the cos/sin tables are transformers'
MiniCPM3RotaryEmbedding's, and the layer step by step is MiniCPM3Attention run with its KV cache
(transformers' generation), through the switch from the short to the long factors.

transformers picks the factors per forward call: the long ones once the call's largest position
+ 1 exceeds original_max_position_embeddings; cached keys keep the rotation they were written
with. The oracle is therefore the module fed one step at a time with a DynamicCache, not a
recompute of the whole sequence (which would rotate every key with the long factors).
"""
from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

import mla
import hf_families as F
from hf_util import FP32_TOL, rel_err

ORIG = 16                   # original_max_position_embeddings of the tiny config
SHORT = [1.0, 1.3, 2.1, 3.7]            # dr / 2 = 4 factors each
LONG = [1.1, 2.5, 6.0, 11.0]


def longrope(**more) -> dict:
    return {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": list(SHORT), "long_factor": list(LONG),
            "original_max_position_embeddings": ORIG, **more}


CASE = F.Case("minicpm3", "minicpm3", "MiniCPM3Config", "MiniCPM3Attention", "MiniCPM3RotaryEmbedding",
              dict(rope_parameters=longrope(factor=4.0), intermediate_size=32))


def test_from_hf_reads_longrope():
    cfg = mla.MLAConfig.from_hf(CASE.make_config())
    assert cfg.rope_type == "longrope" and cfg.rope_scaling is None and not cfg.rope_interleave
    s = cfg.longrope
    assert s.short_factor == tuple(SHORT) and s.long_factor == tuple(LONG)
    assert s.original_max_position_embeddings == ORIG
    assert s.attention_factor == pytest.approx(math.sqrt(1 + math.log(4.0) / math.log(ORIG)))
    assert cfg.softmax_scale == pytest.approx((16 + 8) ** -0.5)
    # no factor: max_position_embeddings / original (64 / 16); an explicit attention_factor wins
    assert mla.MLAConfig.from_hf(CASE.make_config(rope_parameters=longrope())).longrope.attention_factor == \
        pytest.approx(s.attention_factor)
    assert mla.MLAConfig.from_hf(CASE.make_config(rope_parameters=longrope(attention_factor=0.75))
                                 ).longrope.attention_factor == 0.75
    # the legacy config.json layout: rope_scaling with "type"
    legacy = F.config_source(CASE.make_config(), "legacy")
    assert mla.MLAConfig.from_hf(legacy).longrope == s


def test_longrope_refusals():
    with pytest.raises(ValueError, match="longrope.short_factor"):
        mla.MLAConfig.from_hf(CASE.make_config(rope_parameters=longrope(short_factor=[1.0, 2.0],
                                                                         long_factor=[1.0, 2.0])))
    with pytest.raises(ValueError, match="long_factor"):
        mla.LongRope(short_factor=(1.0, 2.0), long_factor=(1.0,), original_max_position_embeddings=8)
    with pytest.raises(ValueError, match="rope_type"):
        mla.MLAConfig.preset("tiny").replace(rope_type="longrope")
    # YaRN's mscale on top of LongRoPE is not implemented, and LongRoPE only where the module takes it
    d = F.config_source(CASE.make_config(), "dict")
    d["rope_parameters"] = dict(d["rope_parameters"], mscale_all_dim=1.0)
    with pytest.raises(NotImplementedError, match="mscale_all_dim"):
        mla.MLAConfig.from_hf(d)
    v3 = F.config_source(F.EXACT["deepseek_v3"].make_config(), "dict")
    v3["rope_parameters"] = longrope(factor=4.0)
    with pytest.raises(NotImplementedError, match="longrope"):
        mla.MLAConfig.from_hf(v3)


@pytest.mark.parametrize("rope", [longrope(factor=4.0), longrope(), longrope(attention_factor=0.75)])
@pytest.mark.parametrize("positions", [[0, 3, 15], [0, 3, 16], [20, 40, 63], [5]])
def test_cos_sin_match_transformers(rope, positions):
    """The step's largest position decides for all its rows: [0, 3, 15] keeps the short factors,
    [0, 3, 16] (17 positions > 16) takes the long ones everywhere."""
    hf_cfg = CASE.make_config(rope_parameters=rope)
    cfg = mla.MLAConfig.from_hf(hf_cfg)
    pos = torch.tensor(positions)
    cos, sin = mla.rope.cos_sin(cfg, pos)
    rotary = F._cls("minicpm3", "MiniCPM3RotaryEmbedding")(hf_cfg)
    hf_cos, hf_sin = rotary(torch.zeros(1, 1, dtype=torch.float32), pos[None])
    # transformers repeats the dr / 2 angles (neox halves)
    assert torch.equal(cos, hf_cos[0, :, :4]) and torch.equal(sin, hf_sin[0, :, :4])
    assert torch.equal(hf_cos[0, :, 4:], hf_cos[0, :, :4])


@pytest.mark.parametrize("strategy,workspace", [(None, 65536), ("cached", 65536), ("cached", 8),
                                                ("absorbed", 65536)])
@torch.no_grad()
def test_layer_matches_the_module_step_by_step(strategy, workspace):
    """Prompt and decodes within the original length (short factors), a chunk that crosses it and
    decodes past it (long factors for the new rows, cached keys as written), against
    MiniCPM3Attention in float64 fed the same steps with a DynamicCache; over a cached prefix by
    the rule, expanded (chunked past a workspace of 8) and absorbed."""
    hf_cfg = CASE.make_config()
    cfg = mla.MLAConfig.from_hf(hf_cfg)
    attn, rotary = F.make_attention(CASE, hf_cfg, seed=3)
    ref = attn.double()
    layer = mla.MLA(cfg, dtype=torch.float32, backend="torch", strategy=strategy, max_workspace_tokens=workspace)
    layer.load_hf_state_dict(F.state_dict(attn, CASE.prefix), prefix=CASE.prefix)
    cache = mla.PagedLatentCache(cfg, num_blocks=16, block_size=4, dtype=torch.float32)
    kv = DynamicCache()
    g = torch.Generator().manual_seed(7)
    done = 0
    for n in (10, 1, 1, 6, 1, 3):       # positions 0..9, 10, 11, 12..17 (crosses 16), 18, 19..21
        x = torch.randn(n, cfg.hidden_size, generator=g)
        ours = layer(x, cache.prepare([("s", n)]))
        pos = torch.arange(done, done + n)[None]
        mask = torch.zeros(n, done + n, dtype=torch.float64)
        mask[:, done:] = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)
        theirs = ref(x.double()[None], position_embeddings=rotary(x.double()[None], pos),
                     attention_mask=mask[None, None], past_key_values=kv)[0][0]
        assert rel_err(ours, theirs) <= FP32_TOL, (done, n, rel_err(ours, theirs))
        done += n


def test_one_step_takes_its_largest_position():
    """Two sequences in one step: the longer one's position past the original length switches
    both to the long factors (transformers' rule for one forward call)."""
    cfg = mla.MLAConfig.from_hf(CASE.make_config())
    freqs = mla.rope.inv_freq(cfg)
    assert freqs.shape == (2, 4)
    both = mla.rope.longrope_freqs(cfg, torch.tensor([2, 3, 16]), freqs)
    assert torch.equal(both, freqs[1])
    assert torch.equal(mla.rope.longrope_freqs(cfg, torch.tensor([2, 3, 15]), freqs), freqs[0])
