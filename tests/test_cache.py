"""PagedLatentCache bookkeeping under random operations, against a shadow model in plain Python.

The shadow keeps, per sequence, its length and a list of logical block ids with reference
counts: ``fork`` shares every block; the first write into a shared, partly filled last
block copies it (copy-on-write, one copy per writer that is not the last sharer);
``truncate`` keeps ceil(new_length / block_size) blocks; ``release`` drops them. After
every operation the cache must agree: lengths, and ``num_free_blocks`` = num_blocks
minus the distinct blocks in use. A step the shadow finds too big must raise
``mla.CacheFullError`` and change nothing. Data integrity (a forked branch keeps its
tokens when another branch writes) is checked through the layer's outputs against
transformers.
"""
from __future__ import annotations

import itertools
import random

import pytest
import torch

import hf_util as H
import mla
from hf_util import Harness


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Shadow:
    def __init__(self, num_blocks: int, block_size: int, max_len: int):
        self.num_blocks, self.bs, self.max_len = num_blocks, block_size, max_len
        self.lengths: dict = {}
        self.blocks: dict = {}
        self.refs: dict = {}
        self._ids = itertools.count()

    def copy(self) -> "Shadow":
        s = Shadow(self.num_blocks, self.bs, self.max_len)
        s.lengths = dict(self.lengths)
        s.blocks = {k: list(v) for k, v in self.blocks.items()}
        s.refs = dict(self.refs)
        s._ids = self._ids
        return s

    @property
    def used(self) -> int:
        return sum(1 for r in self.refs.values() if r > 0)

    @property
    def free(self) -> int:
        return self.num_blocks - self.used

    def _new(self) -> int:
        b = next(self._ids)
        self.refs[b] = 1
        return b

    def _unref(self, b):
        self.refs[b] -= 1
        if self.refs[b] == 0:
            del self.refs[b]

    def prepare(self, plan) -> bool:
        """Apply a step; False (and no change) if the pool cannot hold it."""
        trial = self.copy()
        for seq, n in plan:
            old = trial.lengths.get(seq, 0)
            blocks = trial.blocks.setdefault(seq, [])
            if n > 0 and old % self.bs and trial.refs[blocks[-1]] > 1:
                trial._unref(blocks[-1])
                blocks[-1] = trial._new()
            while len(blocks) < _cdiv(old + n, self.bs):
                blocks.append(trial._new())
            trial.lengths[seq] = old + n
        if trial.used > self.num_blocks:
            return False
        self.__dict__.update(trial.__dict__)
        return True

    def fork(self, src, dst):
        self.blocks[dst] = list(self.blocks[src])
        for b in self.blocks[dst]:
            self.refs[b] += 1
        self.lengths[dst] = self.lengths[src]

    def truncate(self, seq, new_length):
        keep = _cdiv(new_length, self.bs)
        for b in self.blocks[seq][keep:]:
            self._unref(b)
        del self.blocks[seq][keep:]
        self.lengths[seq] = new_length

    def release(self, seq):
        for b in self.blocks.pop(seq):
            self._unref(b)
        del self.lengths[seq]


def _assert_same(cache, shadow, where):
    assert cache.num_free_blocks == shadow.free, f"{where}: num_free_blocks {cache.num_free_blocks} != {shadow.free}"
    for seq, n in shadow.lengths.items():
        assert cache.length(seq) == n, f"{where}: length({seq}) {cache.length(seq)} != {n}"


def _random_plan(rng, shadow, next_seq, max_len):
    live = list(shadow.lengths)
    k = rng.randint(0, min(3, len(live)))
    plan = []
    for seq in rng.sample(live, k):
        room = max_len - shadow.lengths[seq]
        if room > 0:
            plan.append((seq, rng.choice([1, 1, 1, 2, 3, rng.randint(1, 12)]) if room > 12 else rng.randint(1, room)))
    if not plan or rng.random() < 0.35:
        plan.insert(rng.randint(0, len(plan)), (next_seq, rng.randint(1, 20)))
    return plan


@pytest.mark.parametrize("block_size,num_blocks", [(4, 24), (1, 60), (5, 14), (16, 6)])
def test_random_operations_bookkeeping(block_size, num_blocks):
    """A few hundred random prepare/fork/truncate/release calls; no leak, no wrong sharing."""
    cfg = mla.MLAConfig.from_hf(H.make_config("v3"))
    max_len = cfg.max_position_embeddings
    cache = mla.PagedLatentCache(cfg, num_layers=2, num_blocks=num_blocks, block_size=block_size,
                                 dtype=torch.float32, device="cpu")
    shadow = Shadow(num_blocks, block_size, max_len)
    rng = random.Random(1234 + block_size)
    next_seq = 0
    counts = dict.fromkeys(("prepare", "full", "fork", "truncate", "release"), 0)
    _assert_same(cache, shadow, "start")
    assert cache.num_free_blocks == num_blocks
    for i in range(400):
        live = list(shadow.lengths)
        r = rng.random()
        if r < 0.45 or not live:
            plan = _random_plan(rng, shadow, next_seq, max_len)
            if shadow.prepare(plan):
                cache.prepare(plan)
                counts["prepare"] += 1
            else:
                with pytest.raises(mla.CacheFullError):
                    cache.prepare(plan)
                counts["full"] += 1
            if any(s == next_seq for s, _ in plan) and next_seq in shadow.lengths:
                next_seq += 1
            where = f"op {i} prepare {plan}"
        elif r < 0.62:
            src = rng.choice(live)
            shadow.fork(src, next_seq)
            cache.fork(src, next_seq)
            where = f"op {i} fork {src}->{next_seq}"
            next_seq += 1
            counts["fork"] += 1
        elif r < 0.85:
            seq = rng.choice(live)
            n = shadow.lengths[seq]
            new_length = rng.choice([n, max(0, n - 1), max(0, n - 3), rng.randint(0, n)])
            shadow.truncate(seq, new_length)
            cache.truncate(seq, new_length)
            where = f"op {i} truncate {seq} to {new_length}"
            counts["truncate"] += 1
        else:
            seq = rng.choice(live)
            shadow.release(seq)
            cache.release(seq)
            where = f"op {i} release {seq}"
            counts["release"] += 1
        _assert_same(cache, shadow, where)
    assert all(v > 10 for k, v in counts.items() if k != "full"), counts
    for seq in list(shadow.lengths):
        shadow.release(seq)
        cache.release(seq)
        with pytest.raises(ValueError):
            cache.length(seq)
    assert cache.num_free_blocks == num_blocks


def test_blocks_counted_as_published():
    """Worked example: ceil(len / block_size) blocks per sequence, shared blocks once."""
    cfg = mla.MLAConfig.from_hf(H.make_config("v3"))
    cache = mla.PagedLatentCache(cfg, num_layers=1, num_blocks=20, block_size=4, dtype=torch.float32,
                                 device="cpu")
    cache.prepare([("a", 10), ("b", 4)])          # 3 + 1 blocks
    assert cache.num_free_blocks == 16
    cache.fork("a", "c")                          # shares all 3
    assert cache.num_free_blocks == 16 and cache.length("c") == 10
    cache.prepare([("c", 1)])                     # copy of the shared partial block
    assert cache.num_free_blocks == 15
    cache.prepare([("a", 2)])                     # a's partial block is its own now: no copy
    assert cache.num_free_blocks == 15 and cache.length("a") == 12
    cache.prepare([("a", 1)])                     # a new block
    assert cache.num_free_blocks == 14
    cache.fork("b", "d")                          # b ends on a block boundary
    cache.prepare([("d", 1)])                     # no copy: a fresh block
    assert cache.num_free_blocks == 13
    cache.truncate("a", 8)                        # 13 -> 8 tokens: 4 -> 2 blocks
    assert cache.num_free_blocks == 15
    cache.release("a")                            # 2 blocks shared with c stay
    assert cache.num_free_blocks == 15
    cache.release("c")
    assert cache.num_free_blocks == 18
    cache.release("b")
    assert cache.num_free_blocks == 18            # d still holds b's block
    cache.release("d")
    assert cache.num_free_blocks == 20


def test_shared_partial_block_written_by_all_sharers_fits_exactly():
    """k sequences share a partial block and all write in one step: k - 1 copies are needed
    (the last writer keeps the original), so a pool with exactly k - 1 free blocks suffices."""
    cfg = mla.MLAConfig.from_hf(H.make_config("v3"))
    cache = mla.PagedLatentCache(cfg, num_layers=1, num_blocks=4, block_size=4, dtype=torch.float32,
                                 device="cpu")
    cache.prepare([(0, 6)])                        # 2 blocks
    cache.fork(0, 1)
    cache.fork(0, 2)
    assert cache.num_free_blocks == 2
    cache.prepare([(0, 1), (1, 1), (2, 1)])        # 2 copies
    assert cache.num_free_blocks == 0
    assert [cache.length(s) for s in (0, 1, 2)] == [7, 7, 7]
    cache.release(1)
    cache.release(2)
    assert cache.num_free_blocks == 2
    cache.fork(0, 1)
    cache.prepare([(3, 4)])
    assert cache.num_free_blocks == 1
    cache.prepare([(1, 1), (0, 1)])                # 1 copy, 1 free block
    assert cache.num_free_blocks == 0
    assert [cache.length(s) for s in (0, 1, 3)] == [8, 8, 4]


@pytest.mark.parametrize("variant", ["v3", "v2_lite"])
def test_fork_keeps_data_when_source_writes(variant):
    """Branches of a fork keep their own tokens when the others write into shared blocks."""
    h = Harness(variant, torch.float32, seed=21, block_size=4, num_blocks=32)
    h.step([(0, 6)])
    h.fork(0, 1)
    h.fork(0, 2)
    h.step([(0, 2)])                   # source writes into the shared partial block
    h.step([(1, 1)])                   # branch 1 must still see its (the original) tokens
    h.step([(2, 3), (0, 1)])
    h.truncate(0, 5)                   # source truncated into the formerly shared block
    h.step([(0, 2), (1, 2), (2, 1)])
    h.fork(2, 3)
    h.release(2)                       # releasing the source of a fork keeps the fork's data
    h.step([(3, 1), (1, 1)])
    h.step([(3, 4)])


@pytest.mark.parametrize("block_size", [2, 5])
def test_random_operations_with_layer(block_size):
    """Random steps through the layer, checked against transformers at every step, with the
    shadow model predicting both the block counts and when the pool is full."""
    h = Harness("v3", torch.float32, seed=30 + block_size, block_size=block_size,
                num_blocks=60 // block_size + 4)
    max_len = 40                        # well under max_position_embeddings
    shadow = Shadow(h.cache.num_free_blocks, block_size, max_len)
    rng = random.Random(77 + block_size)
    next_seq, full = 0, 0
    for i in range(45):
        live = list(shadow.lengths)
        r = rng.random()
        if r < 0.55 or not live:
            plan = _random_plan(rng, shadow, next_seq, max_len)
            if shadow.prepare(plan):
                h.step(plan)
            else:
                before = {s: h.cache.length(s) for s in live}
                with pytest.raises(mla.CacheFullError):
                    h.cache.prepare(plan)
                assert {s: h.cache.length(s) for s in live} == before
                full += 1
            if next_seq in shadow.lengths:
                next_seq += 1
        elif r < 0.7:
            src = rng.choice(live)
            shadow.fork(src, next_seq)
            h.fork(src, next_seq)
            next_seq += 1
        elif r < 0.9:
            seq = rng.choice(live)
            n = rng.randint(0, shadow.lengths[seq])
            shadow.truncate(seq, n)
            h.truncate(seq, n)
        else:
            seq = rng.choice(live)
            shadow.release(seq)
            h.release(seq)
        _assert_same(h.cache, shadow, f"op {i}")
    for seq in list(shadow.lengths):
        h.release(seq)
    assert h.cache.num_free_blocks == shadow.num_blocks
