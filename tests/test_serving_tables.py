"""PagedLatentCache.batch_from_tables: the layer on block tables and slot mappings an engine
computed. Checked against the float64 oracle of the whole sequence (mla.testing.dense_forward),
with the engine's blocks shuffled and every other page NaN, over a prefill, a chunk over a
cached prefix and decodes; and every refusal before anything is written.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import mla
from mla.testing import dense_forward, random_state_dict

BS = 4


def layer_and_cache(num_blocks=32):
    cfg = mla.MLAConfig.preset("tiny")
    layer = mla.MLA(cfg, dtype=torch.float32)
    layer.load_hf_state_dict(random_state_dict(cfg, torch.Generator().manual_seed(0)))
    cache = mla.PagedLatentCache(cfg, num_blocks=num_blocks, block_size=BS, dtype=torch.float32)
    cache.kv.fill_(float("nan"))
    return cfg, layer, cache


@pytest.mark.parametrize("width", [None, 11])
def test_engine_tables_match_the_oracle(width):
    """Two sequences on shuffled engine blocks: 9 and 6 prompt tokens, then 5 more of the first
    over its cached prefix beside a decode of the second, then two decodes of both; the tables
    as wide as each step needs, or every step's 11 blocks wide (an engine's fixed width)."""
    cfg, layer, cache = layer_and_cache()
    g = torch.Generator().manual_seed(1)
    total = {"a": 17, "b": 9}
    x = {s: torch.randn(n, cfg.hidden_size, generator=g) for s, n in total.items()}
    perm = torch.randperm(32, generator=g).tolist()
    tables = {"a": perm[:5], "b": perm[5:8]}
    out = {s: [] for s in total}
    steps = [[("a", 0, 9), ("b", 0, 6)], [("a", 9, 5), ("b", 6, 1)], [("a", 14, 1), ("b", 7, 1)],
             [("a", 15, 2), ("b", 8, 1)]]
    for step in steps:
        batch = cache.batch_from_tables(step, [tables[s] for s, _, _ in step], width=width)
        if width is not None:
            assert batch.block_table.shape == (len(step), width) and batch.block_table[:, 5:].eq(0).all()
        y = layer(torch.cat([x[s][c:c + n] for s, c, n in step]), batch)
        for (s, _, n), part in zip(step, y.split([n for _, _, n in step])):
            out[s].append(part)
    for s in total:
        want = dense_forward(layer, x[s]).float()
        got = torch.cat(out[s])
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert cache.num_free_blocks == 32 and cache.seq_ids == []   # the engine owns the blocks


def test_slot_mapping_given_is_checked_on_cpu():
    cfg, layer, cache = layer_and_cache()
    slots = torch.tensor([12, 13, 14], dtype=torch.int64)
    batch = cache.batch_from_tables([("a", 0, 3)], [[3]], slots)
    assert batch.slot_mapping is slots and batch.block_table.tolist() == [[3]]
    with pytest.raises(ValueError, match="slot_mapping: expected each new token's slot"):
        cache.batch_from_tables([("a", 0, 3)], [[3]], torch.tensor([12, 13, 15]))
    with pytest.raises(ValueError, match=r"slot_mapping: expected \[3\] int64"):
        cache.batch_from_tables([("a", 0, 3)], [[3]], slots.int())


@pytest.mark.parametrize("requests, tables, match", [
    ([("a", 0, 5)], [[1]], "needs 2 blocks"),
    ([("a", 0, 3)], [[32]], "block ids in 0..31"),
    ([("a", 0, 3)], [[-1]], "block ids in 0..31"),
    ([("a", 0, 3)], [[1.0]], "block ids in 0..31"),
    ([("a", 0, 3)], [["1"]], "block ids in 0..31"),
    ([("a", -1, 3)], [[1]], "num_cached an int >= 0"),
    ([("a", 0, 3), ("a", 3, 1)], [[1], [1]], "appears twice"),
    ([("a", 60, 10)], [list(range(18))], "max_position_embeddings"),
    ([("a", 0, 3)], [[1], [2]], "one table for each"),
    ([("a", 0)], [[1]], "triples"),
    ([("a", 0, 5)], [[1, 2]], "width: expected an int >= 2"),
])
def test_refusals(requests, tables, match):
    cfg, layer, cache = layer_and_cache()
    if "max_position" in match:
        cache = mla.PagedLatentCache(dataclasses.replace(cfg, max_position_embeddings=64), num_blocks=32,
                                     block_size=BS, dtype=torch.float32)
    kw = dict(width=1) if "width" in match else {}
    with pytest.raises(ValueError, match=match):
        cache.batch_from_tables(requests, tables, **kw)
    for w in (2.0, True, "2"):
        with pytest.raises(ValueError, match="width: expected an int"):
            cache.batch_from_tables([("a", 0, 5)], [[1, 2]], width=w)


def test_one_owner_a_cache():
    cfg, layer, cache = layer_and_cache()
    cache.prepare([("mine", 3)])
    with pytest.raises(ValueError, match="sequences of its own"):
        cache.batch_from_tables([("a", 0, 3)], [[1]])
    cfg, layer, cache = layer_and_cache()
    cache.batch_from_tables([("a", 0, 3)], [[1]])
    with pytest.raises(ValueError, match="owned by an engine"):
        cache.prepare([("mine", 3)])
