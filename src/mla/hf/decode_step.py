"""The whole decode step of a patched transformers model on static buffers: one CUDA graph a
batch bucket, from the token ids to the logits (``mla.hf.patch``'s decode steps, and the pure
decode steps of transformers' continuous-batching engine, ``mla.hf.engine``).

``generate`` decodes one token a row a step. What that step needs is on the host already: the
handle knows each row's sequence, ``cache.append_tokens`` reserves each new token's slot, and
a row's block table changes only when its sequence enters a new block (or its last block is
copied on write, or the rows were reordered). So a step packs, per row, [position, slot + 1,
length, block table] into one host array, copies it to the device in one asynchronous transfer
(from a ring of pinned buffers; the token ids, on the device already, go into a static buffer
of their own), and replays the bucket's graph (``mla.StepGraph.run_packed``), whose first
kernels unpack it into the static batch and whose body is the model's own forward (embeddings, every decoder
layer with its norms and MLP / MoE, the final norm, lm_head) with the stand-ins running their
``mla.MLA`` layers on that batch. No host read-back: no ``.item()``, no mask or lengths read.

An engine's decode step is packed alike from what the engine computed (``from_tables``): each
request's cached length, and its block table from the engine's allocator, which only grows
while the request runs (a request's packed row follows it when the batch's order changes, one
gather of the rows, and gains only its new blocks); the new token's slot is the table's, as
the engine's write index has it. The engine samples from the logits of the rows it names
(``logits_to_keep``).

The step runs the model's forward with ``use_cache=False`` and a 4-D all-true mask, so that
transformers builds no mask and keeps no cache inside the graph (the stand-ins ignore both);
its rotary embedding runs at position 0 and is unused (mla derives RoPE from the batch's
positions). transformers' ``Cache`` of the request keeps only lengths: after each step every
MLA layer's keys and values become one zero-stride uint8 view [B, 1, past + 1, 1] (host
metadata, no kernel), so ``get_seq_length``, ``crop`` and beam search's reorder see the lengths
that ``generate`` expects.

The mask of a decode step is checked by construction: ``generate`` makes it from the previous
step's mask and a column of ones, and the prefill's mask was checked on the host (left padding
only). Its shape is checked each step; its values (every row's count of attended tokens equal
to its sequence's length, the new column 1, the positions where given) are checked at the next
forward that reads the host anyway (a prefill, a cropped cache): a manual decode step whose
mask disagreed raises there, naming the step.
"""
from __future__ import annotations

import numpy as np
import torch

from ..graph import DEFAULT_BUCKETS, StepGraph

__all__ = ["DecodeStep"]

POSITION, SLOT, LENGTH, TABLE = range(4)   # the packed row's columns; TABLE.. the block table
RING = 4                                   # pinned staging buffers of the rows


def _capturable_experts(model):
    """(the model's experts implementation, the one to capture instead), or None to keep it.
    transformers' ``grouped_mm`` experts call torch's grouped GEMM, whose CUDA kernel takes
    bfloat16 on compute capability 9.x and 10.x only; for anything else torch loops over the
    experts with their offsets read on the host, which a CUDA graph cannot capture. While a
    graph is captured such a model runs ``batched_mm`` (the same products, one batched GEMM over
    each token's experts, no host read); eager steps and the prefill keep its own choice."""
    if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return None
    get = getattr(model, "get_experts_implementation", None)
    if get is None:
        return None
    current = get()
    if "grouped_mm" not in current.values():
        return None
    param = next(model.parameters())
    if param.dtype == torch.bfloat16 and torch.cuda.get_device_capability(param.device)[0] in (9, 10):
        return None
    return current, {k: "batched_mm" if v == "grouped_mm" else v for k, v in current.items()}


class DecodeStep:
    """A patched model's decode steps (``generate``'s, an engine's pure decode steps) through
    one StepGraph (module docstring)."""

    def __init__(self, handle, width: int, cuda_graphs: bool, *, cache=None, buckets=DEFAULT_BUCKETS):
        """handle: the PatchHandle (its model, stand-ins and rows); width: the block table's
        width, so every decode step (graphed or eager) runs the same decode kernel and split
        count; cuda_graphs: replay the step from CUDA graphs (False: the same static step, run
        eagerly); cache: the PagedLatentCache the step runs on, default the handle's (an
        engine's ``LatentCache`` gives its own); buckets: as ``mla.StepGraph``'s."""
        self.handle, self.width = handle, width
        cache = self.cache = handle.cache if cache is None else cache
        self.graph = StepGraph(self._step, cache, max_blocks_per_seq=width, dtype=torch.int32, buckets=buckets,
                               input_shape=(TABLE + width,), cuda_graphs=cuda_graphs)
        self.max_rows = self.graph.buckets[-1]
        self._host = np.zeros((self.max_rows, TABLE + width), dtype=np.int32)   # int32: the transfer half as large
        self._host_t = torch.from_numpy(self._host)
        # pinned copies of the rows for the transfer, a ring: each is written again only after
        # the step that read it (RING steps back, long done) has run, so the copy is
        # asynchronous and the host waits for nothing
        on_gpu = cache.device.type == "cuda"
        self._staging = [torch.empty_like(self._host_t).pin_memory() for _ in range(RING)] if on_gpu else []
        self._copied = [torch.cuda.Event() for _ in range(RING)] if on_gpu else []
        self._turn = 0
        self._row_seqs: list = []         # the sequence whose table row _host holds, per row
        self._row_blocks: list[int] = []  # of an engine's tables: the blocks of each row written so far
        self._dirty = True                # rows to rebuild from the cache (after any change but a step)
        self._stub = torch.zeros(1, dtype=torch.uint8, device=cache.device)
        self._tokens = torch.zeros(self.max_rows, 1, dtype=torch.int64, device=cache.device)
        self._mask_4d = torch.ones(self.max_rows, 1, 1, 1, dtype=torch.bool, device=cache.device)
        self.pending_check = None         # (mask, positions, lengths) of the last decode step

    @property
    def cuda_graphs(self) -> bool:
        return self.graph._replay

    def invalidate(self) -> None:
        """The rows' sequences changed otherwise than by a decode step (a prefill, a reorder, a
        crop): rebuild every table row at the next step."""
        self._dirty = True

    # ---- the step, inside the graph -------------------------------------------------------

    def _step(self, x: torch.Tensor, batch):
        """step_fn of the StepGraph: unpack the rows into the static batch, run the model."""
        n = x.shape[0]
        batch.positions.copy_(x[:, POSITION])
        torch.sub(x[:, SLOT], 1, out=batch.slot_mapping)          # an all-zero row: slot -1
        batch.cache_seqlens.copy_(x[:, LENGTH])
        batch.block_table.copy_(x[:, TABLE:])
        torch.cumsum(batch.cache_seqlens, 0, out=batch.cu_seqlens_k[1:])
        h = self.handle
        experts = _capturable_experts(h.model)
        h._enter_static(batch)
        try:
            if experts is not None:
                h.model.set_experts_implementation(experts[1])
            out = h._original_forward(input_ids=self._tokens[:n], attention_mask=self._mask_4d[:n],
                                      use_cache=False, return_dict=True)
        finally:
            if experts is not None:
                h.model.set_experts_implementation(experts[0])
            h._leave_static()
        return out.logits[:, -1]

    # ---- one decode step, on the host ----------------------------------------------------

    def __call__(self, input_ids: torch.Tensor, seq_ids: list, lengths_before: list[int]):
        """The patch's step over its own cache: reserve one token a row, pack the rows, replay:
        the logits [B, 1, V]."""
        cache, bs, host = self.cache, self.cache.block_size, self._host
        B = len(seq_ids)
        slots = cache.append_tokens(seq_ids)
        if self._dirty or self._row_seqs != seq_ids:
            for b, s in enumerate(seq_ids):
                blocks = cache.blocks(s)
                host[b, TABLE:TABLE + len(blocks)] = blocks
                host[b, TABLE + len(blocks):] = 0
            self._row_seqs, self._row_blocks, self._dirty = list(seq_ids), [], False
        for b in range(B):
            p = lengths_before[b]
            block = slots[b] // bs
            if host[b, TABLE + p // bs] != block:      # a new block, or the last one copied on write
                host[b, TABLE + p // bs] = block
            host[b, POSITION] = p
            host[b, SLOT] = slots[b] + 1
            host[b, LENGTH] = p + 1
        return self._launch(input_ids, B).unsqueeze(1)

    def from_tables(self, input_ids: torch.Tensor, requests: list, tables: list) -> torch.Tensor:
        """An engine's pure decode step over blocks it owns: requests [(seq_id, cached, 1), ...]
        in the order of input_ids' B tokens, tables each one's block ids (covering cached + 1
        tokens; only ever extended while the sequence runs: ``forget`` a finished sequence,
        ``invalidate`` after anything else). Packs the rows, replays: the logits [B, V]. The
        caller checked the step fits (B at most max_rows, every sequence's cached + 1 tokens
        within width blocks)."""
        bs, host, W = self.cache.block_size, self._host, self.width
        seqs = [s for s, _, _ in requests]
        if self._dirty or self._row_seqs != seqs:
            self._arrange(seqs)
        written = self._row_blocks
        slots = []
        for b, ((_, c, _), table) in enumerate(zip(requests, tables)):
            k = len(table)
            if k != written[b] and written[b] < W:     # a new row, or the engine gave it more blocks
                k, w = min(k, W), max(written[b], 0)   # blocks allocated ahead, past the positions: unread
                host[b, TABLE + w:TABLE + k] = table[w:k]
                if written[b] < 0:
                    host[b, TABLE + k:] = 0
                written[b] = k
            slots.append(table[c // bs] * bs + c % bs + 1)
        # a column at once: one conversion each, not three scalar writes a row
        host[:len(seqs), POSITION] = [c for _, c, _ in requests]
        host[:len(seqs), SLOT] = slots
        np.add(host[:len(seqs), POSITION], 1, out=host[:len(seqs), LENGTH])
        return self._launch(input_ids, len(seqs))

    def _arrange(self, seqs: list) -> None:
        """Rows in the order of seqs: a sequence packed at another row moves there (one gather of
        the rows, not its table again); a new one is marked to be written (-1 blocks)."""
        rows = {} if self._dirty else {s: b for b, s in enumerate(self._row_seqs) if s is not None}
        src, dst, written = [], [], []
        for b, s in enumerate(seqs):
            j = rows.get(s)
            if j is None:
                written.append(-1)
            else:
                if j != b:
                    src.append(j)
                    dst.append(b)
                written.append(self._row_blocks[j])
        if src:
            self._host[dst] = self._host[src]          # the right side is gathered first
        self._row_seqs, self._row_blocks, self._dirty = list(seqs), written, False

    def forget(self, seq) -> None:
        """An engine's sequence ended: its row is never reused under its id (ids may repeat)."""
        rows = self._row_seqs
        for b, s in enumerate(rows):
            if s == seq:
                rows[b] = None

    def _launch(self, input_ids: torch.Tensor, B: int) -> torch.Tensor:
        """The B packed rows to the device in one transfer, the tokens into their buffer, and
        the bucket's replay: the logits [B, V]."""
        self._tokens[:B].copy_(input_ids.reshape(B, 1))   # rows past B keep earlier ids: padding, dropped
        if not self._staging:
            return self.graph.run_packed(self._host_t[:B], B)
        k = self._turn = (self._turn + 1) % RING
        self._copied[k].synchronize()                  # returns at once: that step ran long ago
        rows = self._staging[k][:B]
        rows.copy_(self._host_t[:B])
        out = self.graph.run_packed(rows, B)
        self._copied[k].record()
        return out

    def set_lengths(self, past_cache, layer_ids, B: int, length: int) -> None:
        """transformers' Cache: every MLA layer's keys and values a [B, 1, length, 1] view of one
        byte (no kernel), as if the stand-ins had appended their stubs."""
        view = self._stub.as_strided((B, 1, length, 1), (0, 0, 0, 0))
        layers = past_cache.layers
        for i in layer_ids:
            layers[i].keys = layers[i].values = view

    def check_pending(self) -> None:
        """The deferred check of the last decode step's mask (module docstring); at a forward
        that reads the host anyway."""
        pending, self.pending_check = self.pending_check, None
        if pending is None:
            return
        mask, positions, lengths, past = pending
        want = torch.tensor(lengths, device=mask.device)
        ok = bool((mask.sum(-1) == want).all()) and bool((mask[:, -1] != 0).all())
        if positions is not None:
            ok = ok and bool((positions[:, -1].to(want.device) == want - 1).all())
        if not ok:
            raise ValueError(f"attention_mask: the decode step at {past} past tokens had a mask (or position_ids) "
                             "other than generate's (every row attending all its tokens and the new one, at "
                             "the position after them); its outputs were computed for generate's mask")
