"""The peer of ``mla bench layer``'s decode step: transformers' own DeepSeek-V3 attention, one
decode step of it as a user of transformers runs it (transformers imported here only).

- The module: ``DeepseekV3Attention`` of a ``DeepseekV3Config`` holding the MLAConfig's
  attention fields (``hf_config``, checked: ``MLAConfig.from_hf`` of it gives the config
  back), sdpa attention, the mla layer's random weights (the same HF-named state dict), bf16.
- The cache: a ``StaticCache`` with ``max_cache_len`` = the context, holding the same latent
  rows as mla's cache, written into its tensors directly instead of by a prefill.
  transformers caches the latents too (keys = c_kv [B, 1, L, r], values = rope(k_pe)
  [B, 1, L, dr]); its interleaved RoPE leaves a rotated pair's halves apart (the evens, then
  the odds), so an interleaved config's k_pe is laid out that way (``hf_k_pe``).
- One step: one new token a sequence at position L - 1. The position embeddings
  (``DeepseekV3RotaryEmbedding``) and the mask (``create_causal_mask``: a [B, 1, 1, L]
  boolean mask, which a static cache keeps at decode) are made once outside the timed call,
  as ``DeepseekV3Model`` makes them once for all its layers. The cache's write position is set
  back to L - 1 before each call (a one-element fill, inside the timed call), so every call
  writes the same slot, as mla's timed steps do.
- Compiled: ``torch.compile(module, mode="reduce-overhead", dynamic=True)``:
  ``CompileConfig``'s mode, the one transformers compiles a static cache's decode with (CUDA
  graphs through cudagraph trees), with dynamic shapes as its docstring shows, so that the
  grid's shapes share one compilation. Recompiling past torch's limit raises here rather than
  falling back to eager, and a compilation whose CUDA graphs torch skipped says so
  (``cudagraphs`` "skipped" in its row).

The module does not absorb: each step expands the whole cache through kv_b_proj, so its
temporaries grow with B x L x H (``step_bytes``).
"""
from __future__ import annotations

import time

import torch

__all__ = ["hf_config", "attention", "hf_k_pe", "step_bytes", "StaticStep", "compiled", "time_peer"]

# the peer against mla's eager step on the same weights and cache rows, and compiled against
# eager: bf16 both sides, absorbed against expanded (5.8e-3 measured on CPU, tiny config)
TOL = 3e-2


def hf_config(cfg):
    """A transformers DeepseekV3Config with cfg's attention (sdpa) and one layer; its MoE fields,
    which the attention never reads, small."""
    import mla
    from transformers import DeepseekV3Config

    rope = None
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope = dict(type="yarn", factor=s.factor, original_max_position_embeddings=s.original_max_position_embeddings,
                    beta_fast=s.beta_fast, beta_slow=s.beta_slow)
        rope.update({k: getattr(s, k) for k in ("mscale", "mscale_all_dim") if getattr(s, k) is not None})
    hf = DeepseekV3Config(
        hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
        q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.rope_theta, rope_scaling=rope,
        rope_interleave=cfg.rope_interleave, attention_bias=cfg.attention_bias, num_hidden_layers=1,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1)
    hf._attn_implementation = "sdpa"
    if mla.MLAConfig.from_hf(hf) != cfg:
        raise ValueError(f"cfg: transformers' DeepseekV3Config does not hold {cfg.name!r}'s attention (from_hf of "
                         "it differs)")
    return hf


def attention(cfg, sd, device="cuda", dtype=torch.bfloat16):
    """(DeepseekV3Attention with the HF-named weights sd, its config), in dtype on device."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    hf = hf_config(cfg)
    with torch.device(device):     # the initial weights are made where they land (not on the host)
        module = DeepseekV3Attention(hf, layer_idx=0)
    module = module.to(dtype).eval().requires_grad_(False)
    module.load_state_dict({k: v.to(device, dtype) for k, v in sd.items()})   # strict: the same names
    return module, hf


def hf_k_pe(k_pe: torch.Tensor, interleave: bool) -> torch.Tensor:
    """mla's cached rope(k_pe) [..., dr] in the layout transformers caches: its interleaved
    rotation writes each pair's first elements, then their second ones."""
    return torch.cat((k_pe[..., 0::2], k_pe[..., 1::2]), -1) if interleave else k_pe


def step_bytes(cfg, B: int, L: int) -> int:
    """The peer's device bytes for one step over L tokens: its StaticCache, and the
    temporaries of expanding every cached row (kv_b_proj's output [B, L, H, dn + dv], the keys
    [B, H, L, dn + dr], a contiguous copy of the values SDPA may take [B, H, L, dv]), bf16."""
    H, dn, dr, dv = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    return 2 * B * L * (cfg.kv_lora_rank + dr) + 2 * B * L * H * ((dn + dv) + (dn + dr) + dv)


class StaticStep:
    """One decode step of B sequences of L tokens (the last one new) on a StaticCache that holds
    ``latents`` [B, L - 1, r + dr] (mla's cache rows: c_kv, then rope(k_pe)) as tokens 0 .. L - 2."""

    def __init__(self, hf, x: torch.Tensor, latents: torch.Tensor, interleave: bool):
        from transformers import StaticCache
        from transformers.masking_utils import create_causal_mask
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

        B, n, _ = latents.shape
        r, self.L = hf.kv_lora_rank, n + 1
        self.cache = StaticCache(config=hf, max_cache_len=self.L)
        layer = self.cache.layers[0]
        # the latents' shapes allocate the layer's tensors, as its first update would
        layer.lazy_initialization(latents[:, None, :1, :r], latents[:, None, :1, r:])
        layer.keys[:, 0, :n] = latents[..., :r]
        layer.values[:, 0, :n] = hf_k_pe(latents[..., r:], interleave)
        self.position = layer.cumulative_length
        self.position.fill_(n)
        self.x = x.view(B, 1, -1)
        pos = torch.full((B, 1), n, dtype=torch.long, device=x.device)
        rotary = DeepseekV3RotaryEmbedding(hf).to(x.device)
        with torch.no_grad():
            self.position_embeddings = rotary(self.x, pos)
            self.mask = create_causal_mask(config=hf, inputs_embeds=self.x, attention_mask=None,
                                           past_key_values=self.cache, position_ids=pos)
        if self.mask is not None and (tuple(self.mask.shape) != (B, 1, 1, self.L) or not bool(self.mask.all())):
            raise RuntimeError(f"transformers' mask for the step: expected None or [{B}, 1, 1, {self.L}] all True, got "
                               f"{tuple(self.mask.shape)} with {int((~self.mask.bool()).sum())} masked")

    @torch.no_grad()
    def __call__(self, module, graphed: bool = False) -> torch.Tensor:
        """module's output [B, 1, D] for the step (a compiled module's may be its graph's static
        output: clone it to keep it past the next call)."""
        self.position.fill_(self.L - 1)
        if graphed:
            torch.compiler.cudagraph_mark_step_begin()
        out = module(self.x, position_embeddings=self.position_embeddings, attention_mask=self.mask,
                     past_key_values=self.cache)[0]
        if tuple(out.shape) != tuple(self.x.shape):
            raise RuntimeError(f"transformers' attention: expected output {tuple(self.x.shape)}, got "
                               f"{tuple(out.shape)}")
        return out


def compiled(module):
    """module under torch.compile as transformers compiles a static cache's decode (module
    docstring), with a recompilation past torch's limit raising rather than running eagerly."""
    dynamo = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):     # the newer name, then the older
        if hasattr(dynamo, name):
            setattr(dynamo, name, max(getattr(dynamo, name), 64))
            break
    if hasattr(dynamo, "fail_on_recompile_limit_hit"):
        dynamo.fail_on_recompile_limit_hit = True
    return torch.compile(module, mode="reduce-overhead", dynamic=True)


def time_peer(module, fast, step: StaticStep, ref: torch.Tensor | None) -> dict:
    """The peer's row: eager_us (the module), graph_us (``fast``, its compiled form; None: not
    timed), compile_s (the compiled form's first three calls: compilation and CUDA-graph
    recording), cudagraphs ("yes", or "skipped" where torch ran it without them), rel_err
    against ``ref`` (mla's eager output [B, D] on the same weights and rows; None: not
    checked). Raises RuntimeError when a check fails: no time of a step that differs."""
    from .decode_providers import rel_err
    from .timing import eager_time_us

    out = step(module).float().view(step.x.shape[0], -1)
    row = {}
    if ref is not None:
        row["rel_err"] = err = rel_err(out, ref.float())
        if not err <= TOL:
            raise RuntimeError(f"transformers' step is {err:.3g} off mla's eager step (expected <= {TOL})")
    row["eager_us"] = eager_time_us(lambda: step(module))
    if fast is None:
        return row
    from torch._dynamo.utils import counters

    torch.cuda.empty_cache()        # the eager temporaries: the compiled form's graphs take their own
    skips = counters["inductor"]["cudagraph_skips"]
    t0 = time.perf_counter()
    for _ in range(3):              # cudagraph trees: a warm-up run, the recording, a replay
        got = step(fast, graphed=True).float().view_as(out)
    torch.cuda.synchronize()
    row["compile_s"] = time.perf_counter() - t0
    err = rel_err(got, out)
    if not err <= TOL:
        raise RuntimeError(f"transformers' compiled step is {err:.3g} off its eager step (expected <= {TOL})")
    row["graph_us"] = eager_time_us(lambda: step(fast, graphed=True))
    row["cudagraphs"] = "skipped" if counters["inductor"]["cudagraph_skips"] > skips else "yes"
    return row
