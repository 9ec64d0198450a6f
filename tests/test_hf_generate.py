"""mla.hf.generate: the patched ``generate``'s decode loop, one step ahead of the GPU, returns
exactly what transformers' own loop returns.

Tiny random float32 models (tests/test_hf_patch.py's) on CPU, where the static decode step runs
eagerly, and the same on a GPU with its CUDA graphs. Each case compares the patched model's
``generate`` on left-padded batches with a reference: on CPU the unpatched model's; on a GPU
the same patch under transformers' own loop (``overlap=False``), the same arithmetic step for
step, since mla's float32 kernels and transformers' attention may part at near-ties there (the
patch against the unpatched model on a GPU is tests/test_hf_patch.py's test_graphs_on_gpu): greedy, seeded sampling (the
same random draws in the same order), EOS in one row and in every row (the stop read one step
late, its extra step undone), a streamer's tokens, logits processors that read the sequences;
and checks that the loop ran (or that transformers' own method did, where the loop leaves the
decoding to it) and that the latent cache holds what transformers' loop would have left.
"""
from __future__ import annotations

import pytest
import torch

import mla
import mla.hf
from test_hf_patch import make_model

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
NEW = 12


def batch(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 32, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :5] = 0
    return ids.to(device), mask.to(device)


class Spy:
    """Counts the runs of the one-step-ahead loop and of transformers' fallback under it."""

    def __init__(self, handle):
        self.loops = 0
        loop = handle._loop._loop

        def counting(*a, **kw):
            self.loops += 1
            return loop(*a, **kw)
        handle._loop._loop = counting


def setup(case, device):
    """float32 on either device: mla's attention and transformers' then pick the same tokens."""
    return make_model(case).to(device)


class Reference:
    """The reference of a device (module docstring) while the block runs: the model unpatched
    on CPU, patched with overlap=False on a GPU."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        on_gpu = next(self.model.parameters()).device.type == "cuda"
        self.handle = mla.hf.patch(self.model, num_blocks=48, block_size=4, overlap=False) if on_gpu else None
        return self

    def __exit__(self, *exc):
        if self.handle is not None:
            self.handle.unpatch()


def run_both(model, handle_kw, calls):
    """Each call's output from the reference, then patched (seeded alike): the two lists and the spy."""
    want = []
    with Reference(model):
        for seed, kw in calls:
            torch.manual_seed(seed)
            want.append(model.generate(**kw))
    handle = mla.hf.patch(model, num_blocks=48, block_size=4, **handle_kw)
    spy = Spy(handle)
    got = []
    for seed, kw in calls:
        torch.manual_seed(seed)
        got.append(model.generate(**kw))
    return want, got, handle, spy


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["deepseek_v3", "deepseek_v2", "deepseek_v32"])
def test_greedy_and_seeded_sampling_match_transformers(case, device):
    model = setup(case, device)
    ids, mask = batch(device)
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW)
    calls = [(0, dict(common, do_sample=False)),
             (5, dict(common, do_sample=True, top_k=5, temperature=0.7)),
             (6, dict(common, do_sample=True, top_p=0.9, repetition_penalty=1.3, min_new_tokens=4))]
    want, got, handle, spy = run_both(model, dict(graphs=True) if case == "deepseek_v32" else {}, calls)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    assert spy.loops == len(calls)
    # the cache holds what transformers' loop writes: every token but the last of each row
    attended = mask.sum(1) + NEW - 1
    assert handle.cache.lengths(handle._seq_ids) == attended.tolist()
    assert handle._columns == ids.shape[1] + NEW - 1


def eos_of(model, ids, mask, row: int, at: int) -> int:
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    return int(out[row, ids.shape[1] + at])


@pytest.mark.parametrize("device", DEVICES)
def test_eos_in_one_row_and_in_every_row(device):
    """One row's EOS: it decodes pad tokens on, as in transformers. Every row's: the loop learns
    it one step late and undoes the step it ran meanwhile (its token and both rows)."""
    model = setup("deepseek_v3", device)
    ids, mask = batch(device)
    first = eos_of(model, ids, mask, row=1, at=4)
    calls = [(0, dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=first,
                      pad_token_id=0)),
             # every row stops at once: the first generated token of row 0 ends it, the others
             # end on the same id or run to the end
             (0, dict(input_ids=ids[:1], attention_mask=mask[:1], max_new_tokens=NEW, do_sample=False,
                      eos_token_id=eos_of(model, ids[:1], mask[:1], row=0, at=2), pad_token_id=0))]
    want, got, handle, spy = run_both(model, {}, calls)
    assert spy.loops == 2
    for w, g in zip(want, got):
        assert torch.equal(w, g), (w, g)
    short = want[1].shape[1] - ids.shape[1]
    assert short < NEW          # the early stop was exercised
    assert handle.cache.lengths(handle._seq_ids) == [int(mask[0].sum()) + short - 1]
    assert handle._columns == ids.shape[1] + short - 1


class Collect:
    """A streamer: the tokens of every put, as lists."""

    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ended = True


@pytest.mark.parametrize("device", DEVICES)
def test_streamer_gets_the_same_tokens(device):
    model = setup("deepseek_v3", device)
    ids, mask = batch(device)
    eos = eos_of(model, ids[:1], mask[:1], row=0, at=3)
    for kw in (dict(max_new_tokens=NEW), dict(max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0)):
        streams = []
        for patched in (False, True):
            with Reference(model) if not patched else mla.hf.patch(model, num_blocks=48, block_size=4):
                s = Collect()
                out = model.generate(input_ids=ids[:1], attention_mask=mask[:1], do_sample=False, streamer=s, **kw)
                streams.append((s.puts, s.ended, out.tolist()))
        assert streams[0] == streams[1]


@pytest.mark.parametrize("device", DEVICES)
def test_decoding_left_to_transformers(device):
    """Beam search, a returned dict, a user's cache: transformers' own methods run them on the
    patch (the loop steps aside) and give the unpatched tokens."""
    model = setup("deepseek_v3", device)
    ids, mask = batch(device)
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    calls = [(0, dict(common, num_beams=2)),
             (0, dict(common, return_dict_in_generate=True))]
    want, got, handle, spy = run_both(model, {}, calls)
    assert torch.equal(want[0], got[0])
    assert torch.equal(want[1].sequences, got[1].sequences)
    assert spy.loops == 0


def test_unpatch_gives_generate_back():
    model = make_model("deepseek_v3")
    own = type(model).generate
    handle = mla.hf.patch(model, num_blocks=16, block_size=4)
    assert "generate" in vars(model)
    handle.unpatch()
    assert "generate" not in vars(model) and model.generate.__func__ is own


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("sample", [False, True])
def test_no_host_sync_between_steps(sample):
    """On a GPU, from the prefill's end to the loop's end, nothing the loop runs (the graph
    replays, the processors, the sampler, the stopping criteria, the stop flag's copy) makes
    the host wait for the device: CUDA's sync debug mode is an error there. The host waits only
    on the events of finished steps."""
    model = setup("deepseek_v3", "cuda")
    ids, mask = batch("cuda")
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=sample, top_k=5,
              eos_token_id=eos_of(model, ids, mask, row=1, at=4), pad_token_id=0)
    with Reference(model):
        torch.manual_seed(1)
        want = model.generate(**kw)
    handle = mla.hf.patch(model, num_blocks=48, block_size=4)
    assert handle.graphs
    torch.manual_seed(1)
    assert torch.equal(model.generate(**kw), want)      # captures the graphs
    prefill, loop, ran = model._prefill, handle._loop._loop, []

    def strict_after_prefill(*a, **k):
        out = prefill(*a, **k)
        torch.cuda.set_sync_debug_mode("error")
        return out

    def checked(*a, **k):
        try:
            out = loop(*a, **k)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        ran.append(True)
        return out
    model._prefill, handle._loop._loop = strict_after_prefill, checked
    try:
        torch.manual_seed(1)
        assert torch.equal(model.generate(**kw), want)
    finally:
        del model._prefill
    assert ran == [True]
