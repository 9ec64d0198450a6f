"""Greedy generate of a transformers MLA model: transformers' own attention (its compiled
static-cache generate) against the same model patched by ``mla.hf.patch``, in one process on
one GPU.

    PYTHONPATH=src python3 benchmarks/hf_generate.py [--model v3] [--layers 4] [--batch 1 8 32]
        [--prompt 1024] [--new 32] [--no-compile]

--model v3 (default): DeepSeek-V3's attention (128 heads, q_lora 1536, kv_lora 512, nope 128,
rope 64, v 128, hidden 7168) on ``--layers`` layers with a small dense MLP (intermediate 2048)
and a small vocabulary, so that attention dominates each step. --model v2lite: a
DeepSeek-V2-Lite-shaped whole model (27 layers, 16 heads, hidden 2048, kv_lora 512, q_lora
none, MoE of 64 routed experts top 6 and 2 shared, the first layer dense, vocabulary 102400).
Random bf16 weights, std 0.5 / sqrt(fan_in), small enough that attention is not one-hot (with
peakier random weights bf16 rounding alone parts greedy paths).

transformers runs sdpa attention with a static cache, compiled (its generation default), or
with --no-compile its dynamic cache eagerly. The patched model runs mla on a paged latent cache,
each decode step one CUDA graph (captured in the untimed first generate), twice: under
transformers' own decode loop (``overlap=False``: the step's inputs prepared in Python and the
stop flag read back every step) and under mla's loop one step ahead (``overlap=True``, the
default: ``mla.hf.generate``). --eager adds the patch with ``graphs=False`` (the static step
run eagerly). Every generate runs twice and the second is timed, so no compilation or capture
is counted. Reported: decode tokens/s (batch x (new - 1) tokens over the time of
generate(new) less generate(1), so the prompt is not counted), the fractions of generated
tokens that agree (transformers against mla; the two loops against each other), the host time
of a step's ``DecodeStep`` call (packing, the one transfer, the replay's launch) under the
overlapped loop, the bucket's graph replay alone (CUDA events, 20 replays) and the step time
each loop gives: a step within the replay's time leaves the GPU no wait.

--host prints only the patch's host time a graphed step, in parts (no transformers run).
--explain also prints, at batch 1, the decode split counts of the table widths the eager
layer path and the static step use, and how far one layer's output moves between them.
"""
from __future__ import annotations

import argparse
import time

import torch

import mla


def build(kind: str, layers: int):
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    if kind == "v3":
        cfg = DeepseekV3Config(
            vocab_size=4096, hidden_size=7168, intermediate_size=2048, moe_intermediate_size=256,
            num_hidden_layers=layers, first_k_dense_replace=layers, n_routed_experts=8, num_experts_per_tok=2,
            n_group=1, topk_group=1, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
            kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            max_position_embeddings=8192, rope_interleave=True)
        cls = DeepseekV3ForCausalLM
    else:
        cfg = DeepseekV2Config(
            vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
            num_hidden_layers=27, first_k_dense_replace=1, n_routed_experts=64, num_experts_per_tok=6,
            n_shared_experts=2, n_group=1, topk_group=1, topk_method="greedy", num_attention_heads=16,
            num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
            qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=8192)
        cls = DeepseekV2ForCausalLM
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = cls(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.5 / p.shape[-1] ** 0.5)
    return model


def timed_generate(model, ids, mask, new: int, **kw) -> tuple[float, torch.Tensor]:
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, **kw)
    torch.cuda.synchronize()
    return time.perf_counter() - t, out[:, ids.shape[1]:]


def decode_rate(model, ids, mask, new: int, **kw) -> tuple[float, torch.Tensor]:
    """Decode tokens/s: generate(new) less generate(1) (the prompt and first token), each the
    second of two calls (the first compiles or captures)."""
    t1 = [timed_generate(model, ids, mask, 1, **kw)[0] for _ in range(2)][-1]
    tn, toks = [timed_generate(model, ids, mask, new, **kw) for _ in range(2)][-1]
    return ids.shape[0] * (new - 1) / max(tn - t1, 1e-9), toks


def host_and_replay(model, handle, ids, mask, new: int) -> tuple[float, float]:
    """The host time of a graphed decode step's DecodeStep call (mean us over one generate) and
    the bucket's graph replay alone (ms, CUDA events)."""
    from mla.hf.decode_step import DecodeStep

    times, call = [], DecodeStep.__call__

    def timed(self, *args):
        t = time.perf_counter()
        out = call(self, *args)
        times.append(time.perf_counter() - t)
        return out
    DecodeStep.__call__ = timed
    try:
        timed_generate(model, ids, mask, new)
    finally:
        DecodeStep.__call__ = call
    graph = handle._decode.graph
    n = next(b for b in graph.buckets if b >= ids.shape[0])
    g = graph._graphs[n][0]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    # the last step's rows and tokens are still in the buffers: each replay writes the same
    # cache rows again, with the same values
    g.replay()
    start.record()
    for _ in range(20):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e6 * sum(times[1:]) / max(len(times) - 1, 1), start.elapsed_time(end) / 20


def host_breakdown(model, B: int, prompt: int, new: int) -> None:
    """The patch's host time a graphed decode step, median and mean over one generate, split
    into its parts; and the garbage collections that fell in that generate (a collection is a
    host pause of its own, counted in whatever step it falls in)."""
    import gc
    import statistics
    from mla.hf.decode_step import DecodeStep

    parts = {"patch": [], "DecodeStep call": [], "run_packed": [], "append_tokens": [], "set_lengths": []}

    def timing(name, fn):
        def wrapped(*args, **kw):
            t = time.perf_counter()
            out = fn(*args, **kw)
            if out is not None or name == "set_lengths":     # the patch's None: not a decode step
                parts[name].append(time.perf_counter() - t)
            return out
        return wrapped
    g = torch.Generator(device="cuda").manual_seed(B)
    ids = torch.randint(0, model.config.vocab_size, (B, prompt), device="cuda", generator=g)
    mask = torch.ones_like(ids)
    with mla.hf.patch(model, num_blocks=B * ((prompt + new) // 64 + 2), block_size=64, graphs=True,
                      overlap=False) as handle:
        timed_generate(model, ids, mask, new)                        # captures
        saved = (DecodeStep.__call__, DecodeStep.set_lengths, mla.PagedLatentCache.append_tokens,
                 mla.StepGraph.run_packed)
        handle._decode_step = timing("patch", handle._decode_step)
        DecodeStep.__call__ = timing("DecodeStep call", saved[0])
        DecodeStep.set_lengths = timing("set_lengths", saved[1])
        mla.PagedLatentCache.append_tokens = timing("append_tokens", saved[2])
        mla.StepGraph.run_packed = timing("run_packed", saved[3])
        collections = []
        gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info["generation"]))
        try:
            timed_generate(model, ids, mask, new)
        finally:
            gc.callbacks.pop()
            (DecodeStep.__call__, DecodeStep.set_lengths, mla.PagedLatentCache.append_tokens,
             mla.StepGraph.run_packed) = saved
            del handle._decode_step
    print(f"  B {B}: host us a decode step, median / mean: " + ", ".join(
        f"{k} {1e6 * statistics.median(v[1:]):.0f} / {1e6 * statistics.mean(v[1:]):.0f}" for k, v in parts.items()
        if len(v) > 1) + f"; garbage collections in the generate (generation: count) "
        f"{ {k: collections.count(k) for k in sorted(set(collections))} }", flush=True)


def explain(model, prompt: int) -> None:
    """Batch 1: one layer's decode output on its own block table (the eager layer path's: the
    sequence's blocks) against the static step's on tables of that width and wider (the static
    step's: the pool's), and the decode kernel's split count at each width."""
    from mla.ops.decode.gluon.common import default_splits
    cfg = mla.hf.patch_config(model)
    cache = mla.PagedLatentCache(cfg, num_layers=1, num_blocks=64, block_size=64, dtype=torch.bfloat16,
                                 device="cuda")
    layer = mla.MLA(cfg, dtype=torch.bfloat16, device="cuda")
    attn = next(m for m in model.modules() if hasattr(m, "kv_b_proj"))
    layer.load_hf_state_dict({k: v.detach() for k, v in attn.state_dict().items()})
    g = torch.Generator(device="cuda").manual_seed(0)
    cache.prepare([("s", prompt)])
    cache.kv.normal_(0, 1, generator=g)
    batch = cache.prepare([("s", 1)])
    x = torch.randn(1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, generator=g)
    own = layer(x, batch)
    rows = cfg.num_heads
    width = batch.block_table.shape[1]
    print(f"  table {width} blocks ({width * 64} keys, the layer's own): "
          f"{default_splits(1, rows, width * 64, x.device)} splits")
    for wide in (width, width + 2, 64):
        graph = mla.StepGraph(layer, cache, max_blocks_per_seq=wide, dtype=torch.bfloat16, cuda_graphs=False)
        cache.truncate("s", prompt)
        out = graph(x, cache.prepare([("s", 1)]))
        print(f"  table {wide} blocks ({wide * 64} keys): {default_splits(1, rows, wide * 64, x.device)} splits; "
              f"the layer's output against its own table's: max |diff| {(out.float() - own.float()).abs().max().item():.3g}"
              f" (mean |value| {own.float().abs().mean().item():.3g})")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("v3", "v2lite"), default="v3")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--no-compile", action="store_true", help="transformers with its dynamic cache, eagerly")
    p.add_argument("--explain", action="store_true")
    p.add_argument("--host", action="store_true", help="only the patch's host time a step under transformers' "
                   "loop, in parts")
    p.add_argument("--eager", action="store_true", help="also the patch with graphs=False")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("hf_generate: needs a CUDA GPU")
    model = build(a.model, a.layers)
    what = f"DeepSeek-V3 attention x {a.layers} layers" if a.model == "v3" else "DeepSeek-V2-Lite-shaped, 27 layers"
    print(f"{what}, bf16, prompt {a.prompt}, {a.new} new tokens, greedy")
    if a.explain:
        explain(model, a.prompt)
    if a.host:
        for B in a.batch:
            host_breakdown(model, B, a.prompt, a.new)
        return 0
    print(f"{'B':>4} {'transformers':>13} {'mla hf loop':>12} {'mla overlap':>12} {'hf loop/hf':>11} "
          f"{'overlap/hf':>11} {'same as hf':>11} {'loops same':>11} {'host us':>8} {'replay ms':>10} "
          f"{'step ms hf loop':>16} {'step ms overlap':>16} {'overlap/replay':>15}"
          + (f" {'mla eager':>10}" if a.eager else ""))
    hf_kw = {} if a.no_compile else {"cache_implementation": "static"}
    for B in a.batch:
        g = torch.Generator(device="cuda").manual_seed(B)
        ids = torch.randint(0, model.config.vocab_size, (B, a.prompt), device="cuda", generator=g)
        mask = torch.ones_like(ids)
        hf_rate, hf_toks = decode_rate(model, ids, mask, a.new, **hf_kw)
        blocks = B * ((a.prompt + a.new) // 64 + 2)
        with mla.hf.patch(model, num_blocks=blocks, block_size=64, graphs=True, overlap=False):
            loop_rate, loop_toks = decode_rate(model, ids, mask, a.new)
        with mla.hf.patch(model, num_blocks=blocks, block_size=64, graphs=True) as handle:
            rate, toks = decode_rate(model, ids, mask, a.new)
            host_us, replay_ms = host_and_replay(model, handle, ids, mask, a.new)
        extra = ""
        if a.eager:
            with mla.hf.patch(model, num_blocks=blocks, block_size=64, graphs=False):
                extra = f" {decode_rate(model, ids, mask, a.new)[0]:>10.1f}"
        same = (hf_toks == toks).float().mean().item()
        same_loops = (loop_toks == toks).float().mean().item()
        step, loop_step = 1e3 * B / rate, 1e3 * B / loop_rate
        print(f"{B:>4} {hf_rate:>13.1f} {loop_rate:>12.1f} {rate:>12.1f} {loop_rate / hf_rate:>10.2f}x "
              f"{rate / hf_rate:>10.2f}x {same:>11.3f} {same_loops:>11.3f} {host_us:>8.0f} {replay_ms:>10.3f} "
              f"{loop_step:>16.3f} {step:>16.3f} {step / replay_ms:>14.2f}x" + extra, flush=True)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
