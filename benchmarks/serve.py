"""Serving throughput: transformers' continuous batching on mla's latent cache (mla.hf.engine)
against the same patched model's ``generate`` in static batches, in one process.

The model is DeepSeek-V3-shaped with random bf16 weights (hidden 7168, 128 heads, q_lora_rank
1536, kv_lora_rank 512; ``--layers`` layers with a small dense MLP and vocabulary, so that
attention dominates). The trace is seeded: ``--requests`` prompts of 128-4096 random tokens, each
with 64-512 new tokens (EOS off), served

- all at once (every request added at t=0), and with Poisson arrivals at ``--poisson`` times the
  all-at-once run's request rate;
- by static batches of ``generate`` (left-padded, each batch run to its longest budget; only
  each request's own budget counts as output) at each size of ``--static-batches`` over the
  trace's first ``--static-requests`` requests, each timed at its second run (the first
  compiles its kernels and captures its graphs), the best size reported.

Each run starts its manager as a server does: ``start`` warms up first (the decode graphs
captured, the eager steps' kernel variants compiled: ``LatentCache.warm_up``), untimed and
reported as ``warmup`` with the compiles in it; the compiles that still fall in the timed run
are reported with its eager steps (``eager.compiled``: kernel and integer constexprs).
``--warmup full|short`` adds an untimed pass of the trace (or of 4 new tokens a request) before
the timed runs.

The engine runs with its async double-buffering (on by default on a GPU: step N+1 launched
before step N's tokens are read back) and without, each trace in each mode
(``--async-batching both``), so the two stand side by side from one process.

Reported per run: request and output-token throughput, TTFT, TPOT (a request's time per output
token after its first) and ITL (the gaps between consecutive tokens of a request, pooled over
all requests) as mean / p50 / p99 (the Poisson run's over the requests after the first
``--poisson-skip``, past the ramp-up while the pool fills), peak GPU memory, the most sequences in one step, how many steps ran the whole model as
one graph (pure decode steps, ``graphed_steps``), and where the loop's time goes: the engine's
host work (scheduling, batch tensors, updates), the model's forward call of the other steps
(its host work, and the GPU wherever the forward waits on it: a pageable host-to-device copy
of the step's tables waits for the stream), the forward call of the graphed decode steps
(host only: packing, one transfer, the replay's launch, the engine's sampling launches; per
step as ``decode_step_host_ms``), and the wait for the step's sampled tokens.

    PYTHONPATH=src python3 benchmarks/serve.py --out serve.json
    PYTHONPATH=src python3 benchmarks/serve.py --tiny [--graphs on]   # a CPU smoke run of the same code
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import random
import threading
import time

import torch

import mla
import mla.hf
from transformers import ContinuousBatchingConfig, DeepseekV3Config, DeepseekV3ForCausalLM, GenerationConfig


def model_config(layers: int, tiny: bool) -> DeepseekV3Config:
    if tiny:
        dims = dict(hidden_size=64, num_attention_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
                    qk_rope_head_dim=8, v_head_dim=16)
    else:
        dims = dict(hidden_size=7168, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    return DeepseekV3Config(**dims, num_key_value_heads=dims["num_attention_heads"], num_hidden_layers=layers,
                            intermediate_size=1024, first_k_dense_replace=layers, vocab_size=1024,
                            max_position_embeddings=8192, rope_interleave=True, tie_word_embeddings=False)


def build(layers: int, tiny: bool, device: str):
    cfg = model_config(layers, tiny)
    torch.manual_seed(0)
    with torch.device(device):
        model = DeepseekV3ForCausalLM(cfg).to(torch.float32 if tiny else torch.bfloat16).eval()
    return model


def trace(n: int, seed: int, tiny: bool):
    rng = random.Random(seed)
    lo, hi, nlo, nhi = (4, 40, 2, 12) if tiny else (128, 4096, 64, 512)
    return [([rng.randrange(1024) for _ in range(rng.randint(lo, hi))], rng.randint(nlo, nhi)) for _ in range(n)]


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))] if xs else float("nan")


class Probe:
    """Times the engine's loop parts on one manager's processor, counts its steps, the tokens
    and time of its eager (prefill and mixed) forwards and the Triton compiles that fall in the
    run; with ``profile_step`` k, runs the k-th eager forward under torch.profiler."""

    def __init__(self, manager, handle, profile_step: int | None = None):
        self.t = dict(engine_host=0.0, forward_host=0.0, decode_forward_host=0.0, gpu_wait=0.0)
        self.steps = self.graphed = self.max_seqs = 0
        self.eager_tokens, self.eager_ms = [], []
        self.compiles, self.compile_s, self.compiled = 0, 0.0, []
        self.profile_step, self.profile = profile_step, None
        proc = manager.batch_processor
        self._wrap(proc, "prepare_next_batch", "engine_host")
        self._wrap(proc, "update_batch", "engine_host")
        self._wrap(proc.model_runner, "compute_batch", "forward_host")
        self._wrap(proc.inputs_and_outputs, "retrieve_device_outputs", "gpu_wait")
        plan = handle.engine_step

        def counting(kwargs):
            step = plan(kwargs)
            self.steps += 1
            self.graphed += step.run is not None
            self.max_seqs = max(self.max_seqs, len(step.requests))
            if step.run is None:
                self.eager_tokens.append(sum(n for _, _, n in step.requests))
            return step
        handle.engine_step = counting
        restore = [lambda: setattr(handle, "engine_step", plan)]
        try:   # Triton's compiles (and loads from its disk cache) of kernel variants not seen yet
            from triton.runtime.jit import JITFunction
            compile_fn = JITFunction._do_compile

            def compiling(fn, *a, **k):
                t0 = time.perf_counter()
                try:
                    return compile_fn(fn, *a, **k)
                finally:
                    dt = time.perf_counter() - t0
                    self.compiles += 1
                    self.compile_s += dt
                    self.compiled.append((variant(fn, *a), round(dt, 2)))
            JITFunction._do_compile = compiling
            restore.append(lambda: setattr(JITFunction, "_do_compile", compile_fn))
        except (ImportError, AttributeError):
            pass
        self._restore = lambda: [r() for r in restore]

    def _wrap(self, obj, name, key):
        fn = getattr(obj, name)

        def timed(*a, **k):
            graphed, eager, t0 = self.graphed, len(self.eager_tokens), time.perf_counter()
            profiling = key == "forward_host" and self.profile_step == len(self.eager_ms) and self.profile is None
            if profiling:
                from torch.profiler import ProfilerActivity, profile
                cuda = torch.cuda.is_available()
                self.profile = profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda)
                if cuda:
                    torch.cuda.synchronize()
                self.profile.__enter__()
            try:
                return fn(*a, **k)
            finally:
                if profiling:
                    if cuda:
                        torch.cuda.synchronize()
                    self.profile.__exit__(None, None, None)
                    if len(self.eager_tokens) == eager:     # a graphed decode step: the next one
                        self.profile = None
                dt = time.perf_counter() - t0
                # a whole-step decode forward: its host time apart (no sync inside, so host only)
                self.t["decode_forward_host" if key == "forward_host" and self.graphed > graphed else key] += dt
                if key == "forward_host" and len(self.eager_tokens) > eager:
                    self.eager_ms.append(1e3 * dt)
        setattr(obj, name, timed)

    def eager_summary(self) -> dict:
        ms, toks = sorted(self.eager_ms), sum(self.eager_tokens)
        return dict(steps=len(ms), tokens=toks, ms_p50=percentile(ms, 50), ms_max=ms[-1] if ms else None,
                    us_per_token=1e3 * sum(ms) / max(toks, 1), triton_compiles=self.compiles,
                    triton_compile_s=round(self.compile_s, 2), compiled=self.compiled)

    def profile_tables(self) -> str | None:
        """The profiled eager forward: its tokens, and the top kernels and host ops."""
        if self.profile is None:
            return None
        k = self.profile_step
        avg = self.profile.key_averages()
        return (f"eager step {k}: {self.eager_tokens[k]} tokens, {self.eager_ms[k]:.1f} ms\n"
                + avg.table(sort_by="cuda_time_total" if torch.cuda.is_available() else "cpu_time_total", row_limit=15, max_name_column_width=60)
                + avg.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))

    def close(self):
        self._restore()


def variant(fn, key=None, signature=None, device=None, constexprs=None, *rest) -> str:
    """A compiled kernel's name and its integer constexprs (what tells its variants apart)."""
    names = getattr(fn, "arg_names", [])
    ints = {names[k[0]] if isinstance(k, tuple) and k and k[0] < len(names) else str(k): v
            for k, v in (constexprs or {}).items() if isinstance(v, int) and not isinstance(v, bool)}
    return getattr(fn, "__name__", "?") + "(" + ",".join(f"{k}={v}" for k, v in ints.items()) + ")"


def latency(xs) -> dict:
    return dict(mean=sum(xs) / len(xs) if xs else float("nan"), p50=percentile(xs, 50), p99=percentile(xs, 99))


def run_engine(model, handle, reqs, arrivals, cb_kw, device, profile_step=None, skip: int = 0):
    """Serve reqs [(prompt, new_tokens)] with request i added at arrivals[i] seconds; latencies
    over the requests after the first ``skip``."""
    gen = GenerationConfig(max_new_tokens=max(n for _, n in reqs), do_sample=False, eos_token_id=-1)
    manager = model.init_continuous_batching(gen, ContinuousBatchingConfig(**cb_kw))
    probe = Probe(manager, handle, profile_step)
    pool_tokens = manager.cache.num_pages
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    manager.start()     # warms up first: graphs captured, the eager steps' kernels compiled
    warm = dict(seconds=round(manager.warmup_s, 2), triton_compiles=probe.compiles,
                triton_compile_s=round(probe.compile_s, 2))
    probe.compiles, probe.compile_s, probe.compiled = 0, 0.0, []
    outs = {}

    def collect():     # non-streaming requests: the queue holds each one's finished output
        while len(outs) < len(reqs) and manager.is_running():
            out = manager.get_result(timeout=0.5)
            if out is not None and out.is_finished():
                outs[out.request_id] = out
    collector = threading.Thread(target=collect)
    collector.start()
    t0 = time.perf_counter()
    try:
        for i, ((prompt, new), at) in enumerate(zip(reqs, arrivals)):
            wait = t0 + at - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=new, record_timestamps=True)
        collector.join()
        elapsed = time.perf_counter() - t0
        if len(outs) < len(reqs):
            raise RuntimeError(f"the engine's loop stopped with {len(reqs) - len(outs)} requests unserved")
    finally:
        manager.stop(block=True, timeout=30)
        probe.close()
        del manager
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    errors = [o.error for o in outs.values() if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
    tokens = sum(len(o.generated_tokens) for o in outs.values())
    assert tokens == sum(n for _, n in reqs), "a request ended early"
    kept = [outs[f"r{i}"] for i in range(skip, len(reqs))]
    ttft = [o.timestamps[0] - o.created_time for o in kept]
    tpot = [(o.timestamps[-1] - o.timestamps[0]) / (len(o.timestamps) - 1) for o in kept if len(o.timestamps) > 1]
    itl = [b - a for o in kept for a, b in zip(o.timestamps, o.timestamps[1:])]
    ttft, tpot, itl = latency(ttft), latency(tpot), latency(itl)
    return dict(seconds=elapsed, output_tokens=tokens, tokens_per_s=tokens / elapsed,
                requests_per_s=len(reqs) / elapsed, latencies_over=len(kept),
                ttft=ttft, tpot=tpot, itl=itl, ttft_p50=ttft["p50"], ttft_p99=ttft["p99"],
                tpot_p50=tpot["p50"], tpot_p99=tpot["p99"],
                peak_gib=(torch.cuda.max_memory_allocated() / 2**30) if device == "cuda" else None,
                most_in_flight=probe.max_seqs, steps=probe.steps, graphed_steps=probe.graphed,
                decode_step_host_ms=1e3 * probe.t["decode_forward_host"] / max(probe.graphed, 1),
                pool_tokens=pool_tokens, warmup=warm, eager=probe.eager_summary(), profile=probe.profile_tables(),
                time_split={k: round(v, 3) for k, v in probe.t.items()})


def run_static(model, reqs, batch, device):
    """generate in static batches of ``batch`` (left-padded); useful tokens = each request's own budget."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch):
        chunk = reqs[i:i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, (p, _) in enumerate(chunk):
            ids[b, width - len(p):] = torch.tensor(p)
            mask[b, width - len(p):] = 1
        new = max(n for _, n in chunk)
        model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, eos_token_id=None, pad_token_id=0)
    sync()
    elapsed = time.perf_counter() - t0
    useful = sum(n for _, n in reqs)
    return dict(batch=batch, seconds=elapsed, output_tokens=useful, tokens_per_s=useful / elapsed)


def check_tokens(model, handle, reqs, cb_kw, device):
    """The engine's greedy tokens against the patched model's own generate, request by request
    (bf16 on the GPU: another batch composition may round differently, so this counts matches)."""
    gen = GenerationConfig(max_new_tokens=max(n for _, n in reqs), do_sample=False, eos_token_id=-1)
    out = model.generate_batch([p for p, _ in reqs], gen, continuous_batching_config=ContinuousBatchingConfig(
        **cb_kw), progress_bar=False)
    same = 0
    for (p, n), o in zip(reqs, out.values()):
        ref = model.generate(torch.tensor([p], device=device), max_new_tokens=len(o.generated_tokens),
                             do_sample=False, eos_token_id=None)[0, len(p):].tolist()
        same += ref == o.generated_tokens
    return dict(requests=len(reqs), identical=same)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--poisson", type=float, default=0.7, help="arrival rate, times the all-at-once request rate (0: no Poisson run)")
    ap.add_argument("--static-batches", default="32,64")
    ap.add_argument("--static-requests", type=int, default=64)
    ap.add_argument("--max-batch-tokens", type=int, default=8192)
    ap.add_argument("--memory", type=float, default=0.4, help="max_memory_percent of the engine's pool")
    ap.add_argument("--graphs", choices=("auto", "on", "off"), default="auto",
                    help="the engine's whole-step decode graphs (mla.hf.enable's graphs: None, True, False)")
    ap.add_argument("--warmup", choices=("none", "full", "short"), default="none",
                    help="an untimed pass of the trace before the timed runs: none, the whole trace, or 4 new "
                         "tokens a request (the manager's own warm-up runs at each start in any case)")
    ap.add_argument("--profile-step", type=int, default=None,
                    help="run the all-at-once run's k-th eager (prefill or mixed) forward under torch.profiler")
    ap.add_argument("--async-batching", choices=("on", "off", "both"), default="both",
                    help="the engine's async double-buffering (use_async_batching); both: each run in each mode")
    ap.add_argument("--prefill-tokens", type=int, default=None,
                    help="mla.hf.enable's prefill_tokens: prompt tokens a step takes beside the decoding requests")
    ap.add_argument("--poisson-skip", type=int, default=32,
                    help="the Poisson run's first requests left out of its latencies (the ramp-up)")
    ap.add_argument("--tiny", action="store_true", help="a tiny float32 model on CPU: checks the script runs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = "cpu" if args.tiny else "cuda"
    t_start = time.perf_counter()
    model = build(args.layers, args.tiny, device)
    reqs = trace(args.requests, args.seed, args.tiny)
    longest = max(len(p) + n for p, n in reqs)
    bs = 4 if args.tiny else 64
    # the patch's own cache serves the static batches: the widest batch of the longest requests
    blocks = max(map(int, args.static_batches.split(","))) * -(-longest // bs) + 8
    handle = mla.hf.patch(model, num_blocks=blocks, block_size=bs)
    mla.hf.enable(handle, graphs=dict(auto=None, on=True, off=False)[args.graphs], prefill_tokens=args.prefill_tokens)
    cb_kw = dict(block_size=bs, max_batch_tokens=args.max_batch_tokens,
                 max_memory_percent=args.memory, allow_block_sharing=False)
    if args.tiny:
        cb_kw.update(num_blocks=4096, max_batch_tokens=64)
    report = dict(prefill_tokens=args.prefill_tokens, model=dict(layers=args.layers, heads=model.config.num_attention_heads,
                             hidden=model.config.hidden_size, dtype=str(model.dtype)),
                  trace=dict(requests=len(reqs), seed=args.seed, prompt_tokens=sum(len(p) for p, _ in reqs),
                             output_tokens=sum(n for _, n in reqs)))
    report["check"] = check_tokens(model, handle, [(p, min(n, 32)) for p, n in reqs[:4]], cb_kw, device)
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    print("check", report["check"], flush=True)
    save(report, args.out)
    if args.warmup != "none":
        t0 = time.perf_counter()
        warm = reqs if args.warmup == "full" else [(p, 4) for p, _ in reqs]
        report["warmup_pass"] = run_engine(model, handle, warm, [0.0] * len(reqs), cb_kw, device)["eager"]
        report["warmup_s"] = time.perf_counter() - t0
        print("warmup", report["warmup_s"], flush=True)
    modes = dict(on=[True], off=[False], both=[False, True])[args.async_batching]
    if args.tiny:
        modes = [False]      # double-buffering needs CUDA streams
    for use_async in modes:
        kw, tag = dict(cb_kw, use_async_batching=use_async), "async" if use_async else "sync"
        run = report[f"all_at_once_{tag}"] = run_engine(model, handle, reqs, [0.0] * len(reqs), kw, device,
                                                        args.profile_step)
        print(f"all_at_once_{tag}", run, flush=True)
        save(report, args.out)
        if args.poisson > 0:
            rate = args.poisson * len(reqs) / run["seconds"]
            rng = random.Random(args.seed + 1)
            arrivals, t = [], 0.0
            for _ in reqs:
                arrivals.append(t)
                t += rng.expovariate(rate)
            report[f"poisson_{tag}"] = dict(rate_per_s=rate, **run_engine(model, handle, reqs, arrivals, kw, device,
                                                                          skip=min(args.poisson_skip, len(reqs) - 1)))
            print(f"poisson_{tag}", report[f"poisson_{tag}"], flush=True)
            save(report, args.out)
    report["all_at_once"] = report[f"all_at_once_{'async' if modes[-1] else 'sync'}"]
    static = []
    for b in map(int, args.static_batches.split(",")):
        try:     # twice: the first run compiles and captures what this batch size needs
            run_static(model, reqs[:args.static_requests], b, device)
            static.append(run_static(model, reqs[:args.static_requests], b, device))
        except torch.OutOfMemoryError:
            static.append(dict(batch=b, error="out of memory"))
            torch.cuda.empty_cache()
        print("static", static[-1], flush=True)
        report["static"] = static
        save(report, args.out)
    report["static"] = static
    best = max((s for s in static if "tokens_per_s" in s), key=lambda s: s["tokens_per_s"])
    for tag in ("sync", "async"):
        if f"all_at_once_{tag}" in report:
            report[f"speedup_all_at_once_{tag}_vs_best_static"] = (report[f"all_at_once_{tag}"]["tokens_per_s"]
                                                                   / best["tokens_per_s"])
    report["speedup_all_at_once_vs_best_static"] = report["all_at_once"]["tokens_per_s"] / best["tokens_per_s"]
    report["wall_s"] = time.perf_counter() - t_start
    print(json.dumps(report, indent=1))
    save(report, args.out)


def save(report: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
