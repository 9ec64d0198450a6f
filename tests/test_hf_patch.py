"""mla.hf.patch: a transformers MLA model runs its attention through mla and generates the
same greedy tokens as the unpatched model's own eager ``generate``.

For every exact family (tests/hf_families.py's config table) a tiny random ``...ForCausalLM``
(hidden 64, 2-4 layers, 3-4 heads, vocabulary 32, a tiny MoE where the family has one) in
float32 with unit-scale weights, so that greedy tokens vary. Each test compares the patched
model with the same model unpatched: tokens for ``generate``, logits (float32, relative error
<= LOGIT_TOL) for direct forwards of a left-padded batch.
"""
from __future__ import annotations

import importlib
import math
import subprocess
import sys

import pytest
import torch

import hf_families as F
import mla
from mla.testing import randomize_model

# The sparse families: prompts of 5-9 tokens + 8 new, past their top-k (8; GLM-5.3-Flash's 11 keys:
# two pools of 4 and the open pool)
CASES = list(F.EXACT) + ["deepseek_v32", "axk2", "glm_moe_dsa", "hy_v4", "glm5_next_text"]
CAUSAL_LM = dict(deepseek_v2="DeepseekV2ForCausalLM", deepseek_v3="DeepseekV3ForCausalLM", axk1="AXK1ForCausalLM",
                 youtu="YoutuForCausalLM", glm4_moe_lite="Glm4MoeLiteForCausalLM", mistral4="Mistral4ForCausalLM",
                 longcat_flash="LongcatFlashForCausalLM", minicpm3="MiniCPM3ForCausalLM",
                 kimi_linear="KimiLinearForCausalLM", deepseek_v32="DeepseekV32ForCausalLM",
                 axk2="AXK2ForCausalLM", glm_moe_dsa="GlmMoeDsaForCausalLM", hy_v4="HYV4ForCausalLM",
                 glm5_next_text="Glm5NextForConditionalGeneration")
# The model around the attention kept tiny: small MLPs, an MoE layer in DeepSeek-V3 (layer 1),
# MiniCPM3's embedding and logit scales at 1 so that random weights give varied tokens.
MODEL_OVERRIDES = dict(intermediate_size=32, moe_intermediate_size=16, first_k_dense_replace=1, scale_emb=1,
                       dim_model_base=64, hc_mult=2)
# GLM-5.3-Flash's only causal LM is its multimodal model: a one-block vision tower beside the text
TINY_VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=64,
                   projection_intermediate_size=16)
# Attention modules each model has: LongCat two per decoder layer, Kimi Linear its full-attention
# layers, GLM-5.3-Flash its MLA layers (1 and 2; 0 is linear attention, 2 reuses 1's top-k).
NUM_MLA = dict(longcat_flash=2, kimi_linear=2, glm5_next_text=2)
BLOCK_SIZE, NUM_BLOCKS = 4, 64
NEW_TOKENS = 8
# Weight seeds whose greedy tokens vary in every row (seed 0 repeats one token in a row of these).
GENERATE_SEEDS = dict(mistral4_neox=1)
LOGIT_TOL = 1e-4     # float32 logits after 2-4 layers; mla's attention differs from eager by ~1e-6


def family_case(case: str):
    return F.find_case(case)


def make_model(case: str, seed: int = 0, **more):
    """The family's tiny ForCausalLM in float32: matrices std 2 / sqrt(fan_in), norms in [0.5, 1.5);
    ``more``: config fields beside the case's."""
    c = family_case(case)
    cfg = c.make_config(**more)
    for k, v in MODEL_OVERRIDES.items():
        if hasattr(cfg, k) and k not in c.overrides:
            setattr(cfg, k, v)
    if c.family == "glm5_next_text":
        cfg = F._cls("glm5_next", "Glm5NextConfig")(text_config=cfg.to_dict(), vision_config=TINY_VISION)
        cfg._attn_implementation = "eager"
    module = importlib.import_module(f"transformers.models.{c.module}.modeling_{c.module}")
    model = getattr(module, CAUSAL_LM[c.family])(cfg).float().eval()
    return randomize_model(model, torch.Generator().manual_seed(seed), gain=2.0)


def prompts(batch: int, seed: int):
    """(input_ids, attention_mask): batch 1 of 7 tokens, or 2 rows of 9 and 5 tokens left-padded."""
    g = torch.Generator().manual_seed(seed)
    lengths = [7] if batch == 1 else [9, 5]
    width = max(lengths)
    ids = torch.randint(0, 32, (batch, width), generator=g)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, width - n:] = 1
        ids[b, : width - n] = 0
    return ids, mask


def greedy(model, ids, mask, **kw):
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, **kw)


def blocks_held(mask, new_tokens: int = NEW_TOKENS) -> int:
    """Blocks a finished request holds: each row's real prompt tokens and all but the last new one."""
    return sum(math.ceil((int(n) + new_tokens - 1) / BLOCK_SIZE) for n in mask.sum(1))


def stand_ins(model):
    return [m for m in model.modules() if type(m).__name__ == "_MLAAttention"]


@pytest.mark.parametrize("case", CASES)
def test_generate_matches_eager(case):
    """Batch 1, then a left-padded batch of 2 (a new request), then batch 1 again: the same
    tokens as the unpatched model; each request releases the previous one's blocks; unpatch
    restores the original modules."""
    model = make_model(case, seed=GENERATE_SEEDS.get(case, 0))
    originals = [m for m in model.modules() if F.attention_class(family_case(case)) is type(m)]
    (ids1, mask1), (ids2, mask2) = prompts(1, seed=1), prompts(2, seed=2)
    ref1, ref2 = greedy(model, ids1, mask1), greedy(model, ids2, mask2)
    rows = ref1[:, ids1.shape[1]:].tolist() + ref2[:, ids2.shape[1]:].tolist()
    assert all(len(set(r)) >= 2 for r in rows) and len({t for r in rows for t in r}) >= 6, \
        f"{case}: greedy tokens {rows} barely vary: the test would be weak"

    handle = mla.hf.patch(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    assert len(stand_ins(model)) == len(originals) == NUM_MLA.get(case, family_case(case).make_config().num_hidden_layers)
    total = handle.cache.num_free_blocks
    assert total == NUM_BLOCKS
    out1 = greedy(model, ids1, mask1)
    assert out1.tolist() == ref1.tolist(), f"{case}, batch 1"
    assert handle.cache.num_free_blocks == total - blocks_held(mask1)
    out2 = greedy(model, ids2, mask2)
    assert out2.tolist() == ref2.tolist(), f"{case}, left-padded batch 2"
    assert handle.cache.num_free_blocks == total - blocks_held(mask2)    # batch 1's blocks came back
    assert greedy(model, ids1, mask1).tolist() == ref1.tolist(), f"{case}, batch 1 after batch 2"
    handle.release()
    assert handle.cache.num_free_blocks == total

    handle.unpatch()
    assert not stand_ins(model)
    assert [m for m in model.modules() if F.attention_class(family_case(case)) is type(m)] == originals
    assert greedy(model, ids2, mask2).tolist() == ref2.tolist()


@pytest.mark.parametrize("case", CASES)
def test_forward_left_padded_logits(case):
    """Direct forwards as generate makes them: a left-padded prefill with position_ids from the
    mask, then two decode steps on the returned cache. Logits of the real tokens match."""
    model = make_model(case, seed=3)
    ids, mask = prompts(2, seed=4)
    steps = [torch.tensor([[5], [17]]), torch.tensor([[29], [3]])]

    def run():
        outs, m, cache, x = [], mask, None, ids
        for step in range(len(steps) + 1):
            pos = (m.cumsum(1) - 1).clamp(min=0)[:, -x.shape[1]:]
            o = model(input_ids=x, attention_mask=m, position_ids=pos, past_key_values=cache, use_cache=True)
            outs.append(o.logits)
            cache = o.past_key_values
            if step < len(steps):
                x, m = steps[step], torch.cat([m, torch.ones(2, 1, dtype=m.dtype)], 1)
        return outs, cache

    ref, _ = run()
    handle = mla.hf.patch(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    ours, hf_cache = run()
    real = mask.bool()
    pairs = [(ours[0][real], ref[0][real])] + [(o, r) for o, r in zip(ours[1:], ref[1:])]
    for i, (o, r) in enumerate(pairs):
        err = ((o - r).norm() / r.norm()).item()
        assert err <= LOGIT_TOL, f"{case}: step {i}: logits relative error {err:.3g}"
    # transformers' cache holds one uint8 per token of each MLA layer, never the K/V.
    for layer in (hf_cache.layers[m.layer_idx] for m in stand_ins(model)):
        assert layer.keys.dtype == torch.uint8 and layer.keys.shape[-1] == 1
    assert [handle.cache.length(s) for s in handle._seq_ids] == [int(n) + len(steps) for n in mask.sum(1)]
    handle.unpatch()


@pytest.mark.parametrize("mode", ["beam_search", "no_cache", "eos_return_dict", "continue_cache"])
def test_generate_modes(mode):
    """Beam search (reorder forks sequences), use_cache=False (every step a new request), an
    eos that stops a row with the cache returned, and a generate that continues a returned cache."""
    model = make_model("deepseek_v3", seed=5)
    ids, mask = prompts(2, seed=6)
    kw = {"beam_search": dict(num_beams=3), "no_cache": dict(use_cache=False),
          "eos_return_dict": dict(eos_token_id=10, pad_token_id=0, return_dict_in_generate=True),
          "continue_cache": {}}[mode]
    ref = greedy(model, ids, mask, **kw)
    with mla.hf.patch(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE) as handle:
        if mode == "continue_cache":
            half = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS // 2, do_sample=False,
                                  return_dict_in_generate=True)
            mask2 = torch.cat([mask, torch.ones(2, NEW_TOKENS // 2, dtype=mask.dtype)], 1)
            out = model.generate(half.sequences, attention_mask=mask2, past_key_values=half.past_key_values,
                                 max_new_tokens=NEW_TOKENS // 2, do_sample=False)
        else:
            out = greedy(model, ids, mask, **kw)
        if mode == "eos_return_dict":
            out, ref = out.sequences, ref.sequences
        assert out.tolist() == ref.tolist()
        handle.release()
        assert handle.cache.num_free_blocks == NUM_BLOCKS
    assert not stand_ins(model)


def test_refuses_what_it_cannot_serve():
    model = make_model("deepseek_v3")
    ids, mask = prompts(2, seed=7)
    with mla.hf.patch(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE):
        with pytest.raises(ValueError, match="dynamic transformers Cache"):
            greedy(model, ids, mask, cache_implementation="static")
        with pytest.raises(ValueError, match="attention_mask"):
            model(input_ids=ids, attention_mask=torch.ones(2, 1, 9, 9))
        with pytest.raises(ValueError, match="position_ids"):           # positions counted over the pads
            model(input_ids=ids, attention_mask=mask, position_ids=torch.arange(9).expand(2, 9))
        with pytest.raises(ValueError, match="runs only inside"):
            stand_ins(model)[0](torch.zeros(1, 2, 64))
        with pytest.raises(ValueError, match="patched already"):
            mla.hf.patch(model)
    with pytest.raises(ValueError, match="num_layers"):
        mla.hf.patch(model, mla.PagedLatentCache(mla.MLAConfig.preset("tiny"), num_blocks=4, block_size=4,
                                                 dtype=torch.float32))


def count_steps(monkeypatch):
    """Lists that collect, per call, the rows of each whole-model static decode step and of each
    ``cache.prepare`` (the eager forwards)."""
    packed, prepared = [], []
    run, prepare = mla.StepGraph.run_packed, mla.PagedLatentCache.prepare
    monkeypatch.setattr(mla.StepGraph, "run_packed", lambda self, x, n: packed.append(n) or run(self, x, n))
    monkeypatch.setattr(mla.PagedLatentCache, "prepare",
                        lambda self, reqs: prepared.append(len(list(reqs))) or prepare(self, reqs))
    return packed, prepared


@pytest.mark.parametrize("case, graphs", [("deepseek_v3", None), ("deepseek_v3", True), ("mistral4", True),
                                          ("minicpm3", True), ("longcat_flash", True), ("deepseek_v32", True),
                                          ("axk2", True), ("hy_v4", True)])
def test_graphs_generate_matches_eager(case, graphs, monkeypatch):
    """Every decode step of generate runs the whole model as one static step (on CPU its static
    buffers, eagerly; on a GPU one graph replay), the prompt eagerly: the tokens are the
    unpatched model's for batch 1 and a left-padded batch of 2, and the only ``prepare`` is
    the prompt's. Dense families take the static step by default (graphs=None), so that the
    eager and graphed steps run the same kernels."""
    model = make_model(case, seed=GENERATE_SEEDS.get(case, 0))
    requests = [prompts(1, seed=1), prompts(2, seed=2)]
    refs = [greedy(model, ids, mask) for ids, mask in requests]
    packed, prepared = count_steps(monkeypatch)
    with mla.hf.patch(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, graphs=graphs) as handle:
        assert handle.graphs is bool(graphs)
        for (ids, mask), ref in zip(requests, refs):
            packed.clear(), prepared.clear()
            assert greedy(model, ids, mask).tolist() == ref.tolist(), f"{case}, batch {ids.shape[0]}"
            # the first token comes from the prompt's forward, each later one from a decode step
            assert packed == [ids.shape[0]] * (NEW_TOKENS - 1) and prepared == [ids.shape[0]]
        handle.release()
        assert handle.cache.num_free_blocks == NUM_BLOCKS


@pytest.mark.parametrize("mode", ["beam_search", "eos_return_dict", "continue_cache", "sample"])
def test_graphs_generate_modes(mode, monkeypatch):
    """Beam search (reorder, copy-on-write in the static step's tables), an eos with the cache
    returned, a generate continuing a returned cache, and sampling: the unpatched model's tokens,
    every decode step static."""
    model = make_model("deepseek_v3", seed=5)
    ids, mask = prompts(2, seed=6)
    kw = {"beam_search": dict(num_beams=3), "eos_return_dict": dict(eos_token_id=10, pad_token_id=0,
                                                                    return_dict_in_generate=True),
          "continue_cache": {}, "sample": dict(do_sample=True, top_k=0)}[mode]

    def run():
        torch.manual_seed(11)
        if mode == "continue_cache":
            half = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS // 2, do_sample=False,
                                  return_dict_in_generate=True)
            mask2 = torch.cat([mask, torch.ones(2, NEW_TOKENS // 2, dtype=mask.dtype)], 1)
            return model.generate(half.sequences, attention_mask=mask2, past_key_values=half.past_key_values,
                                  max_new_tokens=NEW_TOKENS // 2, do_sample=False)
        if mode == "sample":
            return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, **kw)
        out = greedy(model, ids, mask, **kw)
        return out.sequences if mode == "eos_return_dict" else out

    ref = run()
    packed, _ = count_steps(monkeypatch)
    with mla.hf.patch(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, graphs=True) as handle:
        assert run().tolist() == ref.tolist()
        assert packed, "no decode step ran static"
        handle.release()
        assert handle.cache.num_free_blocks == NUM_BLOCKS


def test_graphs_refused_where_a_graph_cannot_serve():
    kimi = make_model("kimi_linear")
    with pytest.raises(ValueError, match="graphs: 'kimi_linear': its linear-attention layers keep their state"):
        mla.hf.patch(kimi, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, graphs=True)
    assert not stand_ins(kimi)
    v32 = make_model("deepseek_v32")
    cfg = mla.hf.patch_config(v32)
    fp8_keys = mla.PagedLatentCache(cfg, num_layers=v32.config.num_hidden_layers, num_blocks=NUM_BLOCKS,
                                    block_size=BLOCK_SIZE, dtype=torch.float32, index_format="fp8")
    with mla.hf.patch(v32, fp8_keys, graphs=True) as handle:     # FP8 index keys are served too
        assert handle.graphs is True
    model = make_model("deepseek_v3")
    with pytest.raises(ValueError, match="graphs: expected True, False or None"):
        mla.hf.patch(model, graphs="yes")
    assert not stand_ins(model)
    # the default: graphs only where the cache is on a GPU and no indexer needs the host
    for case in ("deepseek_v3", "deepseek_v32", "kimi_linear"):
        with mla.hf.patch(make_model(case), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE) as handle:
            assert handle.graphs is False
    with mla.hf.patch(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, graphs=True) as handle:
        assert handle.graphs is True


@pytest.mark.parametrize("graphs", [None, True])
def test_glm_shared_indexer_layers_generate_eager_tokens(graphs, monkeypatch):
    """GLM-5 with shared indexer layers (1 and 3 reuse the top-k of 0 and 2): the patched model's
    layers share their top-k through the step's batch, eagerly and in the whole-model static
    step (one graph holds every layer, so the shared top-k stays inside it); generate gives the
    unpatched model's tokens."""
    model = make_model("glm_moe_dsa", num_hidden_layers=4, indexer_types=["full", "shared", "full", "shared"])
    packed, _ = count_steps(monkeypatch)
    for ids, mask in (prompts(1, seed=1), prompts(2, seed=2)):
        ref = greedy(model, ids, mask)
        with mla.hf.patch(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, graphs=graphs) as handle:
            assert handle.cfg.index_shared_layers == (1, 3)
            assert greedy(model, ids, mask).tolist() == ref.tolist()
    assert bool(packed) is bool(graphs)


def test_right_padding_refused_by_name():
    model = make_model("deepseek_v3")
    ids, mask = prompts(2, seed=2)
    right = mask.flip(1)
    with mla.hf.patch(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE) as handle:
        with pytest.raises(ValueError, match=r"row 1 has padding after a real token \(right padding\).*"
                                             r"padding_side = 'left'"):
            greedy(model, ids.flip(1), right)
        assert handle.cache.num_free_blocks == NUM_BLOCKS


def test_decode_step_mask_checked_at_the_next_forward():
    """A decode step trusts its mask to be generate's (its shape is checked then); a mask whose
    new column is padding is reported by the next forward that reads the host."""
    model = make_model("deepseek_v3")
    ids, mask = prompts(2, seed=2)
    with mla.hf.patch(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE):
        o = model(input_ids=ids, attention_mask=mask, use_cache=True)
        bad = torch.cat([mask, torch.tensor([[1], [0]])], 1)
        model(input_ids=torch.tensor([[3], [4]]), attention_mask=bad, past_key_values=o.past_key_values)
        with pytest.raises(ValueError, match="the decode step at 9 past tokens had a mask"):
            model(input_ids=ids, attention_mask=mask)


def test_model_to_dtype_follows():
    """model.to(bfloat16) after patch: the layers, the cache the patch made and the static step
    follow (as patching the cast model would give), unpatch restores bfloat16 modules; a dtype
    mla does not run is refused by name."""
    model = make_model("deepseek_v3")
    ids, mask = prompts(2, seed=2)
    with mla.hf.patch(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE) as handle:
        greedy(model, ids, mask)
        model.to(torch.bfloat16)
        out = greedy(model, ids, mask)
        assert handle.dtype == handle.cache.dtype == handle.layers[0].w_a.dtype == torch.bfloat16
        with pytest.raises(ValueError, match="float64 after patch; mla's layers run in one of"):
            model.to(torch.float64)(input_ids=ids, attention_mask=mask)
        model.to(torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    with mla.hf.patch(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE):
        assert greedy(model, ids, mask).tolist() == out.tolist()


@pytest.mark.parametrize("name", ["deepseek_v4"])
def test_refused_family(name):
    """A family from_hf refuses, or whose sparse indexer patch does not drive, is refused by
    patch, naming the model_type, before any change."""
    cfg = F.SPARSE[name].make_config() if name in F.SPARSE else F.make_refused_config(name)
    model = torch.nn.Module()
    model.config = cfg
    with pytest.raises(NotImplementedError, match=cfg.model_type):
        mla.hf.patch(model)


def test_import_mla_does_not_import_transformers():
    code = "import sys, mla; assert 'transformers' not in sys.modules and 'mla.hf' not in sys.modules; mla.hf.patch"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_given_cache():
    """A caller's cache (from_hf of the model's config) serves the patch and sees its blocks."""
    model = make_model("deepseek_v3")
    ids, mask = prompts(2, seed=2)
    ref = greedy(model, ids, mask)
    cache = mla.PagedLatentCache(mla.MLAConfig.from_hf(model.config), num_layers=2, num_blocks=32, block_size=8,
                                 dtype=torch.float32)
    with mla.hf.patch(model, cache) as handle:
        assert handle.cache is cache
        assert greedy(model, ids, mask).tolist() == ref.tolist()
        assert cache.num_free_blocks == 32 - sum(math.ceil((int(n) + NEW_TOKENS - 1) / 8) for n in mask.sum(1))
    assert cache.num_free_blocks == 32          # unpatch releases the request


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["deepseek_v3", "deepseek_v32"])
def test_graphs_on_gpu(case, monkeypatch):
    """On a GPU: each decode step one CUDA graph replay of the whole model, with no host
    synchronisation inside the patch's step (CUDA's sync debug mode set to error around it);
    float32 tokens equal the unpatched model's and the eager static step's, batch 1 and a
    left-padded batch of 2."""
    model = make_model(case).cuda()
    requests = [tuple(t.cuda() for t in prompts(b, seed=b)) for b in (1, 2)]
    refs = [greedy(model, ids, mask).tolist() for ids, mask in requests]
    with mla.hf.patch(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, graphs=False):
        assert [greedy(model, ids, mask).tolist() for ids, mask in requests] == refs
    with mla.hf.patch(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, graphs=True) as handle:
        assert [greedy(model, ids, mask).tolist() for ids, mask in requests] == refs   # captures
        assert handle._decode.graph.captured == (1, 2)
        step, steps = type(handle._decode).__call__, []

        def no_sync(self, *args):
            torch.cuda.set_sync_debug_mode("error")
            try:
                out = step(self, *args)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            steps.append(out is not None)
            return out
        monkeypatch.setattr(type(handle._decode), "__call__", no_sync)
        assert [greedy(model, ids, mask).tolist() for ids, mask in requests] == refs
        assert steps.count(True) == 2 * (NEW_TOKENS - 1)


def test_patched_model_saves_and_loads_as_unpatched(tmp_path):
    """The stand-ins hold the original modules' tensors: the patched model's state_dict is the
    unpatched one's, save_pretrained writes a checkpoint that loads, and load_state_dict of other
    weights reaches mla's layers at the next forward."""
    model, other = make_model("deepseek_v3"), make_model("deepseek_v3", seed=1)
    ids, mask = prompts(2, seed=2)
    keys = list(model.state_dict())
    ref = other(input_ids=ids, attention_mask=mask).logits
    with mla.hf.patch(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE):
        logits = model(input_ids=ids, attention_mask=mask).logits
        assert list(model.state_dict()) == keys
        model.save_pretrained(tmp_path)
        model.load_state_dict(other.state_dict())
        real = mask.bool()
        assert ((model(input_ids=ids, attention_mask=mask).logits - ref)[real].abs().max()
                <= LOGIT_TOL * ref[real].abs().max())
    loaded = type(model).from_pretrained(tmp_path).float().eval()
    assert ((loaded(input_ids=ids, attention_mask=mask).logits - logits)[real].abs().max()
            <= LOGIT_TOL * logits[real].abs().max())


def test_equal_requests_leave_equal_caches():
    """transformers' Cache of a patched request holds zero stubs: two equal requests compare equal."""
    model = make_model("deepseek_v3")
    ids, mask = prompts(2, seed=2)
    with mla.hf.patch(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE):
        a = greedy(model, ids, mask, return_dict_in_generate=True).past_key_values
        b = greedy(model, ids, mask, return_dict_in_generate=True).past_key_values
        for la, lb in zip(a.layers, b.layers):
            assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)


def test_training_and_output_attentions_refused_by_name():
    """mla serves inference: backward through its attention, gradient checkpointing and
    attention dropout in training mode, and output_attentions raise NotImplementedError naming
    them; a training-mode forward without them runs as eval's."""
    model = make_model("deepseek_v3")
    ids, mask = prompts(2, seed=2)
    with mla.hf.patch(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE):
        with pytest.raises(NotImplementedError, match="output_attentions"):
            model(input_ids=ids, attention_mask=mask, output_attentions=True)
        model.config.output_attentions = True
        with pytest.raises(NotImplementedError, match="output_attentions"):
            model(input_ids=ids, attention_mask=mask)
        model.config.output_attentions = False
        with torch.no_grad():
            ref = model(input_ids=ids, attention_mask=mask).logits
        model.train()
        out = model(input_ids=ids, attention_mask=mask)
        assert torch.equal(out.logits, ref)
        with pytest.raises(NotImplementedError, match="training: .*backward"):
            out.logits.sum().backward()
        model.gradient_checkpointing_enable()
        with pytest.raises(NotImplementedError, match="training: gradient checkpointing"):
            model(input_ids=ids, attention_mask=mask)
    dropping = make_model("deepseek_v3", attention_dropout=0.1)
    with mla.hf.patch(dropping, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE):
        dropping(input_ids=ids, attention_mask=mask)          # eval: no dropout to apply
        with pytest.raises(NotImplementedError, match="training: attention_dropout"):
            dropping.train()(input_ids=ids, attention_mask=mask)
