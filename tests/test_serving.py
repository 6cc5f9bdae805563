"""``tinyllm serve`` driven by the real ``openai`` client (and raw HTTP where the client hides
what is being checked): OpenAI's shapes, streaming equal to whole answers, the engine's own
results (``generate``) as the reference, and the fault rules (refusals before any stream
bytes, aborts on disconnect, a bounded waiting room, draining on SIGTERM)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
jsonschema = pytest.importorskip("jsonschema")

from serving_util import ROOT, START_S, ServerProc  # noqa: E402

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def server():
    """The default model, as a user starts it (four sequences at once, a fixed run seed)."""
    with ServerProc("--max-num-seqs", 4, "--seed", 5, "-q") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.v1, api_key="unused", timeout=START_S, max_retries=0)


def model_of(client) -> str:
    return client.models.list().data[0].id


def joined(stream) -> tuple[dict, dict, object]:
    """A stream's text per choice index, finish reasons, and its usage chunk (if any)."""
    texts, reasons, usage = {}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            piece = c.delta.content if hasattr(c, "delta") else c.text
            texts[c.index] = texts.get(c.index, "") + (piece or "")
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


def test_models_and_health(server, client):
    assert httpx.get(server.base + "/health").status_code == 200
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]


def test_completions_streamed_equal_whole_with_stops(client):
    """Each (prompt, stop) asked whole and streamed; the pairs run four at a time, as the server's
    four sequences batch them (answers do not depend on the batch: see the concurrent test below),
    so the 24 answers take about a quarter of the steps they take one by one."""
    m = model_of(client)

    def both(prompt, stop):
        whole = client.completions.create(model=m, prompt=prompt, max_tokens=24, stop=stop)
        return whole, joined(client.completions.create(
            model=m, prompt=prompt, max_tokens=24, stop=stop, stream=True, stream_options={"include_usage": True}))

    cases = [(prompt, stop) for prompt in PROMPTS for stop in (None, ["\n"], [" the", "."])]
    with ThreadPoolExecutor(max_workers=4) as pool:
        answers = list(pool.map(lambda case: both(*case), cases))
    for (prompt, stop), (whole, (texts, reasons, usage)) in zip(cases, answers):
        assert texts[0] == whole.choices[0].text, (prompt, stop)
        assert reasons[0] == whole.choices[0].finish_reason
        assert usage.completion_tokens == whole.usage.completion_tokens
        assert usage.prompt_tokens == whole.usage.prompt_tokens
        for s in stop or ():
            assert s not in whole.choices[0].text


def test_chat_streamed_equal_whole(client):
    m = model_of(client)
    msgs = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(model=m, messages=msgs, max_tokens=32)
    texts, reasons, _ = joined(client.chat.completions.create(model=m, messages=msgs, max_tokens=32, stream=True))
    assert texts[0] == whole.choices[0].message.content and whole.choices[0].message.role == "assistant"
    assert reasons[0] == whole.choices[0].finish_reason
    assert whole.object == "chat.completion"


def test_a_stream_never_ends_inside_a_stop_string_that_completes_later(server):
    """Raw SSE: every chunk boundary is checked, not only the joined text."""
    m = "SmolLM2-135M-Instruct"
    body = {"model": m, "prompt": "Count: one, two, three, four, five,", "max_tokens": 30, "temperature": 0}
    full = httpx.post(server.v1 + "/completions", json=body, timeout=START_S).json()["choices"][0]["text"]
    # A stop string that starts after a few pieces and spans more than one token.
    stop = full[len(full) // 2:len(full) // 2 + 6]
    assert len(stop) == 6
    chunks = []
    with httpx.stream("POST", server.v1 + "/completions", json=body | {"stop": [stop], "stream": True},
                      timeout=START_S) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:])["choices"][0]["text"])
    text = "".join(chunks)
    assert text == full[:full.index(stop)]
    sent = ""
    for c in chunks:
        sent += c
        # Each chunk boundary: what was sent is a prefix of the final text, so no chunk ended in
        # the start of the stop string (the final text is cut before it).
        assert text.startswith(sent)


def test_n_and_seeds_replay(client):
    m = model_of(client)
    r = client.completions.create(model=m, prompt="Once upon a time", max_tokens=16, n=2, temperature=0.9)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text != r.choices[1].text
    assert r.usage.completion_tokens > 16  # both completions counted
    for c in r.choices:  # each choice's reported seed replays it alone
        one = client.completions.create(model=m, prompt="Once upon a time", max_tokens=16, temperature=0.9,
                                        seed=c.model_extra["seed"])
        assert one.choices[0].text == c.text
    # n = 2 with a seed: choice 0 is that seed's n = 1 answer.
    a = client.completions.create(model=m, prompt="Once upon a time", max_tokens=16, n=2, temperature=0.9, seed=11)
    b = client.completions.create(model=m, prompt="Once upon a time", max_tokens=16, temperature=0.9, seed=11)
    assert a.choices[0].text == b.choices[0].text
    texts, _, _ = joined(client.completions.create(model=m, prompt="Once upon a time", max_tokens=16, n=2,
                                                   temperature=0.9, seed=11, stream=True))
    assert texts == {0: a.choices[0].text, 1: a.choices[1].text}


def test_logprobs_shapes_and_usage(client):
    m = model_of(client)
    r = client.completions.create(model=m, prompt="The capital of France is", max_tokens=8, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and v <= 0 and max(top.values()) == pytest.approx(v)  # greedy: the best is chosen
    c = client.chat.completions.create(model=m, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                       logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens and all(len(e.top_logprobs) == 2 for e in content)


def test_echo_prompt_logprobs_equal_generate(client, tmp_path):
    """lm-evaluation-harness's loglikelihood request: echo, max_tokens 0, logprobs."""
    m = model_of(client)
    prompt = "The capital of France is Paris"
    r = client.completions.create(model=m, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    ch = r.choices[0]
    assert ch.text == prompt and r.usage.completion_tokens == 0
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"id": "x", "prompt": prompt, "max_new_tokens": 1}) + "\n")
    out = subprocess.run([sys.executable, "-m", "tinyllm_cli", "generate", "-p", str(p), "--raw", "--prompt-logprobs",
                          "1", "-q"], capture_output=True, text=True, timeout=START_S, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    ref = json.loads(out.stdout)["prompt_logprobs"]
    assert len(ch.logprobs.token_logprobs) == len(ref)
    assert ch.logprobs.token_logprobs[0] is None and ref[0] is None
    for got, want in zip(ch.logprobs.token_logprobs[1:], ref[1:]):
        assert got == pytest.approx(want["logprob"], abs=1e-5)
    assert ch.logprobs.tokens[1:] == [e["token"] for e in ref[1:]]
    assert "".join(ch.logprobs.tokens) == prompt  # the first token is named too (its logprob is None)


def test_seeded_request_equals_generate_with_that_seed(client, tmp_path):
    m = model_of(client)
    msgs = [{"role": "user", "content": "Write a short poem about the sea."}]
    r = client.chat.completions.create(model=m, messages=msgs, max_tokens=20, temperature=0.8, top_p=0.9, seed=1234)
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"id": "x", "messages": msgs, "max_new_tokens": 20, "temperature": 0.8, "top_p": 0.9,
                             "seed": 1234}) + "\n")
    out = subprocess.run([sys.executable, "-m", "tinyllm_cli", "generate", "-p", str(p), "-q"],
                         capture_output=True, text=True, timeout=START_S, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    ref = json.loads(out.stdout)
    assert r.choices[0].message.content == ref["text"]
    assert r.choices[0].model_extra["seed"] == 1234


def test_json_schema_response_format_validates(client):
    m = model_of(client)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=m, messages=[{"role": "user", "content": "Give a person as JSON."}], max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_concurrent_requests_join_one_batch_and_equal_alone(server, client):
    """Continuous batching across HTTP requests: answers given together equal answers alone."""
    m = model_of(client)
    alone = [client.completions.create(model=m, prompt=p, max_tokens=20).choices[0].text for p in PROMPTS]
    before = server.metrics()
    got = [None] * len(PROMPTS)

    def ask(i):
        got[i] = client.completions.create(model=m, prompt=PROMPTS[i], max_tokens=20).choices[0].text
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == alone
    after = server.metrics()
    assert after["vllm:request_success_total"] - before["vllm:request_success_total"] == len(PROMPTS)


# ---- refusals: 4xx before any stream bytes ----------------------------------------------------

def test_wrong_types_are_400_naming_the_field(server):
    url = server.v1 + "/completions"
    m = "SmolLM2-135M-Instruct"
    for field, value in (("temperature", "hot"), ("max_tokens", -1), ("stream", "yes"), ("n", 0), ("top_p", 2),
                         ("prompt", 5), ("logprobs", 99), ("stop", [""])):
        r = httpx.post(url, json={"model": m, "prompt": "hi", field: value}, timeout=START_S)
        assert r.status_code == 400, (field, r.text)
        err = r.json()["error"]
        assert field in err["message"] and err["type"] == "invalid_request_error", (field, err)
    r = httpx.post(url, json={"model": m, "prompt": "hi", "max_tokens": 2, "no_such_field": 1}, timeout=START_S)
    assert r.status_code == 200  # unknown fields are ignored, as OpenAI does
    r = httpx.post(url, content=b"{not json", timeout=START_S)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(url, json={"model": "gpt-4", "prompt": "hi"}, timeout=START_S)
    assert r.status_code == 404 and "gpt-4" in r.json()["error"]["message"]
    r = httpx.post(url, json={"model": m, "prompt": "hi", "presence_penalty": 0.5}, timeout=START_S)
    assert r.status_code == 400 and "presence_penalty" in r.json()["error"]["message"]


def test_a_request_that_can_never_fit_is_400_even_when_streamed(client):
    m = model_of(client)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            out = client.completions.create(model=m, prompt="hello " * 10, max_tokens=5000, stream=stream)
            list(out)
        assert "max_model_len" in str(e.value)


def test_body_over_the_limit_is_413(server):
    r = httpx.post(server.v1 + "/completions", content=b"{" + b" " * (5 << 20) + b"}",
                   headers={"content-type": "application/json"}, timeout=START_S)
    assert r.status_code == 413


# ---- a client that goes away ------------------------------------------------------------------

def test_disconnect_mid_stream_frees_blocks_and_others_are_unaffected(server, client):
    m = model_of(client)
    other_alone = client.completions.create(model=m, prompt=PROMPTS[1], max_tokens=60, extra_body={"ignore_eos": True})
    done = {}

    def other():
        done["text"] = client.completions.create(model=m, prompt=PROMPTS[1], max_tokens=60,
                                                 extra_body={"ignore_eos": True}).choices[0].text
    t = threading.Thread(target=other)
    t.start()
    body = {"model": m, "prompt": PROMPTS[0], "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.v1 + "/completions", json=body, timeout=START_S) as r:
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
            if seen >= 3:
                break  # leaving the block closes the connection mid-stream
    t.join(START_S)
    assert done["text"] == other_alone.choices[0].text
    m_after = server.wait_metric("tinyllm:kv_blocks_used", lambda v: v == 0, "returned to 0")
    assert m_after["vllm:num_requests_running"] == 0
    assert m_after["vllm:request_success_total"] >= 1


def test_metrics_use_vllm_names(server, client):
    client.completions.create(model=model_of(client), prompt="Hello", max_tokens=4)
    m = server.metrics()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "tinyllm:kv_blocks_used", "tinyllm:kv_blocks_free"):
        assert name in m, name
    assert m["vllm:generation_tokens_total"] >= 4 and m["vllm:e2e_request_latency_seconds_count"] >= 1
