"""One streamed request to an OpenAI-compatible server, timed from the client's side.

``send`` posts a completions or chat request with ``stream: true`` and
``stream_options.include_usage``, reads the Server-Sent Events as they arrive, and fills a
``RequestRecord``: the first chunk that carries text is TTFT, the gaps between text chunks are
the ITLs, the usage chunk gives the token counts (without one, text chunks are counted).

The HTTP client is aiohttp (as vLLM's ``bench serve``): its parser is compiled, so a streamed
chunk costs the client 23-35 us of CPU where httpx took 70-80 (2 vCPUs of a Zen 5 EPYC, beside
the server): a load generator on the server's own cores takes that CPU from the server it measures.

Invariants:
- A request's failure is its record's ``error`` (an HTTP status with the server's message, an
  SSE error event, a stream cut short), never an exception: one failed request never ends a run.
- The one exception is ``ServerGone``: nothing answers at the server's address any more
  (connection refused or reset on connect), which ends the run with its records kept.
"""

from __future__ import annotations

import json
import time

import aiohttp

from .records import RequestRecord
from .schedule import Planned

# Connecting to a live server is quick even under load; reading waits as long as generation takes.
TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=30.0)


class ServerGone(Exception):
    """Nothing answers at the server's address (refused or reset before any response)."""


def new_session() -> aiohttp.ClientSession:
    """The run's HTTP session. No pool limit: an open loop must never queue a request behind a
    connection pool."""
    return aiohttp.ClientSession(timeout=TIMEOUT, connector=aiohttp.TCPConnector(limit=0))


def auth_headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def body(p: Planned, model: str, chat: bool) -> dict:
    """The request body: greedy, exactly ``output_len`` tokens (``ignore_eos``, vLLM's extra
    field, which servers that lack it ignore), streamed with a final usage chunk."""
    b = {"model": model, "max_tokens": p.output_len, "temperature": 0.0, "ignore_eos": True, "stream": True,
         "stream_options": {"include_usage": True}}
    if chat:
        return b | {"messages": p.messages, "max_completion_tokens": p.output_len}
    return b | {"prompt": p.prompt}


def _chunk_text(chunk: dict) -> str:
    out = []
    for c in chunk.get("choices") or ():
        out.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
    return "".join(out)


def _error_message(status: int, text: str) -> str:
    try:
        err = json.loads(text).get("error")
        msg = err.get("message") if isinstance(err, dict) else err
    except (ValueError, AttributeError):
        msg = None
    msg = msg or text.strip()[:200] or "no body"
    return f"HTTP {status}: {msg}"


# Nothing listens at the address (refused, unreachable, or the connect timed out).
CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)


async def send(client: aiohttp.ClientSession, url: str, headers: dict, payload: dict, rec: RequestRecord,
               t0: float) -> None:
    """Send one request and fill ``rec`` (times relative to ``t0``, a ``perf_counter`` reading)."""
    start = time.perf_counter()
    rec.sent_s = start - t0
    try:
        async with client.post(url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                rec.error = _error_message(resp.status, (await resp.read()).decode("utf-8", "replace"))
                return
            await _read_stream(resp, rec, start)
    except CONNECT_ERRORS as e:
        rec.error = f"cannot connect: {_describe(e)}"
        raise ServerGone(_describe(e)) from e
    except aiohttp.ClientError as e:
        rec.error = f"stream cut short: {type(e).__name__}: {e}".rstrip(": ")
    except ValueError as e:  # a line past aiohttp's limit (128 KiB)
        rec.error = f"unreadable stream: {e}"


def _describe(e: Exception) -> str:
    """Why nothing answered, in a few words ("connection refused at 127.0.0.1:8000")."""
    if isinstance(e, aiohttp.ClientConnectorError):
        why = "connection refused" if isinstance(e.os_error, ConnectionRefusedError) else e.strerror
        return f"{why} at {e.host}:{e.port}"
    if isinstance(e, aiohttp.ConnectionTimeoutError):
        return f"no answer to connect within {TIMEOUT.sock_connect:g} s"
    return str(e) or type(e).__name__


async def _read_stream(resp: aiohttp.ClientResponse, rec: RequestRecord, start: float) -> None:
    last = None
    chunks = 0
    done = False
    async for raw in resp.content:  # one line at a time, as they arrive
        if not raw.startswith(b"data:"):
            continue
        data = raw[5:].strip()
        if data == b"[DONE]":
            done = True
            break
        now = time.perf_counter()
        try:
            chunk = json.loads(data)
        except ValueError:
            rec.error = f"not a JSON event: {data[:80].decode('utf-8', 'replace')!r}"
            return
        if "error" in chunk:
            err = chunk["error"]
            rec.error = "error event: " + str(err.get("message") if isinstance(err, dict) else err)
            return
        if _chunk_text(chunk):
            chunks += 1
            if last is None:
                rec.ttft_s = now - start
            else:
                rec.itl_s.append(now - last)
            last = now
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            rec.prompt_tokens = usage.get("prompt_tokens", rec.prompt_tokens)
            rec.output_tokens = usage.get("completion_tokens") or 0
    if not done:
        rec.error = "stream ended without [DONE]"
        return
    rec.latency_s = time.perf_counter() - start
    if not rec.output_tokens:
        rec.output_tokens = chunks
    if rec.ttft_s is not None and rec.output_tokens > 1:
        rec.tpot_s = (rec.latency_s - rec.ttft_s) / (rec.output_tokens - 1)


async def get_text(client: aiohttp.ClientSession, url: str, headers: dict) -> tuple[int, str]:
    """``GET url``: its status and body; ``ServerGone`` when nothing answers at the address,
    ``aiohttp.ClientError`` for any other failure."""
    try:
        async with client.get(url, headers=headers) as r:
            return r.status, (await r.read()).decode("utf-8", "replace")
    except CONNECT_ERRORS as e:
        raise ServerGone(_describe(e)) from e


async def first_model(client: aiohttp.ClientSession, base_url: str, headers: dict) -> str:
    """The first model ``GET /models`` lists (what the server serves); ``ServerGone`` if nothing
    answers, ``LookupError`` with one sentence if the answer is not a model list."""
    try:
        status, text = await get_text(client, base_url.rstrip("/") + "/models", headers)
    except aiohttp.ClientError as e:
        raise LookupError(f"GET {base_url}/models failed ({type(e).__name__}: {e})") from e
    if status != 200:
        raise LookupError(f"GET {base_url}/models answered {_error_message(status, text)}")
    try:
        return json.loads(text)["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise LookupError(f"GET {base_url}/models did not answer an OpenAI model list; pass --model")


async def reachable(client: aiohttp.ClientSession, base_url: str, headers: dict) -> bool:
    """Whether anything still answers at the server's address (any HTTP status counts)."""
    try:
        await get_text(client, base_url.rstrip("/") + "/models", headers)
        return True
    except (ServerGone, aiohttp.ClientError):
        return False
