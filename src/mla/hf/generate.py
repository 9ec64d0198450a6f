"""The patched model's ``generate`` decode loop, one step ahead of the GPU.

transformers' ``_sample`` reads ``unfinished_sequences.max()`` back every step (its deferred
check serves only Apple's devices), and prepares each step's inputs in Python (the model
kwargs, the mask, ``prepare_inputs_for_generation``): the GPU waits for both between steps.
For greedy and sampled decoding over the patch's static decode step (``DecodeStep``), this
loop runs instead, through ``generate``'s own ``custom_generate`` hook, so that every other
part of ``generate`` (the generation config, special tokens, the mask of the prompt, the logits
processors, the stopping criteria, the output) stays transformers':

- a step's token goes from the sampler to the next step on the device: its ids are the
  static step's input, the host never sees them;
- the host knows every row's length (one more a step, finished rows included: they decode
  pad tokens, as in transformers), so it packs step N+1's rows while step N runs;
- the stop decision (``unfinished_sequences`` all zero) is copied to pinned memory after each
  step and read one step later, when that step has long finished: the host waits for step
  N-1 while step N is queued, never for the step it just launched. When it reads a stop, the
  step run meanwhile is undone (its token dropped, its latent rows truncated), so ``generate``
  returns exactly what transformers' loop returns; ``max_length`` stops on the host, with no
  extra step;
- a streamer gets each step's tokens one step late, from the same pinned copies.

The processors, the sampler and the stopping criteria are transformers' own objects called in
``_sample``'s order (float32 scores, softmax then ``torch.multinomial``), so greedy and seeded
sampling give ``_sample``'s tokens. Anything else runs ``_sample`` (or the mode's own method)
unchanged: beam search, assisted decoding, ``return_dict_in_generate``, prefill chunking, a
cache passed in with tokens, more rows than the largest graph bucket, a ``max_length`` past the
table, or a patch whose decode step is off (``handle.graphs`` false on a sparse family).
"""
from __future__ import annotations

from collections import deque

import torch

__all__ = ["OneStepAhead"]


class OneStepAhead:
    """``custom_generate`` of a patched model's ``generate`` (module docstring). Called by
    transformers' ``generate`` as its decoding method; ``streamer`` reaches it as ``mla_streamer``,
    since ``generate`` keeps only a custom method's own arguments."""

    def __init__(self, handle):
        self.handle = handle

    def __call__(self, model, input_ids, logits_processor, stopping_criteria, generation_config,
                 synced_gpus: bool = False, mla_streamer=None, **model_kwargs):
        from transformers.generation.utils import GENERATION_MODES_MAPPING, GenerationMode

        mode = generation_config.get_generation_mode()
        if not self._serves(mode, GenerationMode, input_ids, generation_config, model_kwargs, synced_gpus):
            # as generate calls it: the mode's own arguments only where given
            own = {k: v for k, v in (("synced_gpus", synced_gpus), ("streamer", mla_streamer)) if v}
            method = getattr(type(model), GENERATION_MODES_MAPPING[mode])
            return method(model, input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                          generation_config=generation_config, **own, **model_kwargs)
        return self._loop(model, input_ids, logits_processor, stopping_criteria, generation_config, mla_streamer,
                          model_kwargs)

    def _serves(self, mode, modes, input_ids, gen, model_kwargs, synced_gpus) -> bool:
        handle, decode = self.handle, self.handle._decode
        cache = model_kwargs.get("past_key_values")
        return (mode in (modes.GREEDY_SEARCH, modes.SAMPLE) and decode is not None and not synced_gpus
                and not gen.return_dict_in_generate and gen.prefill_chunk_size is None
                and model_kwargs.get("use_cache", True) and cache is not None and cache.get_seq_length() == 0
                and handle.counts_lengths(cache) and input_ids.ndim == 2 and input_ids.shape[0] <= decode.max_rows
                and gen.max_length <= decode.width * decode.cache.block_size)

    def _loop(self, model, input_ids, logits_processor, stopping_criteria, gen, streamer, model_kwargs):
        handle = self.handle
        B, prompt = input_ids.shape
        pad = gen._pad_token_tensor
        has_eos = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
        ids = input_ids.new_empty(B, gen.max_length)     # the sequences, grown in place
        ids[:, :prompt] = input_ids
        unfinished = torch.ones(B, dtype=torch.long, device=input_ids.device)
        pending = _Pending(input_ids.device, B, streamer is not None)

        outputs = model._prefill(input_ids, gen, model_kwargs)
        logits, cache = outputs.logits, model_kwargs["past_key_values"]
        del outputs
        # the prefill ran through the patch's hooks: the request's sequences, one a row
        decode, seqs = handle._decode, list(handle._seq_ids)
        assert handle._past_cache is cache and handle._lengths_only and len(seqs) == B and decode is not None
        lengths = handle.cache.lengths(seqs)
        cur, steps, stopped = prompt, 0, False
        while True:
            scores = logits_processor(ids[:, :cur], logits[:, -1].to(copy=True, dtype=torch.float32))
            if gen.do_sample:
                tokens = torch.multinomial(torch.nn.functional.softmax(scores, dim=-1), num_samples=1).squeeze(1)
            else:
                tokens = torch.argmax(scores, dim=-1)
            if has_eos:
                tokens = tokens * unfinished + pad * (1 - unfinished)
            ids[:, cur] = tokens
            cur += 1
            unfinished = unfinished & ~stopping_criteria(ids[:, :cur], None)
            pending.push(unfinished, tokens)
            if cur >= gen.max_length:
                break
            # the next step goes in before the last one's stop flag is read
            logits = decode(ids[:, cur - 1:cur], seqs, lengths)
            lengths = [n + 1 for n in lengths]
            steps += 1
            if pending.stopped(streamer):      # the token before the last one ended every row
                stopped = True
                break
        pending.finish(streamer, undo=int(stopped))
        if stopped:
            # transformers' loop stops one token earlier: the last token dropped, and the rows of
            # the last two tokens (which its loop never feeds back) truncated
            cur -= 1
            for s, n in zip(seqs, lengths):
                handle.cache.truncate(s, n - 2)
            steps -= 2
            decode.invalidate()
        # transformers' Cache of the lengths, as if its loop had run the steps
        handle._columns += steps
        decode.set_lengths(cache, handle._layer_ids, B, handle._columns)
        if streamer is not None:
            streamer.end()
        return ids[:, :cur]


class _Pending:
    """Each step's stop flag (and tokens, for a streamer) copied to pinned memory, read one step
    later: a ring of two slots, the step just pushed and the one before it."""

    def __init__(self, device, B: int, tokens: bool):
        pinned = device.type == "cuda"
        self.slots = [(torch.zeros((), dtype=torch.bool, pin_memory=pinned),
                       torch.zeros(B, dtype=torch.long, pin_memory=pinned) if tokens else None,
                       torch.cuda.Event() if pinned else None) for _ in range(2)]
        self.pushed = self.read = 0

    def push(self, unfinished: torch.Tensor, tokens: torch.Tensor) -> None:
        flag, toks, event = self.slots[self.pushed % 2]   # its step was read in the last iteration
        flag.copy_(unfinished.max() == 0, non_blocking=True)
        if toks is not None:
            toks.copy_(tokens, non_blocking=True)
        if event is not None:
            event.record()
        self.pushed += 1

    def _take(self, streamer) -> bool:
        flag, toks, event = self.slots[self.read % 2]
        if event is not None:
            event.synchronize()
        if streamer is not None:
            streamer.put(toks.clone())
        self.read += 1
        return bool(flag)

    def stopped(self, streamer) -> bool:
        """Whether the step before the last one pushed finished every row (its tokens streamed)."""
        return self.pushed - self.read >= 2 and self._take(streamer)

    def finish(self, streamer, undo: int) -> None:
        """Stream the steps not read yet, but the ``undo`` last ones."""
        while self.read < self.pushed - undo:
            self._take(streamer)
