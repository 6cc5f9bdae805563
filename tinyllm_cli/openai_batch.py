"""The OpenAI Batch API format: input lines -> requests, outputs -> result lines.

Each input line is ``{"custom_id", "method": "POST", "url", "body"}`` with ``url`` one of
``/v1/completions`` (``prompt``: a string, encoded without the chat template, or a list of token
ids) or ``/v1/chat/completions`` (``messages``). Each output line is the Batch API shape
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``.

Invariants:
- A line that cannot become a request raises ``BadLine`` (code + one sentence), answered with an
  error line; ``id`` and ``request_id`` carry the input line number (``batch_req_<line>``,
  ``req_<line>``). A duplicate ``custom_id``'s error line has ``custom_id: null``, so it cannot
  overwrite the first one's answer.
- A request's id is its ``custom_id``: its seed derives from it (``engine.request.request_seed``),
  so its sample does not depend on its line number or on what else is in the batch.
- Models without a tokenizer (token-id prompts only) give ``text: null`` and add the generated
  ``token_ids`` to the choice.
- ``n`` gives ``choices`` with n entries (index 0..n-1) and usage counting every completion's
  tokens; ``logprobs`` (an integer k for /v1/completions, ``true`` with ``top_logprobs`` k for
  chat) fills each choice's ``logprobs`` in that endpoint's OpenAI shape; ``prompt_logprobs``
  (vLLM's extension) adds ``prompt_logprobs`` to each choice.
- A request cut short (``finish_reason: "error"``: the KV pool ran out, a worker failed) is an
  error line, never a 200 body that looks complete.
"""

from __future__ import annotations

import codecs
import json
import time
from dataclasses import dataclass

from .engine.request import Request, RequestOutput, SamplingParams
from .io import RequestBuilder

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
URLS = (COMPLETIONS, CHAT)
# OpenAI body keys -> SamplingParams fields (the last four are common extensions, as in vLLM).
BODY_SAMPLING = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens",
                 "temperature": "temperature", "top_p": "top_p", "seed": "seed", "stop": "stop",
                 "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                 "ignore_eos": "ignore_eos", "stop_token_ids": "stop_token_ids", "n": "n",
                 "logprobs": "logprobs", "top_logprobs": "top_logprobs", "prompt_logprobs": "prompt_logprobs",
                 # structured output: OpenAI's response_format, and vLLM's guided_* extensions
                 "response_format": "response_format", "guided_json": "json_schema", "guided_regex": "regex",
                 "guided_choice": "choice", "guided_grammar": "grammar"}
class BadLine(Exception):
    """A line that cannot become a request: answered with an error line."""

    def __init__(self, code: str, message: str, custom_id: str | None = None):
        super().__init__(message)
        self.code, self.message, self.custom_id = code, message, custom_id


@dataclass
class Job:
    n: int  # input line number
    custom_id: str
    url: str
    request: Request
    read_at: float
    due: float = 0.0


# ---- parsing ---------------------------------------------------------------------------------

def decode_line(lineno: int, raw: bytes) -> dict | None:
    """One raw input line -> a JSON object, None for a blank line; BadLine otherwise."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadLine("invalid_json", f"line {lineno} is not UTF-8 text (bad byte at offset {e.start})")
    if lineno == 1:
        text = text.removeprefix(codecs.BOM_UTF8.decode())
    if not text.strip():
        return None
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadLine("invalid_json", f"line {lineno} is not valid JSON ({e.msg} at column {e.colno})")
    if not isinstance(rec, dict):
        raise BadLine("invalid_json", f"line {lineno} is a JSON {type(rec).__name__}, not an object")
    return rec


def parse_request(lineno: int, rec: dict, builder: RequestBuilder, seen: set[str]) -> Job:
    """A Batch API record -> a Job (tokenized, with sampling params); BadLine when it is invalid.

    ``seen`` collects every custom_id met so far; a repeated one is an error (its error line has
    ``custom_id: null`` so it cannot be mistaken for the first request's answer)."""
    cid = rec.get("custom_id")
    if cid is None:
        raise BadLine("invalid_request", f"line {lineno} has no 'custom_id'")
    if not isinstance(cid, str) or not cid:
        raise BadLine("invalid_request", f"line {lineno}: 'custom_id' must be a non-empty string")
    if cid in seen:
        raise BadLine("duplicate_custom_id", f"line {lineno}: custom_id {cid!r} was already used by an "
                                             f"earlier line")
    seen.add(cid)

    def bad(message: str, code: str = "invalid_request"):
        return BadLine(code, f"line {lineno}: {message}", cid)

    method = rec.get("method", "POST")
    if not isinstance(method, str) or method.upper() != "POST":
        raise bad(f"'method' must be \"POST\", not {method!r}")
    url = rec.get("url")
    if url is None:
        raise bad("missing 'url' (use \"/v1/completions\" or \"/v1/chat/completions\")")
    if url not in URLS:
        raise bad(f"unknown url {url!r} (use \"/v1/completions\" or \"/v1/chat/completions\")", "invalid_url")
    body = rec.get("body")
    if body is None:
        raise bad("missing 'body'")
    if not isinstance(body, dict):
        raise bad("'body' must be a JSON object")
    for key, ok, why in (("best_of", lambda v: v == 1, "only best_of = 1 is supported"),
                         ("stream", lambda v: v is False, "streaming responses are not supported in a batch"),
                         ("echo", lambda v: v is False, "echo is not supported")):
        if body.get(key) is not None and not ok(body[key]):
            raise bad(f"'{key}': {why}")
    try:
        prompts, params = parse_body(url, body, builder)
        if len(prompts) != 1:
            raise ValueError("'prompt' must be a string or a list of token ids (one prompt per request)")
        (ids, prompt), = prompts
    except (ValueError, TypeError) as e:
        raise bad(str(e))
    return Job(lineno, cid, url, Request(cid, ids, params, prompt, lineno), time.perf_counter())


def parse_body(url: str, body: dict, builder: RequestBuilder) -> tuple[list[tuple[list[int], str | None]], SamplingParams]:
    """An OpenAI request body -> its prompts as (token ids, text or None) and its sampling
    params; ValueError with one sentence naming the bad field (OpenAI's names: ``max_tokens``).
    ``/v1/completions`` takes a string, a list of ids, or a list of either (several prompts);
    ``/v1/chat/completions`` takes ``messages``. Keys not listed in ``BODY_SAMPLING`` are ignored."""
    try:
        over = {field: body[key] for key, field in BODY_SAMPLING.items() if body.get(key) is not None}
        if isinstance(over.get("stop"), str):
            over["stop"] = [over["stop"]]
        if over.get("stop") and builder.tok is None:
            raise ValueError("'stop' strings need a tokenizer, and this model has none")
        params = builder.params(over)
        if url == CHAT:
            if "messages" not in body:
                raise ValueError(f"{CHAT} needs 'messages'" + (" (not 'prompt')" if "prompt" in body else ""))
            return [(builder.encode_messages(_flatten_messages(body["messages"])), None)], params
        if "prompt" not in body:
            raise ValueError(f"{COMPLETIONS} needs 'prompt'" + (" (not 'messages'; use "
                             f"{CHAT})" if "messages" in body else ""))
        prompt = body["prompt"]
        many = isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)
        return [_one_prompt(p, builder) for p in (prompt if many else [prompt])], params
    except (ValueError, TypeError) as e:
        raise ValueError(str(e).rstrip(".").replace("max_new_tokens", "max_tokens")) from e


def _one_prompt(prompt, builder: RequestBuilder) -> tuple[list[int], str | None]:
    if isinstance(prompt, str):
        return (builder.tok.encode(prompt) if builder.tok is not None else _no_tokenizer()), prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt), None
    raise ValueError("'prompt' must be a string, a list of token ids, or a list of those")


def _no_tokenizer():
    raise ValueError("this model has no tokenizer, so 'prompt' must be a list of token ids")


def _flatten_messages(messages):
    """OpenAI content parts ``[{"type": "text", "text": ...}, ...]`` -> one string; else unchanged."""
    if not isinstance(messages, list):
        return messages
    out = []
    for m in messages:
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            parts = m["content"]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in parts):
                raise ValueError("only text content parts are supported in 'messages'")
            m = m | {"content": "".join(p["text"] for p in parts)}
        out.append(m)
    return out


# ---- result lines ----------------------------------------------------------------------------

def error_line(n: int, custom_id: str | None, code: str, message: str) -> str:
    return json.dumps({"id": f"batch_req_{n}", "custom_id": custom_id, "response": None,
                       "error": {"code": code, "message": message}}, ensure_ascii=False) + "\n"


def chat_logprobs(entries: list[dict] | None) -> dict | None:
    """Our per-token entries in the chat API's shape: ``{"content": [{token, logprob, bytes,
    top_logprobs}]}``."""
    if entries is None:
        return None

    def one(e):
        tok = e["token"]
        return {"token": tok, "logprob": e["logprob"],
                "bytes": list(tok.encode("utf-8", "replace")) if tok is not None else None}
    return {"content": [one(e) | {"top_logprobs": [one(a) for a in e["top_logprobs"]]} for e in entries]}


def completion_logprobs(entries: list[dict] | None) -> dict | None:
    """Our per-token entries in the legacy completions shape: parallel ``tokens``,
    ``token_logprobs`` and ``top_logprobs`` (a {token: logprob} map per position)."""
    if entries is None:
        return None
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{a["token"]: a["logprob"] for a in e["top_logprobs"]} for e in entries]}


def choice_json(url: str, c, prompt_logprobs) -> dict:
    # OpenAI's reasons are stop / length: a cut-short constrained output is "length" there.
    reason = "length" if c.finish_reason in ("error", "constraint_unfinished") else c.finish_reason
    if url == CHAT:
        choice = {"index": c.index, "message": {"role": "assistant", "content": c.text},
                  "logprobs": chat_logprobs(c.logprobs), "finish_reason": reason}
    else:
        choice = {"index": c.index, "text": c.text, "logprobs": completion_logprobs(c.logprobs),
                  "finish_reason": reason}
    if c.text is None:  # no tokenizer: the ids are the only form of the answer
        choice["token_ids"] = c.token_ids
    if prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs
    return choice


def response_line(job: Job, out: RequestOutput, model: str) -> str:
    usage = {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": out.num_output_tokens,
             "total_tokens": len(out.prompt_token_ids) + out.num_output_tokens}
    created = int(time.time())
    choices = [choice_json(job.url, c, out.prompt_logprobs) for c in out.completions]
    if job.url == CHAT:
        body = {"id": f"chatcmpl-{job.n}", "object": "chat.completion", "created": created, "model": model,
                "choices": choices, "usage": usage}
    else:
        body = {"id": f"cmpl-{job.n}", "object": "text_completion", "created": created, "model": model,
                "choices": choices, "usage": usage}
    return json.dumps({"id": f"batch_req_{job.n}", "custom_id": job.custom_id,
                       "response": {"status_code": 200, "request_id": f"req_{job.n}", "body": body},
                       "error": None}, ensure_ascii=False) + "\n"
