"""PagedLatentCache under a seeded random sequence of operations, with data: prepare (new and
old sequences, several a step), fork (of forks), truncate (mid-block too), release, and refused
steps (a full pool, a sequence twice, fork onto an existing sequence, truncate past the end),
against a shadow model in plain Python (per sequence its list of token ids; per block a
reference count; the free block count).

Every prepared step writes one distinct latent row per new token through the real write path
(``mla.ops.rope_append`` at the batch's slot_mapping; cos 1 and sin 0, so RoPE is exact), on
every layer. After every operation: lengths and ``num_free_blocks`` agree with the shadow, and
every live sequence's rows, read through its block table (``mla.ops.gather_latent``), are
bit-identical to the rows of its tokens: copy-on-write kept every sharer's tokens. A refused
call changes nothing. Short in CI; ``--fuzz-steps N`` (tests/conftest.py) runs longer.
"""
from __future__ import annotations

import random

import pytest
import torch

import mla
from mla import ops

R, DR = 16, 4   # small rows: kv_lora_rank 16, qk_rope_head_dim 4


def _cfg():
    return mla.MLAConfig.preset("tiny").replace(kv_lora_rank=R, qk_rope_head_dim=DR, max_position_embeddings=512)


def _row(token: int, layer: int) -> torch.Tensor:
    """The latent row of a token on a layer: distinct, exact in float32."""
    return torch.arange(R + DR, dtype=torch.float32) + (1000.0 * token + 100.0 * layer)


class Shadow:
    """What the cache must hold: token ids per sequence, block references, free blocks."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.bs = num_blocks, block_size
        self.tokens: dict = {}         # seq -> [token id, ...]
        self.blocks: dict = {}         # seq -> [logical block, ...]
        self.refs: dict = {}           # logical block -> sharers
        self.next_block = 0

    @property
    def free(self) -> int:
        return self.num_blocks - len(self.refs)

    def _new(self) -> int:
        self.next_block += 1
        self.refs[self.next_block] = 1
        return self.next_block

    def _unref(self, b: int) -> None:
        self.refs[b] -= 1
        if not self.refs[b]:
            del self.refs[b]

    def fits(self, plan) -> bool:
        need, copied = 0, {}
        for seq, n in plan:
            old, blocks = len(self.tokens.get(seq, [])), self.blocks.get(seq, [])
            need += -(-(old + n) // self.bs) - len(blocks)
            if n and old % self.bs and self.refs[blocks[-1]] - copied.get(blocks[-1], 0) > 1:
                copied[blocks[-1]] = copied.get(blocks[-1], 0) + 1
                need += 1
        return need <= self.free

    def prepare(self, plan, new_tokens) -> None:
        for (seq, n), toks in zip(plan, new_tokens):
            old = self.tokens.setdefault(seq, [])
            blocks = self.blocks.setdefault(seq, [])
            if n and len(old) % self.bs and self.refs[blocks[-1]] > 1:
                self._unref(blocks[-1])
                blocks[-1] = self._new()
            while len(blocks) < -(-(len(old) + n) // self.bs):
                blocks.append(self._new())
            old.extend(toks)

    def fork(self, src, dst) -> None:
        self.tokens[dst], self.blocks[dst] = list(self.tokens[src]), list(self.blocks[src])
        for b in self.blocks[dst]:
            self.refs[b] += 1

    def truncate(self, seq, n: int) -> None:
        keep = -(-n // self.bs)
        for b in self.blocks[seq][keep:]:
            self._unref(b)
        del self.blocks[seq][keep:], self.tokens[seq][n:]

    def release(self, seq) -> None:
        for b in self.blocks.pop(seq):
            self._unref(b)
        del self.tokens[seq]


def _write(cache, batch, new_tokens, backend) -> None:
    """One row per new token on every layer, through rope_append at the batch's slots."""
    toks = [t for ts in new_tokens for t in ts]
    T = len(toks)
    if T == 0:
        return
    cos, sin = torch.ones(T, DR // 2), torch.zeros(T, DR // 2)
    for layer in range(cache.num_layers):
        rows = torch.stack([_row(t, layer) for t in toks])
        ops.rope_append(torch.zeros(T, 1, DR), rows[:, R:].clone(), rows[:, :R], cos, sin, cache.layer(layer),
                        batch.slot_mapping, True, backend=backend)


def _check(cache, shadow, backend, where: str) -> None:
    assert cache.num_free_blocks == shadow.free, f"{where}: num_free_blocks {cache.num_free_blocks} != {shadow.free}"
    assert sorted(map(str, cache.seq_ids)) == sorted(map(str, shadow.tokens)), where
    seqs = list(shadow.tokens)
    if not seqs:
        return
    width = max([len(cache.blocks(s)) for s in seqs] + [1])
    table = torch.tensor([cache.blocks(s) + [-1] * (width - len(cache.blocks(s))) for s in seqs], dtype=torch.int32)
    lens = [cache.length(s) for s in seqs]
    assert lens == [len(shadow.tokens[s]) for s in seqs], f"{where}: lengths"
    assert all(len(cache.blocks(s)) == len(shadow.blocks[s]) for s in seqs), f"{where}: blocks per sequence"
    cu = torch.tensor([0] + lens).cumsum(0).int()
    for layer in range(cache.num_layers):
        got = ops.gather_latent(cache.layer(layer), table, torch.zeros(len(seqs), dtype=torch.int32), cu, sum(lens),
                                backend=backend)
        toks = [t for s in seqs for t in shadow.tokens[s]]
        want = torch.stack([_row(t, layer) for t in toks]) if toks else got
        assert torch.equal(got, want), f"{where}: rows differ on layer {layer}"


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("block_size, num_blocks, seed", [(4, 16, 0), (1, 40, 1), (5, 10, 2), (16, 4, 3)])
def test_cache_fuzz(request, backend, block_size, num_blocks, seed):
    # the interpreter's launches are slow: a fifth of the steps there
    steps = request.config.getoption("--fuzz-steps") // (5 if backend == "triton" else 1)
    rng = random.Random(seed)
    cache = mla.PagedLatentCache(_cfg(), num_layers=2, num_blocks=num_blocks, block_size=block_size,
                                 dtype=torch.float32)
    shadow = Shadow(num_blocks, block_size)
    next_seq, next_token = 0, 0
    counts = dict.fromkeys(("prepare", "full", "fork", "truncate", "release", "refused"), 0)
    for i in range(steps):
        live = list(shadow.tokens)
        r = rng.random()
        before = (cache.num_free_blocks, {s: cache.length(s) for s in live}, cache.kv.clone())
        if r < 0.45 or not live:
            plan = [(s, rng.choice([0, 1, 1, 2, 3, rng.randint(1, 2 * block_size + 3)]))
                    for s in rng.sample(live, rng.randint(0, min(3, len(live))))]
            if not plan or rng.random() < 0.3:
                plan.insert(rng.randint(0, len(plan)), (next_seq, rng.randint(1, 3 * block_size)))
                next_seq += 1
            if shadow.fits(plan):
                new_tokens = [list(range(next_token, next_token + n)) for n in (n for _, n in plan)]
                next_token += sum(n for _, n in plan)
                batch = cache.prepare(plan)
                _write(cache, batch, new_tokens, backend)
                shadow.prepare(plan, new_tokens)
                counts["prepare"] += 1
            else:
                with pytest.raises(mla.CacheFullError):
                    cache.prepare(plan)
                counts["full"] += 1
            where = f"step {i}: prepare {plan}"
        elif r < 0.55:
            # refused calls: a sequence twice, fork onto a live one, truncate past the end
            seq = rng.choice(live)
            kind = rng.randrange(3)
            with pytest.raises(ValueError):
                if kind == 0:
                    cache.prepare([(seq, 1), (next_seq, 1), (seq, 2)])
                elif kind == 1:
                    cache.fork(rng.choice(live), seq)
                else:
                    cache.truncate(seq, len(shadow.tokens[seq]) + rng.randint(1, 3))
            after = (cache.num_free_blocks, {s: cache.length(s) for s in live})
            assert after == before[:2] and torch.equal(cache.kv, before[2]), f"step {i}: a refused call changed the cache"
            counts["refused"] += 1
            where = f"step {i}: refused call {kind} on {seq}"
        elif r < 0.7:
            src = rng.choice(live)
            cache.fork(src, next_seq)
            shadow.fork(src, next_seq)
            where = f"step {i}: fork {src} -> {next_seq}"
            next_seq += 1
            counts["fork"] += 1
        elif r < 0.88:
            seq = rng.choice(live)
            n = len(shadow.tokens[seq])
            new_length = rng.choice([n, max(0, n - 1), max(0, n - block_size - 1), rng.randint(0, n)])
            cache.truncate(seq, new_length)
            shadow.truncate(seq, new_length)
            where = f"step {i}: truncate {seq} to {new_length}"
            counts["truncate"] += 1
        else:
            seq = rng.choice(live)
            cache.release(seq)
            shadow.release(seq)
            where = f"step {i}: release {seq}"
            counts["release"] += 1
        # rows read by the reference every step (fast), by the backend's gather every 10th
        _check(cache, shadow, backend if i % 10 == 9 else "torch", where)
    assert all(v > 0 for k, v in counts.items() if k != "full") or steps < 100, counts
    for seq in list(shadow.tokens):
        cache.release(seq)
    assert cache.num_free_blocks == num_blocks
