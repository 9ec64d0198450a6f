"""Greedy generate of a DeepSeek-V3-shaped decoder stack: transformers' own attention against the
same model patched by ``mla.hf.patch``, in one process on one GPU.

    PYTHONPATH=src python3 benchmarks/hf_generate.py [--layers 4] [--batch 1 8 32] [--prompt 1024] [--new 64]

The model has DeepSeek-V3's attention (128 heads, q_lora 1536, kv_lora 512, nope 128, rope 64,
v 128, hidden 7168) with random bf16 weights, a small dense MLP (intermediate 2048) and a small
vocabulary, so the attention dominates each step. transformers runs its sdpa attention with a
static cache where it accepts one (else its dynamic cache, and says so); the patched model runs
mla on a paged latent cache, eagerly and with ``graphs=True`` (each layer's decode steps
replayed from CUDA graphs, captured in the untimed first generate). transformers compiles its
forward for a static cache (its generation default), once per cache shape: every generate is
run twice and the second one timed, so no compilation is counted. Reported: decode tokens/s
(batch x new tokens over the time of generate less the time of a 1-token generate, so the
prompt is not counted) and the fractions of generated tokens that agree (transformers and mla
eager; mla's graphs and eager). Weights are small enough (std 0.5 / sqrt(fan_in)) that
attention is not one-hot: with peakier random weights bf16 rounding alone parts greedy paths
(on CPU at 1.5 / sqrt(fan_in), transformers in bf16 agrees with itself in float32 on 78% of
tokens).
"""
from __future__ import annotations

import argparse
import time

import torch

import mla


def build(layers: int):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=4096, hidden_size=7168, intermediate_size=2048, moe_intermediate_size=256,
        num_hidden_layers=layers, first_k_dense_replace=layers, n_routed_experts=8, num_experts_per_tok=2,
        n_group=1, topk_group=1, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        max_position_embeddings=8192, rope_interleave=True)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.5 / p.shape[1] ** 0.5)
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
    second of two calls (the first compiles where transformers compiles)."""
    t1 = [timed_generate(model, ids, mask, 1, **kw)[0] for _ in range(2)][-1]
    tn, toks = [timed_generate(model, ids, mask, new, **kw) for _ in range(2)][-1]
    return ids.shape[0] * (new - 1) / max(tn - t1, 1e-9), toks


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--new", type=int, default=64)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("hf_generate: needs a CUDA GPU")
    model = build(a.layers)
    print(f"DeepSeek-V3 attention x {a.layers} layers, bf16, prompt {a.prompt}, {a.new} new tokens, greedy")
    print(f"{'B':>4} {'transformers tok/s':>19} {'cache':>8} {'mla eager tok/s':>16} {'speed-up':>9} "
          f"{'mla graphs tok/s':>17} {'speed-up':>9} {'same tokens':>12} {'graphs = eager':>15}")
    for B in a.batch:
        g = torch.Generator(device="cuda").manual_seed(B)
        ids = torch.randint(0, model.config.vocab_size, (B, a.prompt), device="cuda", generator=g)
        mask = torch.ones_like(ids)
        try:
            hf_rate, hf_toks = decode_rate(model, ids, mask, a.new, cache_implementation="static")
            kind = "static"
        except Exception as e:   # a transformers version whose static cache refuses MLA's head dims
            print(f"  static cache refused ({type(e).__name__}: {str(e)[:80]}); dynamic cache instead")
            hf_rate, hf_toks = decode_rate(model, ids, mask, a.new)
            kind = "dynamic"
        blocks = B * ((a.prompt + a.new) // 64 + 2)
        with mla.hf.patch(model, num_blocks=blocks, block_size=64, graphs=False):
            mla_rate, mla_toks = decode_rate(model, ids, mask, a.new)
        with mla.hf.patch(model, num_blocks=blocks, block_size=64, graphs=True):
            graph_rate, graph_toks = decode_rate(model, ids, mask, a.new)
        # the graphs' block tables are as wide as the pool: other split counts than eager's, the
        # same sums in another order, so bf16 greedy paths may part late
        same = (hf_toks == mla_toks).float().mean().item()
        same_g = (graph_toks == mla_toks).float().mean().item()
        print(f"{B:>4} {hf_rate:>19.1f} {kind:>8} {mla_rate:>16.1f} {mla_rate / hf_rate:>8.2f}x {graph_rate:>17.1f} "
              f"{graph_rate / hf_rate:>8.2f}x {same:>12.3f} {same_g:>15.3f}", flush=True)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
