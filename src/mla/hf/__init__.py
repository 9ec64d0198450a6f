"""mla.hf: mla inside transformers. A transformers model of an MLA family, patched, runs its
attention on mla's paged latent cache in ``generate``, in transformers' continuous-batching
engine and behind an OpenAI-compatible server (user guides: docs/hf.md, docs/serving.md).

The package, one concern a module, each importing only those listed before it:

- ``decode_step``: the whole model's decode step on static buffers, one CUDA graph a bucket;
- ``generate``: ``generate``'s greedy and sampled decode loop, one step ahead of the GPU;
- ``patch``: ``PatchHandle``, the stand-ins for the attention modules and the request they serve;
- ``engine_cache``: ``LatentCache``, the engine's cache on latent rows, and its admission;
- ``engine``: ``enable`` / ``Engine``, the engine's manager on that cache;
- ``metrics``: the server's Prometheus metrics (it imports nothing of mla);
- ``serve``: ``mla serve``, transformers' server over a patched, enabled model.
"""
from __future__ import annotations

import torch
from torch import nn

from ..cache import PagedLatentCache
from .engine import Engine, LatentBatchingManager, RequestRefused, attach, enable
from .patch import PatchHandle, patch_config

__all__ = ["patch", "patch_config", "PatchHandle", "enable", "Engine", "LatentBatchingManager", "RequestRefused"]


def patch(model: nn.Module, cache: PagedLatentCache | None = None, *, dtype: torch.dtype | None = None,
          backend: str = "auto", num_blocks: int = 256, block_size: int = 64,
          max_workspace_tokens: int | None = None, graphs: bool | None = None, overlap: bool = True,
          fp8_attention: bool = False) -> "PatchHandle":
    """Swap every MLA attention module of ``model`` (a transformers model of an exact MLA family,
    e.g. ``DeepseekV3ForCausalLM``) for ``mla.MLA`` on one shared ``PagedLatentCache``.

    cache: a ``PagedLatentCache`` to use, built for ``patch_config(model)`` (= ``handle.cfg``) with
        ``num_layers >= M`` (the model's M MLA modules); None creates one of ``num_blocks``
        blocks of ``block_size`` tokens.
    dtype: the layers' and the created cache's dtype; None takes the modules' parameter dtype.
    backend: as ``mla.MLA``'s ("auto" | "torch" | "triton").
    graphs: run each decode step of the whole model (embeddings to logits) as one CUDA graph a
        batch bucket (``mla.hf.decode_step``; docs/PERF.md has the figures); on CPU the same static
        step runs eagerly. None (the default): on where the cache is on a GPU, the family has no
        sparse indexer and every decoder layer is MLA; True asks for them anywhere, for a sparse
        family too (every decode step on the sparse path, the logits as wide as the table: the
        pool or the model's positions). Refused (ValueError, naming the reason) where the graph
        cannot hold the step: linear-attention layers (Kimi Linear, GLM-5.3-Flash) keep their
        state in transformers' Cache, and the k-pool indexer needs host lengths
        (``strategy.static_sparse_problem``).
    overlap: run ``generate``'s greedy and sampled decoding one step ahead of the GPU on the
        static step (``mla.hf.generate``: no host read-back between steps, the next step packed
        while the last one runs); False leaves every step to transformers' own loop.
    fp8_attention: the layers' context attention in e4m3 arithmetic (``mla.MLA``'s; docs/fp8.md);
        needs ``cache`` to hold FP8 rows.

    The model's ``init_continuous_batching`` (``generate_batch``, the engine's manager) runs on
    mla's engine from then on (``mla.hf.engine``; ``enable`` sets its options).

    Returns a ``PatchHandle``: ``handle.cache``, ``handle.layers``, ``handle.graphs``,
    ``handle.release()`` (return the current request's blocks now) and ``handle.unpatch()``
    (restore the original modules and transformers' own engine).
    Raises NotImplementedError (naming the model_type) for a family ``from_hf`` refuses, and
    ValueError for a model without MLA attention modules, an unusable cache, or ``graphs`` where
    a graph cannot serve the model.
    """
    handle = PatchHandle(model, cache, dtype=dtype, backend=backend, num_blocks=num_blocks, block_size=block_size,
                         max_workspace_tokens=max_workspace_tokens, graphs=graphs,
                         overlap=overlap, fp8_attention=fp8_attention)
    attach(handle)
    return handle
