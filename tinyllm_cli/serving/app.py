"""The HTTP layer of ``tinyllm serve``: OpenAI's endpoints over the async front (``front``).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` as Server-Sent
Events), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text).

Invariants:
- A request the engine can never run (bad fields, prompt + max_tokens over max_model_len or the
  whole pool) is a 4xx in OpenAI's error shape before any stream bytes; an error after a stream
  began is one SSE ``data: {"error": ...}`` event, then the stream ends. Never a 200 whose body
  hides an error.
- A client that goes away (a closed stream, or a dropped connection while it waits for a whole
  answer) aborts its request: the engine frees its blocks at the next step boundary.
- The waiting room is bounded (``max_waiting``): past it, 429 with ``Retry-After``.
- With an API key, every endpoint but ``/health`` needs ``Authorization: Bearer <key>``.
  Request bodies over ``max_body_bytes`` are 413. No endpoint reads or writes files.
- Each request's seed is its ``seed`` field, else derived from the run seed and the request's
  own id (``engine.request.request_seed``); each choice reports the seed it sampled with, so
  sending it back as ``seed`` replays that choice.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import HTTPConnection

from ..engine.request import Delta, Request, RequestOutput
from ..io import RequestBuilder
from ..version import package_version
from ..openai_batch import CHAT, COMPLETIONS, choice_json, completion_logprobs, chat_logprobs, parse_body
from .front import Closed, EngineFront, Failed, Overloaded
from .metrics import Metrics
from .stream import ChoiceStream, Piece

# OpenAI fields tinyllm does not implement: a value other than the neutral one is a 400 naming
# the field (ignoring it would silently change the answer). Other unknown fields are ignored.
UNSUPPORTED = {"best_of": (None, 1), "suffix": (None, ""), "logit_bias": (None, {}),
               "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
               "tools": (None, []), "functions": (None, []), "audio": (None,), "modalities": (None, ["text"])}
BOOL_FIELDS = ("stream", "echo", "ignore_eos")
RETRY_AFTER_S = 1


@dataclass
class ServeSettings:
    model_name: str  # what /v1/models lists and responses carry
    api_key: str | None = None
    max_waiting: int = 256
    max_body_bytes: int = 4 << 20
    run_seed: int = 0


class ClientGone(Exception):
    """The client closed its connection while waiting: its request was aborted."""


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.headers = status, message, kind, param, headers

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.status)


def error_body(message: str, kind: str, param: str | None = None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def create_app(engine, tokenizer, defaults, settings: ServeSettings, *, max_model_len: int | None = None,
               engine_thread: bool = True) -> FastAPI:
    """The app over ``engine`` (any engine contract); ``defaults``: the config's sampling
    defaults (``SamplingConfig.request_defaults()``), which request fields override.
    ``engine_thread``: run the engine loop on a thread of its own from startup; False: the
    caller runs ``app.state.front.run()`` on a thread of its choosing."""
    metrics = Metrics(settings.model_name)

    def on_step(eng) -> None:
        metrics.snapshot = eng.load()

    front = EngineFront(engine, max_waiting=settings.max_waiting, on_step=on_step, own_thread=engine_thread)
    metrics.snapshot = engine.load()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        front.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            front.close()

    app = FastAPI(title="tinyllm", version=package_version(), lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.front, app.state.metrics = front, metrics
    handler = Handler(front, metrics, tokenizer, defaults, settings)

    app.add_middleware(Guard, settings=settings)

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return _error(e)

    @app.exception_handler(ClientGone)
    async def client_gone(request, e: ClientGone):
        return Response(status_code=499)  # nobody reads it: nginx's "client closed request"

    @app.get("/health")
    async def health():
        if front.error is not None:
            return JSONResponse(error_body(front.error, "server_error"), status_code=503)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "tinyllm", "max_model_len": max_model_len}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post(COMPLETIONS)
    async def completions(request: HttpRequest):
        return await handler.serve(request, COMPLETIONS)

    @app.post(CHAT)
    async def chat(request: HttpRequest):
        return await handler.serve(request, CHAT)

    return app


class Guard:
    """The API key and the declared body size, checked before any route runs. A plain ASGI
    middleware: Starlette's ``@app.middleware("http")`` would pass every chunk of every streamed
    answer through a memory stream between two tasks."""

    def __init__(self, app, settings: ServeSettings):
        self.app, self.settings = app, settings

    async def __call__(self, scope, receive, send) -> None:
        refusal = self._refusal(HTTPConnection(scope)) if scope["type"] == "http" else None
        if refusal is not None:
            await _error(refusal)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _refusal(self, conn: HTTPConnection) -> ApiError | None:
        key, limit = self.settings.api_key, self.settings.max_body_bytes
        if key and conn.url.path != "/health" and not _authorized(conn, key):
            return ApiError(401, "a valid API key is needed: send 'Authorization: Bearer <key>'", "authentication_error")
        size = conn.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > limit:
            return _too_large(limit)
        return None


class Handler:
    """One OpenAI request: parse, submit one engine request per prompt, answer or stream."""

    def __init__(self, front: EngineFront, metrics: Metrics, tokenizer, defaults, settings: ServeSettings):
        self.front, self.metrics, self.tok, self.settings = front, metrics, tokenizer, settings
        self.builder = RequestBuilder(tokenizer, False, defaults)  # completions: raw prompts
        self.chat_builder = RequestBuilder(tokenizer, True, defaults)

    async def serve(self, http: HttpRequest, url: str):
        arrival = time.perf_counter()
        body = await self._body(http)
        call = self._parse(url, body, arrival)
        watch = Watch(self.front, self.metrics, call, self.tok)
        try:
            for r in call.requests:
                self.front.submit(r, watch.events)
        except Overloaded as e:
            for r in call.requests:
                self.front.abort(r.id)
            self.metrics.rejected.inc()
            raise ApiError(429, f"the server is busy: {e}; retry later", "rate_limit_error",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        except Closed as e:
            raise ApiError(503, f"the server takes no new requests: {e}", "server_error")
        # Wait for each request's first event before answering: a refusal is still a 4xx then.
        early, firsts = await watch.until_each_began(http)
        for first in firsts:
            if isinstance(first, RequestOutput) and first.finish_reason == "error" and not first.num_output_tokens:
                watch.abort_all()
                raise ApiError(400, first.error or "the request was refused", param=None)
            if isinstance(first, Failed):
                watch.abort_all()
                raise ApiError(500, first.error, "server_error")
        if call.stream:
            return StreamingResponse(watch.sse(early), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return JSONResponse(await watch.whole(early, http))

    async def _body(self, http: HttpRequest) -> dict:
        limit, size, chunks = self.settings.max_body_bytes, 0, []
        async for c in http.stream():
            size += len(c)
            if size > limit:
                raise _too_large(limit)
            chunks.append(c)
        try:
            body = json.loads(b"".join(chunks) or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON ({e})")
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    def _parse(self, url: str, body: dict, arrival: float) -> "Call":
        model = body.get("model")
        if model is not None and model != self.settings.model_name:
            raise ApiError(404, f"the model {model!r} does not exist here; this server serves "
                                f"{self.settings.model_name!r}", "not_found_error", "model")
        for key in BOOL_FIELDS:
            if body.get(key) is not None and not isinstance(body[key], bool):
                raise ApiError(400, f"'{key}' must be true or false", param=key)
        for key, neutral in UNSUPPORTED.items():
            if body.get(key, None) not in neutral:
                raise ApiError(400, f"'{key}' is not supported by tinyllm", param=key)
        opts = body.get("stream_options")
        if opts is not None and not (isinstance(opts, dict) and isinstance(opts.get("include_usage", False), bool)):
            raise ApiError(400, "'stream_options' must be an object like {\"include_usage\": true}", param="stream_options")
        echo = bool(body.get("echo")) and url == COMPLETIONS
        if echo and body.get("stream") and body.get("logprobs") is not None:
            raise ApiError(400, "'echo' with 'logprobs' is answered whole: send it without 'stream'", param="echo")
        body = dict(body)
        if echo and body.get("logprobs") is not None:
            body["prompt_logprobs"] = body["logprobs"]  # echoed prompt tokens carry their logprobs
        # max_tokens 0 (scoring a prompt, as lm-evaluation-harness does): one token is computed
        # and dropped, so the prompt's log-probabilities come back with no completion.
        score_only = echo and body.get("max_tokens") == 0
        if score_only:
            body["max_tokens"] = 1
        try:
            prompts, params = parse_body(url, body, self.chat_builder if url == CHAT else self.builder)
        except ValueError as e:
            raise ApiError(400, str(e), param=_field_of(str(e)))
        rid = f"{'chatcmpl' if url == CHAT else 'cmpl'}-{uuid.uuid4().hex}"
        reqs = [Request(f"{rid}-{i}" if len(prompts) > 1 else rid, ids, params, text, i, arrival=arrival,
                        stream=bool(body.get("stream")), whole=True) for i, (ids, text) in enumerate(prompts)]
        return Call(rid, url, reqs, bool(body.get("stream")), bool((opts or {}).get("include_usage")), echo,
                    score_only, self.settings.model_name, int(time.time()), self.settings.run_seed)


def _field_of(message: str) -> str | None:
    """The field a validation sentence names first (``'x' ...`` or ``x must ...``)."""
    head = message.split()[0].strip("'\"") if message else ""
    return head if head.replace("_", "").isalnum() else None


@dataclass
class Call:
    id: str
    url: str
    requests: list[Request]
    stream: bool
    include_usage: bool
    echo: bool
    score_only: bool
    model: str
    created: int
    run_seed: int

    @property
    def n(self) -> int:
        return self.requests[0].params.n

    @property
    def chat(self) -> bool:
        return self.url == CHAT


class Watch:
    """The events of one call's engine requests, turned into one answer or one stream. The
    requests share one queue (``events``): each event names its request by ``id``."""

    def __init__(self, front: EngineFront, metrics: Metrics, call: Call, tokenizer):
        self.front, self.metrics, self.call, self.tok = front, metrics, call, tokenizer
        self.events: asyncio.Queue = asyncio.Queue()
        self.index = {r.id: i for i, r in enumerate(call.requests)}
        self.open = set(self.index)
        self.first_token: dict[object, float] = {}
        self.last_token: dict[object, float] = {}
        head = json.dumps(self._head("completion.chunk" if call.chat else "text_completion"), ensure_ascii=False)
        # Every chunk is this head with one choice: rendered once, not once per token.
        self.chunk_prefix = "data: " + head[:-1] + ', "choices": ['

    async def next(self, http: HttpRequest | None) -> tuple[int, object]:
        """The call's next event and its request's index; while waiting with ``http`` given, a
        client that went away aborts the call."""
        if not self.events.empty():  # a step's events come together: no wait for most
            ev = self.events.get_nowait()
        elif http is None:
            ev = await self.events.get()
        else:
            ev = await self._wait(http)
        i = self.index[ev.id]
        self._observe(self.call.requests[i], ev)
        return i, ev

    async def _wait(self, http: HttpRequest):
        while True:
            try:
                return await asyncio.wait_for(self.events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    self.abort_all()
                    raise ClientGone()

    async def until_each_began(self, http: HttpRequest) -> tuple[list[tuple[int, object]], list]:
        """The events that come until every request has had one (in order), and each request's
        first event."""
        early, first = [], {}
        while len(first) < len(self.index):
            i, ev = await self.next(http)
            early.append((i, ev))
            first.setdefault(i, ev)
        return early, [first[i] for i in range(len(self.index))]

    async def _all(self, early: list[tuple[int, object]], http: HttpRequest | None):
        """Every event of the call, those already read first, until each request's last."""
        left = len(self.index)
        for i, ev in early:
            left -= _final(ev)
            yield i, ev
        while left:
            i, ev = await self.next(http)
            left -= _final(ev)
            yield i, ev

    def _observe(self, r: Request, ev) -> None:
        """Latency histograms, as the events arrive (vLLM's meanings)."""
        rid, now = r.id, time.perf_counter()
        if isinstance(ev, Delta):
            if rid not in self.first_token:
                self.first_token[rid] = now
                self.metrics.ttft.observe(now - r.arrival)
            elif ev.index == 0:
                self.metrics.itl.observe(now - self.last_token[rid])
            if ev.index == 0:
                self.last_token[rid] = now
            return
        self.open.discard(rid)
        if isinstance(ev, RequestOutput):
            if rid not in self.first_token and ev.ttft_s is not None:  # unstreamed: the engine's own figures
                self.metrics.ttft.observe(ev.ttft_s)
                for _ in range(ev.num_output_tokens - 1 if ev.tpot_s is not None else 0):
                    self.metrics.itl.observe(ev.tpot_s)  # its mean gap, once per gap
            self.metrics.e2e.observe(now - r.arrival)
            self.metrics.finished(ev.finish_reason)
        else:
            self.metrics.finished("error")

    def abort_all(self) -> None:
        for rid in self.index:
            if rid in self.open:
                self.front.abort(rid)
                self.metrics.finished("abort")
        self.open.clear()

    # ---- a whole answer ---------------------------------------------------------------------

    async def whole(self, early, http: HttpRequest) -> dict:
        outs: list[RequestOutput | None] = [None] * len(self.index)
        async for i, ev in self._all(early, http):
            if isinstance(ev, Failed):
                self.abort_all()
                raise ApiError(500, ev.error, "server_error")
            if isinstance(ev, RequestOutput):
                if ev.finish_reason == "error":
                    self.abort_all()
                    raise ApiError(500, f"the request was cut short: {ev.error}", "server_error")
                outs[i] = ev
        c = self.call
        choices = [self._choice(i, out, comp) for i, out in enumerate(outs) for comp in out.completions]
        obj = "chat.completion" if c.chat else "text_completion"
        return {"id": c.id, "object": obj, "created": c.created, "model": c.model, "choices": choices,
                "usage": self._usage(outs), "system_fingerprint": _fingerprint(c)}

    def _choice(self, i: int, out: RequestOutput, comp) -> dict:
        c = self.call
        ch = choice_json(c.url, comp, None) | {"index": i * c.n + comp.index, "seed": comp.seed}
        if c.score_only:  # the one token computed to score the prompt is not an answer
            ch |= {"finish_reason": "length"} | ({"text": ""} if ch.get("text") is not None else {"token_ids": []})
            if ch["logprobs"] is not None:
                ch["logprobs"] = completion_logprobs([])
        if c.echo:
            ch["text"] = self._prompt_text(out) + ch["text"] if ch.get("text") is not None else None
            if ch["logprobs"] is not None:
                ch["logprobs"] = self._echo_logprobs(out, ch["logprobs"])
        return ch

    def _echo_logprobs(self, out: RequestOutput, out_lps: dict) -> dict:
        """The completions logprobs with the prompt's tokens in front (the first token has no
        logprob: nothing predicts it)."""
        ids, pl = out.prompt_token_ids, out.prompt_logprobs or []
        tokens = [e["token"] if e else (self.tok.decode([t]) if self.tok else None) for e, t in zip(pl, ids)]
        head = {"tokens": tokens, "token_logprobs": [e["logprob"] if e else None for e in pl],
                "top_logprobs": [{a["token"]: a["logprob"] for a in e["top_logprobs"]} if e else None for e in pl]}
        return {k: head[k] + out_lps[k] for k in head}

    def _prompt_text(self, r: Request | RequestOutput) -> str:
        """The prompt as text, for ``echo`` (token-id prompts are decoded)."""
        if r.prompt is not None:
            return r.prompt
        return self.tok.decode(r.prompt_token_ids) if self.tok is not None else ""

    def _usage(self, outs: list[RequestOutput]) -> dict:
        prompt = sum(len(o.prompt_token_ids) for o in outs)
        done = 0 if self.call.score_only else sum(o.num_output_tokens for o in outs)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    # ---- a stream ---------------------------------------------------------------------------

    async def sse(self, early):
        """Server-Sent Events: role (chat), pieces as they come, the finish, usage when asked,
        ``[DONE]``; an error after the stream began is one error event, then the end."""
        c = self.call
        streams = [[ChoiceStream(self.tok, r.params.stop) for _ in range(c.n)] for r in c.requests]
        outs: list[RequestOutput | None] = [None] * len(c.requests)
        try:
            if c.chat:
                for j in range(len(c.requests) * c.n):
                    yield self._chunk(j, {"role": "assistant", "content": ""}, None, None)
            if c.echo:
                for i, r in enumerate(c.requests):
                    for k in range(c.n):
                        yield self._chunk(i * c.n + k, self._prompt_text(r), None, None)
            async for i, ev in self._all(early, None):
                if isinstance(ev, Failed) or (isinstance(ev, RequestOutput) and ev.finish_reason == "error"):
                    why = ev.error if isinstance(ev, Failed) else f"the request was cut short: {ev.error}"
                    self.abort_all()
                    yield _sse(error_body(why, "server_error", code=500))
                    return
                if isinstance(ev, Delta):
                    piece = streams[i][ev.index].push(ev)
                    if piece is not None:
                        yield self._piece_chunk(i * c.n + ev.index, piece)
                    continue
                outs[i] = ev
                for comp in ev.completions:
                    piece = streams[i][comp.index].finish(comp)
                    if piece is not None:
                        yield self._piece_chunk(i * c.n + comp.index, piece)
            if c.include_usage:
                yield _sse(self._head("completion.chunk" if c.chat else "text_completion") |
                           {"choices": [], "usage": self._usage(outs)})
            yield "data: [DONE]\n\n"
        finally:  # a client that went away closes the generator: abort what is still running
            self.abort_all()

    def _head(self, obj: str) -> dict:
        c = self.call
        return {"id": c.id, "object": "chat." + obj if c.chat else obj, "created": c.created, "model": c.model,
                "system_fingerprint": _fingerprint(c)}

    def _chunk(self, index: int, content, logprobs, reason, extra: dict | None = None) -> str:
        if self.call.chat:
            choice = {"index": index, "delta": content if isinstance(content, dict) else {"content": content},
                      "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": index, "text": content, "logprobs": logprobs, "finish_reason": reason}
        return self.chunk_prefix + json.dumps(choice | extra if extra else choice, ensure_ascii=False) + "]}\n\n"

    def _piece_chunk(self, index: int, p: Piece) -> str:
        c = self.call
        reason = None
        if p.finish_reason is not None:
            reason = "length" if p.finish_reason in ("error", "constraint_unfinished") else p.finish_reason
        if c.score_only:
            return self._chunk(index, "", None, reason) if reason else ""
        lps = None
        if p.logprobs is not None:
            lps = chat_logprobs(p.logprobs) if c.chat else completion_logprobs(p.logprobs)
        extra = {"token_ids": p.token_ids} if p.text is None else None
        return self._chunk(index, p.text or "", lps, reason, extra)


def _final(ev) -> bool:
    return isinstance(ev, (RequestOutput, Failed))


def _fingerprint(c: Call) -> str:
    return f"tinyllm-{package_version()}-seed{c.run_seed}"


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _authorized(request: HTTPConnection, key: str) -> bool:
    got = request.headers.get("authorization", "")
    scheme, _, token = got.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is over the limit of {limit} bytes (--max-body-bytes)")


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
