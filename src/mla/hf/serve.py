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
- a request the cache can never hold gets 400, a body without a list of messages 422 (each is
  a 500 in transformers' server).
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import sys
import time

__all__ = ["main", "build_app"]


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
                        cb={"block_size": args.cb_block_size, "num_blocks": args.cb_num_blocks,
                            "max_batch_tokens": args.cb_max_batch_tokens,
                            "max_memory_percent": args.cb_max_memory_percent})
    except ImportError as e:
        print(f"mla serve: {e}; install the serving extra: pip install 'mla[serve]'", file=sys.stderr)
        return 1
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def build_app(model_dir: str, *, device: str = "auto", dtype: str = "auto", graphs: bool | None = None,
              cb: dict | None = None, enable_cors: bool = False, seed: int | None = None,
              trust_remote_code: bool = False, chat_template_kwargs: dict | None = None):
    """The FastAPI app serving the patched model of ``model_dir`` (loaded now)."""
    from fastapi import HTTPException, Request
    from fastapi.responses import JSONResponse
    from transformers import ContinuousBatchingConfig
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler
    from transformers.cli.serving.model_manager import ModelManager
    from transformers.cli.serving.response import ResponseHandler
    from transformers.cli.serving.server import build_server
    from transformers.cli.serving.transcription import TranscriptionHandler
    from transformers.cli.serving.utils import CBGenerateManager, GenerationState, set_torch_seed

    import mla.hf

    if seed is not None:
        set_torch_seed(seed)

    class PatchedModels(ModelManager):
        """Loads as transformers does, then patches and enables the model."""

        def _load_model(self, *args, **kwargs):
            model = super()._load_model(*args, **kwargs)
            # the engine allocates its own latent cache; the patch's own serves plain generate only
            mla.hf.enable(mla.hf.patch(model, num_blocks=16), graphs=graphs)
            return model

        def get_gen_models(self, cache_dir=None) -> list[dict]:
            return [{"id": self.force_model, "object": "model", "created": int(time.time()), "owned_by": "mla"}]

    class Sampling(CBGenerateManager):
        """transformers' CB manager with per-request sampling and stop strings (module docstring)."""

        def init_cb(self, model, gen_config) -> None:
            if self._cb is None:
                self.vocab_size = model.config.get_text_config().vocab_size
                shared = copy.deepcopy(gen_config)
                # processors that every request's own values replace: a temperature other than 1
                # and a top-k exist only so that a request can set theirs
                shared.do_sample, shared.temperature = True, 0.5
                shared.top_k, shared.top_p = self.vocab_size, None
                super().init_cb(model, shared)
                self._cb = _WithRequestKwargs(self._cb)

        def _kwargs(self, request_id, gen_config) -> None:
            sample = gen_config.do_sample and (gen_config.temperature or 0) > 0
            top_k = min(gen_config.top_k or self.vocab_size, self.vocab_size)
            self._cb.pending[request_id] = (
                {"temperature": float(gen_config.temperature), "top_k": top_k} if sample else
                {"temperature": 1.0, "top_k": 1})

        def generate_streaming(self, model, processor, inputs, gen_config, request_id, response_parser=None):
            self._kwargs(request_id, gen_config)
            queue, streamer = super().generate_streaming(model, processor, inputs, gen_config, request_id,
                                                         response_parser=response_parser)
            stops = _stops(gen_config)
            return (_stop_stream(queue, stops, streamer) if stops else queue), streamer

        async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
            self._kwargs(request_id, gen_config)
            text, n, ids = await super().generate_non_streaming(model, processor, inputs, gen_config, request_id)
            return _cut(text, _stops(gen_config))[0], n, ids

    class State(GenerationState):
        def get_manager(self, model_id, use_cb=False):
            if use_cb and self._cb_manager is None:
                self._cb_manager, self._cb_model_id = Sampling(cb_config=self._cb_config), model_id
            return super().get_manager(model_id, use_cb)

    class Chat(ChatCompletionHandler):
        async def handle_request(self, body: dict, request_id: str):
            messages = body.get("messages")
            if not (isinstance(messages, list) and messages and all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)):
                raise HTTPException(status_code=422, detail="messages: expected a non-empty list of "
                                    "{'role': ..., 'content': ...} objects")
            return await super().handle_request(body, request_id)

    models = PatchedModels(device=device, dtype=dtype, trust_remote_code=trust_remote_code,
                           force_model=os.path.abspath(model_dir))
    config = dict(per_request_processors=True, **{k: v for k, v in (cb or {}).items() if v is not None})
    state = State(continuous_batching=True, cb_config=ContinuousBatchingConfig(**config))
    template = dict(chat_template_kwargs or {})
    app = build_server(models, Chat(model_manager=models, generation_state=state, chat_template_kwargs=template),
                       completion_handler=CompletionHandler(model_manager=models, generation_state=state),
                       response_handler=ResponseHandler(model_manager=models, generation_state=state,
                                                        chat_template_kwargs=template),
                       transcription_handler=TranscriptionHandler(models, state), generation_state=state,
                       enable_cors=enable_cors)

    @app.exception_handler(mla.hf.RequestRefused)
    async def _refused(_request: Request, exc: Exception):
        return JSONResponse({"error": str(exc)}, status_code=400)
    return app


class _WithRequestKwargs:
    """The engine's manager, with each request's sampling values added to its add_request."""

    def __init__(self, manager):
        self._manager, self.pending = manager, {}

    def add_request(self, input_ids, request_id=None, **kwargs):
        return self._manager.add_request(input_ids, request_id=request_id, **kwargs,
                                         **self.pending.pop(request_id, {}))

    def __getattr__(self, name):
        return getattr(self._manager, name)


def _stops(gen_config) -> list[str]:
    stop = gen_config.stop_strings
    return [stop] if isinstance(stop, str) else list(stop or [])


def _cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """text up to its first stop string, and whether one occurred."""
    at = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text, False) if at < 0 else (text[:at], True)


def _stop_stream(source: asyncio.Queue, stops: list[str], streamer) -> asyncio.Queue:
    """A queue of source's items that ends at the first stop string (cancelling the request);
    text that may begin a stop string is held back until it cannot."""
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
