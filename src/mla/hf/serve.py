"""``mla serve MODEL``: transformers' OpenAI-compatible server (``transformers serve`` with
continuous batching) over an MLA model preloaded from a local directory, patched
(``mla.hf.patch``) and served on the latent cache (``mla.hf.engine``).

What is transformers' own: the FastAPI app (``/v1/chat/completions`` streaming and not,
``/v1/completions``, ``/v1/responses``, ``/health``), request parsing, the chat template, the
continuous-batching manager and its streaming. What this module adds around it:

- ``ModelManager._load_model`` patches and enables the model it loads; ``/v1/models`` lists the
  one model served (transformers' lists the Hugging Face cache instead);
- per-request sampling: transformers' server builds its engine from the first request's
  generation config and passes on only ``max_tokens`` and the EOS. Here the engine samples
  with per-request processors: each request's ``temperature`` (0, or ``do_sample`` off in the
  model's generation config: greedy), and ``stop`` strings end its answer (the stream ends and
  the request is cancelled; a non-streamed answer is cut);
- a request the cache can never hold, or longer than ``max_model_len``, gets 400, a body
  without a list of messages 422 (each is a 500 in transformers' server); a request without
  ``max_tokens`` (or ``max_completion_tokens``) gets what ``max_model_len`` leaves, at most
  transformers' default;
- the latent cache's format (``kv_cache_dtype``: the model's dtype, or FP8 rows of
  ``mla.quant``), carried from the patch's cache to the engine's;
- the engine starts (and warms up) before the server listens, and ``/health`` answers 200 only
  while its loop runs;
- ``GET /metrics`` (``mla.hf.metrics``: Prometheus text) and a periodic log line;
- what benchmark clients (vLLM's ``bench serve``, SGLang's ``bench_serving``) send and read:
  ``ignore_eos``, ``max_completion_tokens``, ``stream_options.include_usage`` (a last chunk with
  no choices and the usage), ``data: [DONE]``, and the first chunk sent with the first token.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import logging
import math
import os
import sys
import time

from .metrics import CONTENT_TYPE, Metrics

__all__ = ["main", "build_app", "KV_CACHE_DTYPES"]

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_tile")    # the model's dtype; FP8 rows of one scale; FlashMLA's tile rows
log = logging.getLogger("mla.serve")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mla serve", description="Serve an MLA model with transformers' OpenAI-compatible "
                                "server on mla's latent cache (continuous batching).")
    p.add_argument("model", help="a local directory with the model's config, weights and tokenizer")
    p.add_argument("--host", default="localhost")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default="auto", help="as transformers serve: 'auto', 'cuda:0', 'cpu'")
    p.add_argument("--dtype", default="auto", help="as transformers serve: 'auto', 'bfloat16', 'float32', ...")
    p.add_argument("--cb-block-size", type=int, default=None, help="tokens a cache block (default 256)")
    p.add_argument("--cb-num-blocks", type=int, default=None, help="blocks of the cache (default: from memory)")
    p.add_argument("--cb-max-batch-tokens", type=int, default=None, help="tokens a step (default 8192)")
    p.add_argument("--cb-max-memory-percent", type=float, default=None, help="share of free memory for the cache")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the latent cache's rows: 'auto' (the model's dtype), 'fp8' (e4m3, one scale), 'fp8_tile' "
                   "(e4m3 with a scale per 128 values, RoPE part in bf16; kv_lora_rank a multiple of 128)")
    p.add_argument("--fp8-attention", action="store_true",
                   help="prompts' attention in e4m3 arithmetic (docs/fp8.md); needs --kv-cache-dtype fp8 or fp8_tile")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="tokens a request may hold, prompt + max_tokens (default: the model's max_position_embeddings)")
    p.add_argument("--log-interval", type=float, default=10.0,
                   help="seconds between log lines of throughput, requests and cache use (0: off)")
    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay decode steps from CUDA graphs (default: on a GPU, families without an indexer)")
    p.add_argument("--trust-remote-code", action="store_true", help="as transformers serve")
    p.add_argument("--chat-template-kwargs", default=None,
                   help="default JSON kwargs of apply_chat_template (requests' own override them)")
    p.add_argument("--enable-cors", action="store_true")
    p.add_argument("--log-level", default="warning")
    p.add_argument("--default-seed", type=int, default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        print(f"mla serve: model: expected a local directory with a config.json, got {args.model!r}", file=sys.stderr)
        return 2
    try:
        template_kwargs = json.loads(args.chat_template_kwargs) if args.chat_template_kwargs else {}
    except json.JSONDecodeError as e:
        template_kwargs = e
    if not isinstance(template_kwargs, dict):
        print(f"mla serve: --chat-template-kwargs: expected a JSON object, got {args.chat_template_kwargs!r}",
              file=sys.stderr)
        return 2
    try:
        import uvicorn
        app = build_app(args.model, device=args.device, dtype=args.dtype, graphs=args.graphs,
                        enable_cors=args.enable_cors, seed=args.default_seed,
                        trust_remote_code=args.trust_remote_code, chat_template_kwargs=template_kwargs,
                        kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.max_model_len,
                        log_interval=args.log_interval, fp8_attention=args.fp8_attention,
                        cb={"block_size": args.cb_block_size, "num_blocks": args.cb_num_blocks,
                            "max_batch_tokens": args.cb_max_batch_tokens,
                            "max_memory_percent": args.cb_max_memory_percent})
    except ImportError as e:
        print(f"mla serve: {e}; install the serving extra: pip install 'mla[serve]'", file=sys.stderr)
        return 1
    except ValueError as e:           # an option the model or the cache refuses, by name
        print(f"mla serve: {e}", file=sys.stderr)
        return 2
    if args.log_interval and not log.handlers:     # the log line's own handler: uvicorn's logging leaves it alone
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s mla serve: %(message)s", "%H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def build_app(model_dir: str, *, device: str = "auto", dtype: str = "auto", graphs: bool | None = None,
              cb: dict | None = None, enable_cors: bool = False, seed: int | None = None,
              trust_remote_code: bool = False, chat_template_kwargs: dict | None = None,
              kv_cache_dtype: str = "auto", max_model_len: int | None = None, log_interval: float = 0.0,
              fp8_attention: bool = False):
    """The FastAPI app serving the patched model of ``model_dir``, loaded and its engine started
    now. kv_cache_dtype: one of ``KV_CACHE_DTYPES``; fp8_attention: ``mla.hf.patch``'s (an FP8
    ``kv_cache_dtype`` only); max_model_len: tokens a request may hold
    (None: the model's ``max_position_embeddings``); log_interval: seconds between the log lines
    of logger ``mla.serve`` (0: none). Raises ValueError, naming the option, for a value the
    model or the cache refuses."""
    from fastapi import HTTPException, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from transformers import AutoConfig, ContinuousBatchingConfig
    from transformers.cli.serving.chat_completion import (UNUSED_CHAT_COMPLETION_FIELDS, ChatCompletionHandler,
                                                          TransformersCompletionCreateParamsStreaming)
    from transformers.cli.serving.completion import (UNUSED_LEGACY_COMPLETION_FIELDS, CompletionHandler,
                                                     TransformersTextCompletionCreateParams)
    from transformers.cli.serving.model_manager import ModelManager
    from transformers.cli.serving.response import ResponseHandler
    from transformers.cli.serving.server import build_server
    from transformers.cli.serving.transcription import TranscriptionHandler
    from transformers.cli.serving.utils import CBGenerateManager, GenerationState, set_torch_seed

    import mla.hf

    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype (--kv-cache-dtype): expected one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    if fp8_attention and kv_cache_dtype == "auto":
        raise ValueError("fp8_attention (--fp8-attention): needs an FP8 cache, --kv-cache-dtype fp8 or fp8_tile")
    if not (isinstance(log_interval, (int, float)) and math.isfinite(log_interval) and log_interval >= 0):
        raise ValueError(f"log_interval (--log-interval): expected seconds >= 0 (0: off), got {log_interval!r}")
    text_config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code).get_text_config()
    positions = text_config.max_position_embeddings
    if max_model_len is not None and not (isinstance(max_model_len, int) and 1 <= max_model_len <= positions):
        raise ValueError(f"max_model_len (--max-model-len): expected 1 to the model's max_position_embeddings "
                         f"({positions}), got {max_model_len!r}")
    limit = positions if max_model_len is None else max_model_len
    cache_rows = _cache_rows(kv_cache_dtype, text_config)     # refused here, before the weights load

    if seed is not None:
        set_torch_seed(seed)

    class PatchedModels(ModelManager):
        """Loads as transformers does, then patches and enables the model."""

        def _load_model(self, *args, **kwargs):
            model = super()._load_model(*args, **kwargs)
            # the engine allocates its own latent cache in this cache's row format; the patch's
            # own blocks serve plain generate only
            mla.hf.enable(mla.hf.patch(model, _patch_cache(model, cache_rows), num_blocks=16,
                                       fp8_attention=fp8_attention), graphs=graphs)
            return model

        def get_gen_models(self, cache_dir=None) -> list[dict]:
            return [{"id": self.force_model, "object": "model", "created": int(time.time()), "owned_by": "mla",
                     "max_model_len": limit}]

    class Sampling(CBGenerateManager):
        """transformers' CB manager with per-request sampling and stop strings (module docstring),
        max_model_len, and each request's metrics."""

        def init_cb(self, model, gen_config) -> None:
            if self._cb is None:
                self.vocab_size = model.config.get_text_config().vocab_size
                shared = copy.deepcopy(gen_config)
                # processors that every request's own values replace: a temperature other than 1
                # and a top-k exist only so that a request can set theirs
                shared.do_sample, shared.temperature = True, 0.5
                shared.top_k, shared.top_p = self.vocab_size, None
                super().init_cb(model, shared)
                self._cb = _Requests(self._cb)

        def _admit(self, request_id, inputs, gen_config) -> None:
            """Before the engine sees the request: its max_new_tokens (what max_model_len leaves,
            at most the default, where the request gave none), refused (RequestRefused: 400) past
            max_model_len; then its sampling values and its metrics noted."""
            n, new = len(inputs["input_ids"]), gen_config.max_new_tokens
            if new is None:
                new = max(min(default_new_tokens, limit - n), 1)
            if n + new > limit:
                whose = " (the model's max_position_embeddings)" if limit == positions else ""
                raise mla.hf.RequestRefused(f"input_ids: {n} prompt tokens + max_tokens={new} exceed the server's "
                                            f"max_model_len={limit}{whose}")
            gen_config.max_new_tokens = new
            sample = gen_config.do_sample and (gen_config.temperature or 0) > 0
            top_k = min(gen_config.top_k or self.vocab_size, self.vocab_size)
            self._cb.pending[request_id] = (
                {"temperature": float(gen_config.temperature), "top_k": top_k} if sample else
                {"temperature": 1.0, "top_k": 1})
            self._cb.stats[request_id] = metrics.request(n, new)

        def generate_streaming(self, model, processor, inputs, gen_config, request_id, response_parser=None):
            self._admit(request_id, inputs, gen_config)
            try:
                queue, streamer = super().generate_streaming(model, processor, inputs, gen_config, request_id,
                                                             response_parser=response_parser)
            except BaseException:
                self._cb.forget(request_id)         # refused when added: nothing of it stays
                raise
            stats = self._cb.stats.get(request_id)

            def ended(reason: str) -> None:         # a stop string, or the client left
                if stats is not None:
                    stats.finish(reason)
                self._cb.forget(request_id)         # the engine delivers nothing to a cancelled request
            stops = _stops(gen_config)
            queue = _stop_stream(queue, stops, streamer, lambda: ended("stop")) if stops else queue
            return queue, _Streamer(streamer, lambda: ended("abort"))

        async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
            self._admit(request_id, inputs, gen_config)
            try:
                text, n, ids = await super().generate_non_streaming(model, processor, inputs, gen_config,
                                                                    request_id)
            except asyncio.CancelledError:
                self._cb.cancel_request(request_id)
                self._cb.abort(request_id)
                raise
            except BaseException:
                self._cb.forget(request_id)         # refused when added, or failed: nothing of it stays
                raise
            return _cut(text, _stops(gen_config))[0], n, ids

    class State(GenerationState):
        def get_manager(self, model_id, use_cb=False):
            if use_cb and self._cb_manager is None:
                self._cb_manager, self._cb_model_id = Sampling(cb_config=self._cb_config), model_id
            return super().get_manager(model_id, use_cb)

        def is_cb_alive(self) -> bool:
            """/health's 200: the engine's loop runs (transformers': it has not died, or not started)."""
            engine = self.engine()
            return engine is not None and engine.is_running() and engine.background_thread_status.fatal_error is None

        def engine(self):
            return self._cb_manager._cb if self._cb_manager is not None else None

    class Served:
        """What the chat and completion handlers take beside transformers' fields (vLLM's and
        SGLang's ``ignore_eos``, ``max_completion_tokens``), and their streams' last chunks."""

        chat = False

        def _build_generation_config(self, body: dict, model_generation_config, use_cb: bool = False):
            gen = super()._build_generation_config(body, model_generation_config, use_cb=use_cb)
            tokens = body.get("max_tokens")
            tokens = body.get("max_completion_tokens") if tokens is None else tokens
            if tokens is not None:
                gen.max_new_tokens = int(tokens)
            elif body.get("generation_config") is None:
                gen.max_new_tokens = None           # Sampling._admit sets it from the prompt and max_model_len
            if body.get("ignore_eos"):
                gen.eos_token_id = -1               # the engine's "no EOS"
            return gen

        async def handle_request(self, body: dict, request_id: str):
            options = body.get("stream_options")
            if options is not None and not (isinstance(options, dict) and isinstance(
                    options.get("include_usage", False), bool)):
                raise HTTPException(status_code=422, detail=f"stream_options: expected {{'include_usage': true or "
                                    f"false}}, got {options!r}")
            if body.get("repetition_penalty") not in (None, 1, 1.0):
                raise HTTPException(status_code=400, detail=f"repetition_penalty: served at 1.0 only (no per-request "
                                    f"penalty), got {body['repetition_penalty']!r}")
            response = await super().handle_request(body, request_id)
            if isinstance(response, StreamingResponse):
                response.body_iterator = _sse_tail(response.body_iterator, hold_first=self.chat,
                                                   include_usage=bool((options or {}).get("include_usage")))
            return response

    class ChatParams(TransformersCompletionCreateParamsStreaming, total=False):
        ignore_eos: bool

    class CompletionParams(TransformersTextCompletionCreateParams, total=False):
        ignore_eos: bool
        repetition_penalty: float

    class Chat(Served, ChatCompletionHandler):
        _valid_params_class, chat = ChatParams, True
        _unused_fields = UNUSED_CHAT_COMPLETION_FIELDS - {"stream_options", "max_completion_tokens"}

        async def handle_request(self, body: dict, request_id: str):
            messages = body.get("messages")
            if not (isinstance(messages, list) and messages and all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)):
                raise HTTPException(status_code=422, detail="messages: expected a non-empty list of "
                                    "{'role': ..., 'content': ...} objects")
            return await super().handle_request(body, request_id)

    class Completion(Served, CompletionHandler):
        _valid_params_class = CompletionParams
        _unused_fields = UNUSED_LEGACY_COMPLETION_FIELDS - {"stream_options"}

    models = PatchedModels(device=device, dtype=dtype, trust_remote_code=trust_remote_code,
                           force_model=os.path.abspath(model_dir))
    config = dict(per_request_processors=True, **{k: v for k, v in (cb or {}).items() if v is not None})
    state = State(continuous_batching=True, cb_config=ContinuousBatchingConfig(**config))
    template = dict(chat_template_kwargs or {})
    chat = Chat(model_manager=models, generation_state=state, chat_template_kwargs=template)
    app = build_server(models, chat, completion_handler=Completion(model_manager=models, generation_state=state),
                       response_handler=ResponseHandler(model_manager=models, generation_state=state,
                                                        chat_template_kwargs=template),
                       transcription_handler=TranscriptionHandler(models, state), generation_state=state,
                       enable_cors=enable_cors)
    metrics = Metrics(models.force_model, load=lambda: state.engine().load() if state.engine() is not None else None)

    # the engine starts now, before the server listens: its warm-up is not a first request's
    model_id = models.process_model_name(models.force_model)
    model, _ = models.load_model_and_processor(model_id)
    shared = chat._build_generation_config({}, model.generation_config, use_cb=True)
    default_new_tokens = shared.max_new_tokens = max(model.generation_config.max_new_tokens or 0, 1024)  # transformers'
    manager = state.get_manager(model_id, use_cb=True)
    manager.init_cb(model, shared)
    if max_model_len is not None:
        try:
            state.engine().check_fits(max_model_len, 0)
        except mla.hf.RequestRefused as e:
            manager.stop()
            raise ValueError(f"max_model_len (--max-model-len): the cache cannot hold one request of {max_model_len} "
                             f"tokens ({e}); lower it, or give the cache more blocks (--cb-num-blocks, "
                             "--cb-max-memory-percent)") from None

    @app.exception_handler(mla.hf.RequestRefused)
    async def _refused(_request: Request, exc: Exception):
        return JSONResponse({"error": str(exc)}, status_code=400)

    @app.get("/metrics")
    async def _metrics():              # on the event loop, where every request's metrics change
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    if log_interval:
        app.router.lifespan_context = _logging(app.router.lifespan_context, metrics, log_interval)
    return app


def _cache_rows(kv_cache_dtype: str, text_config) -> dict | None:
    """The FP8 cache's ``PagedLatentCache`` arguments of ``kv_cache_dtype`` (None: the model's
    dtype), tried on one block of the model's config, so that a format the model cannot take is
    refused before the weights load."""
    import torch

    from .. import MLAConfig, PagedLatentCache

    if kv_cache_dtype == "auto":
        return None
    rows = dict(dtype=torch.float8_e4m3fn, fp8_scaling="tile" if kv_cache_dtype == "fp8_tile" else "tensor")
    try:
        PagedLatentCache(MLAConfig.from_hf(text_config), num_layers=1, num_blocks=1, block_size=16, **rows)
    except ValueError as e:
        raise ValueError(f"kv_cache_dtype (--kv-cache-dtype) {kv_cache_dtype!r}: {e}") from None
    return rows


def _patch_cache(model, rows: dict | None):
    """The patch's cache in the format of ``rows`` (``_cache_rows``), or None: the model's dtype."""
    from .. import PagedLatentCache
    from .patch import _is_mla_attention, patch_config

    if rows is None:
        return None
    device = next(model.parameters()).device
    return PagedLatentCache(patch_config(model), num_layers=sum(map(_is_mla_attention, model.modules())),
                            num_blocks=16, block_size=64, device=device, **rows)


def _logging(lifespan, metrics: Metrics, seconds: float):
    """The app's lifespan with a task that logs ``metrics.log_line`` every ``seconds`` while
    there is something to say."""
    async def every():
        while True:
            await asyncio.sleep(seconds)
            line = metrics.log_line()
            if line is not None:
                log.info(line)

    @contextlib.asynccontextmanager
    async def with_log(app):
        task = asyncio.get_running_loop().create_task(every())
        try:
            async with lifespan(app) as state:
                yield state
        finally:
            task.cancel()
    return with_log


class _Requests:
    """The engine's manager with each request's sampling values added to its add_request, its
    per-token times recorded, and its outputs counted in its metrics before they reach the
    handler."""

    def __init__(self, manager):
        self._manager, self.pending, self.stats = manager, {}, {}

    def add_request(self, input_ids, request_id=None, **kwargs):
        return self._manager.add_request(input_ids, request_id=request_id, record_timestamps=True, **kwargs,
                                         **self.pending.pop(request_id, {}))

    def register_result_handler(self, request_id, callback) -> None:
        stats = self.stats.get(request_id)
        if stats is None:
            return self._manager.register_result_handler(request_id, callback)

        def counted(output):
            stats.output(output)
            if output.is_finished():
                self.stats.pop(request_id, None)
            callback(output)
        self._manager.register_result_handler(request_id, counted)

    def abort(self, request_id) -> None:
        stats = self.stats.get(request_id)
        if stats is not None:
            stats.finish("abort")
        self.forget(request_id)

    def forget(self, request_id) -> None:
        """Drop what the server keeps of a request that delivers nothing more: its sampling
        values, metrics and result handler (transformers' stays registered where a request is
        refused when added, or cancelled)."""
        self.pending.pop(request_id, None)
        self.stats.pop(request_id, None)
        router = self._manager.output_router
        with router._lock:
            router.result_handlers.pop(request_id, None)

    def __getattr__(self, name):
        return getattr(self._manager, name)


class _Streamer:
    """The handler's streamer of a request: its ``cancel`` (the client left) ends the request's
    metrics as aborted before it cancels the request."""

    def __init__(self, streamer, on_cancel):
        self._streamer, self._on_cancel = streamer, on_cancel

    @property
    def total_tokens(self) -> int:
        return self._streamer.total_tokens

    def cancel(self) -> None:
        self._on_cancel()
        self._streamer.cancel()

    def __getattr__(self, name):
        return getattr(self._streamer, name)


async def _sse_tail(events, *, hold_first: bool, include_usage: bool):
    """A handler's SSE stream as clients read it: the first chunk (the chat's role, sent before
    the prompt runs) held and sent with the next, so that the first chunk a client sees comes
    with the first token (vLLM's benchmark times the first token by it); after the last chunk,
    where the request asked for it, a chunk with no choices and the usage (OpenAI's
    ``include_usage``); then ``data: [DONE]``. Closing it closes the handler's stream, which
    cancels the request."""
    held, last = "", None
    try:
        async for piece in events:
            if hold_first and last is None:
                held = last = piece
                continue
            last = piece
            yield held + piece
            held = ""
        usage = _usage_chunk(last) if include_usage and last is not None else ""
        yield held + usage + "data: [DONE]\n\n"
    finally:
        await events.aclose()


def _usage_chunk(last: str) -> str:
    """The usage chunk of a stream whose last event is ``last`` (transformers' final chunk,
    which carries the usage); "" where it carries none (the stream ended in an error)."""
    event = last.strip().rsplit("\n\n", 1)[-1]
    try:
        chunk = json.loads(event[len("data: "):]) if event.startswith("data: ") else {}
    except json.JSONDecodeError:
        return ""
    if not isinstance(chunk, dict) or not isinstance(chunk.get("usage"), dict):
        return ""
    out = {k: chunk[k] for k in ("id", "object", "created", "model") if k in chunk}
    return f"data: {json.dumps({**out, 'choices': [], 'usage': chunk['usage']}, separators=(',', ':'))}\n\n"


def _stops(gen_config) -> list[str]:
    stop = gen_config.stop_strings
    return [stop] if isinstance(stop, str) else list(stop or [])


def _cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """text up to its first stop string, and whether one occurred."""
    at = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text, False) if at < 0 else (text[:at], True)


def _stop_stream(source: asyncio.Queue, stops: list[str], streamer, on_stop) -> asyncio.Queue:
    """A queue of source's items that ends at the first stop string (cancelling the request,
    then ``on_stop()``); text that may begin a stop string is held back until it cannot."""
    out: asyncio.Queue = asyncio.Queue()
    hold = max(len(s) for s in stops) - 1

    async def forward():
        pending = ""
        while True:
            item = await source.get()
            if isinstance(item, str):
                text, stopped = _cut(pending + item, stops)
                if stopped:
                    if text:
                        out.put_nowait(text)
                    out.put_nowait(None)
                    streamer.cancel()
                    on_stop()
                    return
                pending = text[len(text) - hold:] if hold else ""
                if text[:len(text) - len(pending)]:
                    out.put_nowait(text[:len(text) - len(pending)])
                continue
            if pending:
                out.put_nowait(pending)
                pending = ""
            out.put_nowait(item)
            if item is None:
                return
    asyncio.get_running_loop().create_task(forward())
    return out
