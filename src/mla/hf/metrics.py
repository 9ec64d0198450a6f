"""Serving metrics of ``mla serve``: ``GET /metrics`` in the Prometheus text format (0.0.4) and
the periodic log line. No dependency: the format is a few lines of text a series.

Names follow vLLM's with an ``mla:`` prefix, so that its dashboards read them with the prefix
changed; every series carries the ``model_name`` label.

| series | type | what |
| --- | --- | --- |
| ``mla:num_requests_running`` | gauge | requests the engine admitted (they hold cache blocks) |
| ``mla:num_requests_waiting`` | gauge | requests queued, not admitted yet |
| ``mla:cache_blocks_used`` / ``mla:cache_blocks_free`` | gauge | the latent cache's blocks |
| ``mla:cache_usage_perc`` | gauge | used / all blocks, 0 to 1 |
| ``mla:prompt_tokens_total`` | counter | prompt tokens of requests that produced a token |
| ``mla:generation_tokens_total`` | counter | tokens generated (a streamed request's as they come, another's at its end) |
| ``mla:request_success_total{finished_reason}`` | counter | requests ended: ``stop``, ``length``, ``abort`` |
| ``mla:time_to_first_token_seconds`` | histogram | from the engine's receipt to its first token |
| ``mla:time_per_output_token_seconds`` | histogram | a request's first to last token over its tokens after the first |
| ``mla:e2e_request_latency_seconds`` | histogram | from the engine's receipt to the end |

The times are the engine's own (``GenerationOutput.created_time`` and its per-token
``timestamps``, one clock: ``time.perf_counter``); the histograms take the requests that end
with ``stop`` or ``length``. Everything here runs on the server's event loop (the engine's
outputs reach it there), so nothing needs a lock; ``load`` reads the engine's counts from
another thread, each one a single ``len``.
"""
from __future__ import annotations

import bisect
import math
import time
from typing import Callable

__all__ = ["Metrics", "RequestStats", "Histogram", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# vLLM's buckets, so that a dashboard's quantiles compare
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)
REASONS = ("stop", "length", "abort")


def _number(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    return "+Inf" if v == math.inf else "-Inf" if v == -math.inf else "NaN" if v != v else repr(float(v))


def _labels(pairs: dict[str, str]) -> str:
    # the format's escapes in a label value: backslash, double quote, newline
    esc = lambda s: str(s).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in pairs.items()) + "}" if pairs else ""


def _head(name: str, kind: str, text: str) -> list[str]:
    return [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]


class Histogram:
    """Observations counted in fixed buckets (upper bounds, ascending), as Prometheus keeps them."""

    def __init__(self, name: str, text: str, buckets: tuple[float, ...]):
        if list(buckets) != sorted(set(buckets)):
            raise ValueError(f"buckets: expected ascending distinct bounds, got {buckets}")
        self.name, self.text, self.bounds = name, text, tuple(buckets)
        self.counts = [0] * (len(buckets) + 1)     # per bucket, the last one +Inf's own
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1    # le: a value on a bound is in it
        self.sum += value
        self.count += 1

    def lines(self, labels: dict[str, str]) -> list[str]:
        out, total = _head(self.name, "histogram", self.text), 0
        for bound, n in zip(self.bounds + (math.inf,), self.counts):
            total += n                               # the format's buckets are cumulative
            out.append(f"{self.name}_bucket{_labels({**labels, 'le': _number(bound)})} {total}")
        out.append(f"{self.name}_sum{_labels(labels)} {_number(self.sum)}")
        out.append(f"{self.name}_count{_labels(labels)} {self.count}")
        return out


class Metrics:
    """One server's counters and histograms, and the engine's gauges through ``load``.

    load: returns the engine's counts now, a dict of ``running``, ``waiting``, ``blocks_used`` and
    ``num_blocks`` (``LatentBatchingManager.load``); None before the engine exists (all zero)."""

    def __init__(self, model_name: str, load: Callable[[], dict] | None = None):
        self.labels = {"model_name": model_name}
        self.load = load
        self.prompt_tokens = self.generation_tokens = 0
        self.finished = dict.fromkeys(REASONS, 0)
        self.ttft = Histogram("mla:time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS)
        self.tpot = Histogram("mla:time_per_output_token_seconds",
                              "Time per output token after the first, a request's mean, in seconds.", TPOT_BUCKETS)
        self.e2e = Histogram("mla:e2e_request_latency_seconds", "End-to-end request latency in seconds.",
                             E2E_BUCKETS)
        self._last = (time.monotonic(), 0, 0)       # the log line's previous (time, prompt, generation)

    def request(self, prompt_tokens: int, max_new_tokens: int | None) -> "RequestStats":
        return RequestStats(self, prompt_tokens, max_new_tokens)

    def engine(self) -> dict:
        load = self.load() if self.load is not None else None
        return load or dict(running=0, waiting=0, blocks_used=0, num_blocks=0)

    def render(self) -> str:
        """The exposition text: every series' HELP and TYPE, then its samples."""
        e, L = self.engine(), self.labels
        free = e["num_blocks"] - e["blocks_used"]
        gauges = [("mla:num_requests_running", "Requests running in the engine (holding cache blocks).", e["running"]),
                  ("mla:num_requests_waiting", "Requests waiting to be admitted.", e["waiting"]),
                  ("mla:cache_blocks_used", "Latent cache blocks in use.", e["blocks_used"]),
                  ("mla:cache_blocks_free", "Latent cache blocks free.", free),
                  ("mla:cache_usage_perc", "Latent cache usage, 1 means 100 percent.",
                   e["blocks_used"] / e["num_blocks"] if e["num_blocks"] else 0.0)]
        out = []
        for name, text, value in gauges:
            out += _head(name, "gauge", text) + [f"{name}{_labels(L)} {_number(value)}"]
        for name, text, value in [("mla:prompt_tokens_total", "Prompt tokens processed.", self.prompt_tokens),
                                  ("mla:generation_tokens_total", "Tokens generated.", self.generation_tokens)]:
            out += _head(name, "counter", text) + [f"{name}{_labels(L)} {value}"]
        out += _head("mla:request_success_total", "counter", "Requests ended, by finish reason.")
        out += [f"mla:request_success_total{_labels({**L, 'finished_reason': r})} {n}" for r, n in self.finished.items()]
        for h in (self.ttft, self.tpot, self.e2e):
            out += h.lines(L)
        return "\n".join(out) + "\n"

    def log_line(self) -> str | None:
        """Throughput since the previous call, the engine's requests and its cache use; None
        where nothing ran since then and nothing is in the engine (an idle server logs nothing)."""
        now, e = time.monotonic(), self.engine()
        then, prompt, generation = self._last
        dt = max(now - then, 1e-9)
        self._last = (now, self.prompt_tokens, self.generation_tokens)
        if (prompt, generation) == (self.prompt_tokens, self.generation_tokens) and not (e["running"] or e["waiting"]):
            return None
        use = 100.0 * e["blocks_used"] / e["num_blocks"] if e["num_blocks"] else 0.0
        return (f"prompt throughput {(self.prompt_tokens - prompt) / dt:.1f} tokens/s, generation throughput "
                f"{(self.generation_tokens - generation) / dt:.1f} tokens/s, running {e['running']} reqs, waiting "
                f"{e['waiting']} reqs, cache {use:.1f}% of {e['num_blocks']} blocks")


class RequestStats:
    """One request's share of the metrics: fed each engine output that reaches the server
    (``output``), ended once (``finish``: by its last output, a stop string, or an abort)."""

    def __init__(self, metrics: Metrics, prompt_tokens: int, max_new_tokens: int | None):
        self.metrics, self.prompt, self.max_new = metrics, prompt_tokens, max_new_tokens
        self.generated, self.last, self.done = 0, None, False

    def output(self, out) -> None:
        """out: a ``GenerationOutput`` of the engine (its tokens so far, its times)."""
        if self.done:
            return
        n = len(out.generated_tokens)
        if n and not self.generated:
            self.metrics.prompt_tokens += self.prompt
        if n > self.generated:
            self.metrics.generation_tokens += n - self.generated
            self.generated = n
        self.last = out
        if out.is_finished():
            length = self.max_new is not None and n >= self.max_new
            self.finish("abort" if out.error is not None else "length" if length else "stop")

    def finish(self, reason: str) -> None:
        if self.done:
            return
        self.done = True
        m = self.metrics
        m.finished[reason] += 1
        out = self.last
        if reason == "abort" or out is None:
            return
        m.e2e.observe(time.perf_counter() - out.created_time)
        stamps = out.timestamps or []
        if stamps:
            m.ttft.observe(stamps[0] - out.created_time)
        if len(stamps) > 1:
            m.tpot.observe((stamps[-1] - stamps[0]) / (len(stamps) - 1))
