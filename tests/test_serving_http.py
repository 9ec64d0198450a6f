"""``mla serve``: transformers' OpenAI-compatible server over a patched tiny DeepSeek-V3 on the
latent cache, started in a subprocess as a user starts it, and spoken to over HTTP.

The model (tests/test_hf_patch.py's tiny float32 DeepSeek-V3, vocabulary 32) is saved with a
word-level tokenizer and a chat template built offline. Every answer must be the text of the
unpatched model's own greedy ``generate`` of the templated prompt (float32 on CPU: the same
tokens); the refusals must be clear 4xx, a client that leaves mid-stream must not stop the
server, and the server must keep answering the others.
"""
from __future__ import annotations

import asyncio
import json
import os
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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_mla"))
    model, tok = save_model(path)
    port = free_port()
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "mla", "serve", path, "--port", str(port), "--host", "127.0.0.1",
                             "--device", "cpu", "--cb-block-size", "4", "--cb-num-blocks", "48",
                             "--cb-max-batch-tokens", "32"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"mla serve did not start:\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.5)
    yield url, path, model, tok
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


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
