"""``mla serve``: transformers' OpenAI-compatible server over a patched tiny DeepSeek-V3 on the
latent cache, started in a subprocess as a user starts it, and spoken to over HTTP.

The model (tests/test_hf_patch.py's tiny float32 DeepSeek-V3, vocabulary 32) is saved with a
word-level tokenizer and a chat template built offline. Every answer must be the text of the
unpatched model's own greedy ``generate`` of the templated prompt (float32 on CPU: the same
tokens); the refusals must be clear 4xx, a client that leaves mid-stream must not stop the
server, and the server must keep answering the others.

Then what serving users and benchmark clients expect: usage equal to the token counts (streamed
with include_usage too), the payloads of vLLM's and SGLang's benchmarks, /metrics that parses
and counts, a disconnect that frees every block, and a second server with FP8 latent rows,
--max-model-len and the periodic log line; options the model cannot take end ``mla serve`` at
start, naming the flag.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest
import torch

from test_hf_patch import make_model

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

SPECIAL = ["<pad>", "<eos>", "user", "assistant", ":", "|"]
WORDS = [f"w{i}" for i in range(32 - len(SPECIAL))]
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} | {% endfor %}"
            "{% if add_generation_prompt %}assistant :{% endif %}")
SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def save_model(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")     # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.chat_template = TEMPLATE
    model = make_model("deepseek_v3", seed=2)
    model.generation_config.eos_token_id = vocab["<eos>"]
    model.generation_config.pad_token_id = vocab["<pad>"]
    model.generation_config.do_sample = True          # temperature 0 in a request makes it greedy
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return model, fast


def expected(model, tok, messages, max_tokens, stop=None):
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    text = tok.decode(out[0, len(ids):], skip_special_tokens=True)
    return text if stop is None or stop not in text else text[:text.index(stop)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(path, log, *extra):
    """``mla serve path`` on a free port of 127.0.0.1 (its output in the file ``log``), once
    /health answers 200; (process, url)."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mla", "serve", path, "--port", str(port), "--host",
                                 "127.0.0.1", "--device", "cpu", "--cb-block-size", "4", "--cb-num-blocks", "48",
                                 "--cb-max-batch-tokens", "32", *extra], env=env, stdout=out,
                                stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"mla serve did not start:\n{open(log).read()[-3000:]}")
        time.sleep(0.3)


def stop(proc):
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_mla"))
    model, tok = save_model(path)
    proc, url = start(path, os.path.join(path, "serve.log"))
    yield url, path, model, tok
    stop(proc)


def ask(n: int):
    g = torch.Generator().manual_seed(n)
    words = [WORDS[i] for i in torch.randint(0, len(WORDS), (3 + n % 5,), generator=g)]
    return [{"role": "user", "content": " ".join(words)}]


async def chat(client, url, model, messages, max_tokens, stream, **extra):
    body = dict(model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=stream, **extra)
    if not stream:
        r = await client.post(url + "/v1/chat/completions", json=body, timeout=120)
        r.raise_for_status()
        return r.json()["choices"][0]["message"]["content"]
    text = ""
    async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text += chunk["choices"][0]["delta"].get("content") or ""
    return text


def test_concurrent_answers_are_generate(server):
    """Ten concurrent requests, half streamed, of 3-12 new tokens, one with a stop string: each
    answer is the text of generate's greedy tokens; /v1/models lists the model."""
    url, path, model, tok = server
    asks = [(ask(i), 3 + i) for i in range(10)]
    full = expected(model, tok, asks[9][0], asks[9][1])
    words = full.split()
    at = next(i for i in range(2, len(words)) if words[i] not in " ".join(words[:i]))
    stop = words[at]
    want = [expected(model, tok, m, k, stop=stop if i == 9 else None) for i, (m, k) in enumerate(asks)]

    async def run():
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*[
                chat(client, url, path, m, k, stream=i % 2 == 1, **({"stop": [stop]} if i == 9 else {}))
                for i, (m, k) in enumerate(asks)])
    got = asyncio.run(run())
    assert [g.strip() for g in got] == [w.strip() for w in want]
    assert len(set(want)) == len(want) and all(len(w.split()) >= 2 for w in want), want
    assert want[9].split() == words[:at]
    models = httpx.get(url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [path]


def test_openai_client(server):
    openai = pytest.importorskip("openai")
    url, path, model, tok = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    r = client.chat.completions.create(model=path, messages=ask(3), max_tokens=6, temperature=0)
    assert r.choices[0].message.content.strip() == expected(model, tok, ask(3), 6).strip()


def test_refusals_and_disconnect_keep_serving(server):
    """A malformed body and a body without messages: 422; an unknown model: 400; a prompt that
    can never fit the cache: 400; a client that leaves mid-stream: the server serves on."""
    url, path, model, tok = server
    post = lambda body, **kw: httpx.post(url + "/v1/chat/completions", timeout=60, **kw, **(
        {"json": body} if body is not None else {}))
    r = post(None, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert post({"model": path, "max_tokens": 4}).status_code == 422
    r = post({"model": "another/model", "messages": ask(1), "max_tokens": 4})
    assert r.status_code == 400 and "pinned" in r.text
    r = post({"model": path, "messages": ask(1), "max_tokens": 60, "temperature": 0})
    assert r.status_code == 400 and "max_position_embeddings" in r.text
    r = post({"model": path, "messages": ask(1), "max_tokens": 60, "temperature": 0, "stream": True})
    assert r.status_code == 400
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60, json={
            "model": path, "messages": ask(2), "max_tokens": 40, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        next(r.iter_lines())          # the first chunk, then the client leaves
    async def after():
        async with httpx.AsyncClient() as client:
            return await chat(client, url, path, ask(4), 7, stream=True)
    assert asyncio.run(after()).strip() == expected(model, tok, ask(4), 7).strip()
    assert httpx.get(url + "/health").status_code == 200


# ---- what serving users and benchmark clients expect: usage, metrics, health, options ----------

def generated(model, tok, messages, max_tokens):
    """(prompt ids, generated ids) of the unpatched model's greedy generate, EOS included."""
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return ids, out[0, len(ids):].tolist()


def metrics(url) -> dict:
    """/metrics parsed: every line a HELP, a TYPE or a sample of a family declared before it;
    {(name, labels without model_name): value}; each histogram's buckets cumulative, +Inf = count."""
    r = httpx.get(url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    name_re = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
    sample = re.compile(rf'({name_re})(?:\{{((?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*)\}})? (\S+)')
    types, out = {}, {}
    for line in r.text.splitlines():
        if line.startswith("# HELP "):
            assert re.fullmatch(rf"# HELP {name_re} .+", line), line
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram") and name not in types, line
            types[name] = kind
        else:
            m = sample.fullmatch(line)
            assert m, line
            name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
            family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in types else name
            assert family in types and (family == name or types[family] == "histogram"), line
            pairs = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', labels))
            assert pairs.pop("model_name", None) is not None, line
            out[(name, tuple(sorted(pairs.items())))] = value
    for family in [n for n, k in types.items() if k == "histogram"]:
        buckets = [(k[1], v) for k, v in out.items() if k[0] == family + "_bucket"]
        counts = [v for _, v in buckets]
        assert buckets[-1][0] == (("le", "+Inf"),) and counts == sorted(counts), family
        bounds = [float(dict(b)["le"]) for b, _ in buckets]
        assert bounds == sorted(bounds) and counts[-1] == out[(family + "_count", ())], family
    assert {n for n, k in types.items() if k == "counter"} >= {"mla:prompt_tokens_total",
                                                               "mla:generation_tokens_total"}
    return out


def value(m: dict, name: str, **labels) -> float:
    return m[(name, tuple(sorted(labels.items())))]


def sse(url, body) -> list[str]:
    """The data lines of a streamed answer."""
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def test_usage_equals_the_tokens(server):
    """usage in a non-streamed answer and, with stream_options.include_usage, in a last chunk
    of no choices before [DONE]: the prompt's and generate's token counts. The first chunk a
    client reads carries the first token (and the role)."""
    url, path, model, tok = server
    ids, new = generated(model, tok, ask(5), 6)
    want = {"prompt_tokens": len(ids), "completion_tokens": len(new), "total_tokens": len(ids) + len(new)}
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json=dict(model=path, messages=ask(5), max_tokens=6,
                                                                       temperature=0))
    assert r.json()["usage"] == want
    body = dict(model=path, messages=ask(5), max_tokens=6, temperature=0, stream=True)
    lines = sse(url, {**body, "stream_options": {"include_usage": True}})
    chunks = [json.loads(x) for x in lines[:-1]]
    assert lines[-1] == "[DONE]" and chunks[-1]["choices"] == [] and chunks[-1]["usage"] == want
    assert chunks[-2]["choices"][0]["finish_reason"] in ("length", "stop")
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and chunks[1]["choices"][0]["delta"]["content"]
    plain = sse(url, body)                     # without include_usage: no chunk without choices
    assert plain[-1] == "[DONE]" and all(json.loads(x)["choices"] for x in plain[:-1])


def test_benchmark_clients_payloads(server):
    """vLLM's bench serve (openai-chat: content parts, max_completion_tokens, include_usage,
    ignore_eos; openai: repetition_penalty, logprobs) and SGLang's bench_serving (ignore_eos)."""
    url, path, model, tok = server
    content = [{"type": "text", "text": ask(6)[0]["content"]}]
    lines = sse(url, dict(model=path, messages=[{"role": "user", "content": content}], temperature=0.0,
                          max_completion_tokens=9, stream=True, stream_options={"include_usage": True},
                          ignore_eos=True))
    chunks = [json.loads(x) for x in lines[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 9      # no EOS ends it
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]).strip()
    r = httpx.post(url + "/v1/completions", timeout=60, json=dict(
        model=path, prompt="w1 w2 w3", temperature=0.0, repetition_penalty=1.0, max_tokens=5, logprobs=None,
        best_of=1, stream=True, ignore_eos=True, stream_options={"include_usage": True}))
    events = [x[6:] for x in r.text.splitlines() if x.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2]) == {**json.loads(events[-2]), "choices": [],
                                      "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}}
    bad = dict(model=path, messages=ask(1), max_tokens=4)
    assert httpx.post(url + "/v1/chat/completions", json={**bad, "stream_options": 3}).status_code == 422
    assert httpx.post(url + "/v1/completions", json=dict(model=path, prompt="w1", max_tokens=2,
                                                         repetition_penalty=1.3)).status_code == 400


def test_metrics_count_a_request(server):
    """/metrics parses; after a request its counters grew by its usage, its histograms by one."""
    url, path, model, tok = server
    before = metrics(url)
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json=dict(model=path, messages=ask(7), max_tokens=5,
                                                                       temperature=0)).json()
    after = metrics(url)
    grew = lambda name, **kw: value(after, name, **kw) - value(before, name, **kw)
    assert grew("mla:prompt_tokens_total") == r["usage"]["prompt_tokens"]
    assert grew("mla:generation_tokens_total") == r["usage"]["completion_tokens"]
    reason = r["choices"][0]["finish_reason"]
    assert grew("mla:request_success_total", finished_reason=reason) == 1
    for h in ("mla:time_to_first_token_seconds", "mla:e2e_request_latency_seconds"):
        assert grew(h + "_count") == 1 and grew(h + "_sum") > 0
    assert value(after, "mla:num_requests_running") == value(after, "mla:cache_blocks_used") == 0
    assert value(after, "mla:cache_blocks_free") == 48
    assert httpx.get(url + "/health").json() == {"status": "ok"}


def test_disconnect_frees_the_blocks(server):
    """A client that leaves mid-stream: its request is cancelled (counted as an abort) and every
    block of the cache is free again."""
    url, path, model, tok = server
    before = metrics(url)
    body = dict(model=path, messages=ask(2), max_tokens=45, temperature=0, stream=True, ignore_eos=True)
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60, json=body) as r:
        lines = r.iter_lines()                 # kept: closing it closes the connection
        next(line for line in lines if '"content"' in line)               # the first token
        during = metrics(url)                  # the request holds blocks while it streams; then it leaves
    assert value(during, "mla:num_requests_running") == 1 and value(during, "mla:cache_blocks_used") > 0
    deadline = time.time() + 20
    while True:
        m = metrics(url)
        done = (value(m, "mla:num_requests_running"), value(m, "mla:num_requests_waiting"),
                value(m, "mla:cache_blocks_used"), value(m, "mla:cache_blocks_free")) == (0, 0, 0, 48)
        aborted = value(m, "mla:request_success_total", finished_reason="abort") - \
            value(before, "mla:request_success_total", finished_reason="abort")
        if done and aborted == 1 or time.time() > deadline:
            break
        time.sleep(0.1)
    assert done and aborted == 1, m
    assert value(m, "mla:generation_tokens_total") - value(before, "mla:generation_tokens_total") < 45


@pytest.fixture(scope="module")
def fp8_server(server, tmp_path_factory):
    """The same model with FP8 latent rows, 40 tokens a request, a log line every second."""
    url, path, model, tok = server
    log = str(tmp_path_factory.mktemp("fp8") / "serve.log")
    proc, url = start(path, log, "--kv-cache-dtype", "fp8", "--max-model-len", "40", "--log-interval", "1")
    yield url, path, log
    stop(proc)


def test_fp8_cache_and_max_model_len(fp8_server, server):
    """--kv-cache-dtype fp8 serves; --max-model-len: prompt + max_tokens past it is a 400, a
    request without max_tokens gets what it leaves; /v1/models says it; the log line comes."""
    url, path, log = fp8_server
    model, tok = server[2], server[3]
    n = len(generated(model, tok, ask(3), 1)[0])
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json=dict(model=path, messages=ask(3), max_tokens=6,
                                                                       temperature=0, ignore_eos=True))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
    assert r.json()["choices"][0]["message"]["content"].strip()
    for stream in (False, True):
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json=dict(
            model=path, messages=ask(3), max_tokens=41 - n, temperature=0, stream=stream))
        assert r.status_code == 400 and "max_model_len=40" in r.text
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json=dict(model=path, messages=ask(3), temperature=0,
                                                                       ignore_eos=True))
    assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == 40
    assert httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"] == 40
    assert value(metrics(url), "mla:cache_blocks_used") == 0
    deadline = time.time() + 10
    while "generation throughput" not in open(log).read() and time.time() < deadline:
        time.sleep(0.2)
    line = next(x for x in open(log).read().splitlines() if "generation throughput" in x)
    assert re.search(r"prompt throughput [\d.]+ tokens/s, generation throughput [\d.]+ tokens/s, running \d+ reqs, "
                     r"waiting \d+ reqs, cache [\d.]+% of 48 blocks", line), line


def test_options_refused_at_start(server, capsys):
    """Values the model or the cache cannot take end `mla serve` before it loads, naming the flag."""
    from mla.hf.serve import main
    path = server[1]
    assert main([path, "--max-model-len", "65"]) == 2
    assert "--max-model-len" in capsys.readouterr().err
    assert main([path, "--kv-cache-dtype", "fp8_tile"]) == 2      # kv_lora_rank 32: tile rows need 128
    err = capsys.readouterr().err
    assert "--kv-cache-dtype" in err and "kv_lora_rank" in err
    with pytest.raises(SystemExit):
        main([path, "--kv-cache-dtype", "fp16"])
    assert "--kv-cache-dtype" in capsys.readouterr().err
    assert main([path, "--log-interval", "-1"]) == 2
    assert "--log-interval" in capsys.readouterr().err
    assert main([path, "--fp8-attention"]) == 2                      # a 16-bit cache
    assert "--fp8-attention" in capsys.readouterr().err
