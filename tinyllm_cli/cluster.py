"""Data parallelism on a Ray cluster: N engine workers behind the engine's own contract.

Scale-out sits above the engine. ``ClusterEngine`` implements the engine contract
(``engine/contract.py``) that ``LLMEngine`` implements, so ``LLM`` and every command drive it
unchanged: ``generate``'s ordered writer, ``--resume`` and ``serve-batch``'s completion-order
stream stay on the driver. Each worker is a Ray actor (``EngineWorker``) that owns one
``LLMEngine`` (model, KV pool, scheduler) in its own process, possibly on another machine.

Invariants:
- Pull-based dispatch: the driver holds every request until a worker has room; a worker has at
  most ``per_worker`` requests in flight, and each reply (sent as soon as one of its requests
  finishes, or after ``REPLY_S``) brings finished outputs back and takes new requests along.
- A request is done only when its output reaches the driver; an output is accepted once (its
  key leaves ``inflight`` when it arrives), so none is lost or doubled.
- Faults. A worker that raises inside ``advance`` is alive: its engine is rebuilt and it goes on.
  A worker that dies is killed for good and replaced by a new actor, at most
  ``parallel.max_restarts`` times over the pool's life; "every Ray worker is gone" only once no
  worker is left. Either way the requests it held go back to the front of the queue as
  *suspects*, each of which then runs alone on a worker (another one where there is one). A
  failure with one request aboard is that request's: after ``parallel.max_attempts`` of those it
  is answered with ``finish_reason: "error"``, so one bad request never takes the run down.
- The model reaches workers through the object store (one ``ray.put`` of the checkpoint's
  config, weights and tokenizer): a worker never opens the checkpoint path.
- Streaming requests (``Request.stream``): a worker replies after every step that gave one of
  them new tokens, bringing the ``Delta``s along; the driver passes on only those of requests
  it still holds, under the caller's id. A request retried elsewhere streams again from its
  first token; each delta says where it starts, so the caller drops what it has seen.
- ``abort`` drops a request the driver still holds: from the queue, or from its worker's
  in-flight set (the worker drops it at the start of its next call; its blocks go back there).
- A request's seed is fixed on the driver by ``request_seed`` (the run's seed and the request's
  id) before it is sent, as the in-process engine fixes it: outputs do not depend on which worker
  ran them, or in which order.
- The local instance we start listens on loopback only (Ray's single-machine mode), with token
  authentication on and no dashboard or job API.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import time
from collections import deque
from dataclasses import dataclass, field

from .config import Config
from .engine.contract import Engine
from .engine.dispatch import least_loaded
from .engine.request import Delta, Request, RequestOutput, request_seed
from .engine.stats import RunStats, merge_worker_summaries
from .errors import TinyLLMError, UsageError
from .machine import installed
from .runtime import Placement, Runtime, make_engine, runtime_from_checkpoint

INSTALL = 'pip install "tinyllm[ray]"'
REPLY_S = 0.1  # longest a worker computes before replying, so new requests reach it soon
START_TIMEOUT_S = 300.0  # workers must be up (model built) within this
POLL_S = 0.2  # ray.wait slices: signals (Ctrl-C) are handled between them


def import_ray():
    """Ray, or one sentence naming the install command (exit 2, before any model loads)."""
    require_ray()
    import ray
    return ray


def require_ray() -> None:
    # Found without importing it: Ray reads its environment (auth mode, loopback mode) at import.
    if not installed("ray"):
        raise UsageError(f"--workers and --ray-address need Ray, which is not installed: {INSTALL}")


# ---- the worker (runs in a Ray actor process) --------------------------------------------------

class EngineWorker:
    """One engine in its own process: built from the checkpoint object, fed by the driver."""

    def __init__(self, ck, cfg: Config, threads: int):
        import torch
        torch.set_num_threads(threads)  # this worker's CPUs, so workers do not oversubscribe cores
        t0 = time.perf_counter()
        self.rt = runtime_from_checkpoint(ck, Placement.resolve(cfg), t0)  # this worker's own device
        self.cfg = cfg
        self.engine = make_engine(cfg, self.rt)

    def info(self) -> dict:
        import ray
        import torch
        return {"pid": os.getpid(), "host": socket.gethostname(), "node_id": ray.get_runtime_context().get_node_id(),
                "threads": torch.get_num_threads()} | self.rt.facts()

    def reset(self, cfg: Config) -> None:
        """A fresh engine (new KV pool, empty scheduler) for another run on the same model; the old
        one is closed first, so the new pool can take its memory (``PoolMemory``)."""
        self.engine.close()
        self.cfg = cfg
        self.engine = make_engine(cfg, self.rt)

    def reset_stats(self) -> None:
        self.engine.reset_stats()

    def add_observer(self, observer) -> None:
        self.engine.add_observer(observer)

    def observed(self) -> list:
        return self.engine.observed()

    def advance(self, new: list[Request], aborts: list, budget_s: float) -> tuple[list[RequestOutput], list[Delta], dict]:
        """Drop ``aborts``, queue ``new``, then step until something finishes, a streaming
        request has new tokens, or ``budget_s`` has passed. Returns the finished outputs, the
        deltas and the engine's ``load()`` after the last step."""
        for key in aborts:
            self.engine.abort(key)
        done = [out for req in new if (out := self.engine.add_request(req)) is not None]
        deltas: list[Delta] = []
        t_end = time.perf_counter() + budget_s
        while not done and not deltas and self.engine.has_unfinished() and time.perf_counter() < t_end:
            done += self.engine.step()
            deltas += self.engine.take_deltas()
        return done, deltas, self.engine.load()

    def summary(self) -> dict:
        self.engine.stats.end = time.perf_counter()
        return self.engine.stats.summary()


# ---- connecting -------------------------------------------------------------------------------

@dataclass
class Connection:
    ray: object
    local: bool  # we started the instance (and stop it at the end)
    address: str


def connect(address: str | None, num_cpus: float, insecure: bool = False) -> Connection:
    """Start a local instance (address None or 'local') or join a cluster ('auto', HOST:PORT).
    Joining requires token authentication (a token this driver can present) unless ``insecure``."""
    local = address in (None, "local")
    if not local and not insecure:
        require_token(address)
    if local:
        # Ray's single-machine mode: every Ray process binds and advertises 127.0.0.1 only. Read
        # when ray is imported, and inherited by every process of the instance.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        os.environ.setdefault("RAY_AUTH_MODE", "token")  # Ray >= 2.52 makes and keeps a token
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "error")  # Ray's C++ retry warnings are not for users
    ray = import_ray()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    kw = dict(logging_level=logging.ERROR, log_to_driver=False, include_dashboard=False,
              configure_logging=True)
    if not local:
        kw.pop("include_dashboard")
    try:
        with captured_stderr() as log:  # Ray's C++ retry warnings; our one sentence says it
            if local:
                ray.init(num_cpus=num_cpus, _node_ip_address="127.0.0.1", **kw)
            else:
                ray.init(address=address, **kw)
    except Exception as e:  # ConnectionError, auth failures, RuntimeError from raylet start
        raise TinyLLMError(_connect_error(address, e, log.text)) from e
    finally:
        for s, h in handlers.items():  # ray.init installs its own SIGTERM handler; ours must win
            if h is not None:
                signal.signal(s, h)
    return Connection(ray, local, "local instance" if local else address)


def require_token(address: str) -> None:
    """A remote cluster is joined with a token only: without one the driver would talk to any
    cluster at that address unauthenticated (and one without auth would accept anybody)."""
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    if os.environ["RAY_AUTH_MODE"] != "token":
        raise UsageError(f"joining the Ray cluster at {address} needs token authentication, but RAY_AUTH_MODE is "
                         f"{os.environ['RAY_AUTH_MODE']!r}; set it to token (or pass --ray-insecure to join without)")
    have = (os.environ.get("RAY_AUTH_TOKEN") or os.path.isfile(os.environ.get("RAY_AUTH_TOKEN_PATH", ""))
            or os.path.isfile(os.path.expanduser("~/.ray/auth_token")))
    if not have:
        raise UsageError(f"joining the Ray cluster at {address} needs its token: set RAY_AUTH_TOKEN or "
                         f"RAY_AUTH_TOKEN_PATH, or copy it to ~/.ray/auth_token (or pass --ray-insecure to join "
                         f"a cluster without authentication)")


class captured_stderr:
    """File descriptor 2 goes to a temporary file for the block (C++ code writes there too);
    ``text`` holds what was written."""

    def __enter__(self):
        import sys
        import tempfile
        self.text = ""
        sys.stderr.flush()
        self.tmp = tempfile.TemporaryFile()
        self.saved = os.dup(2)
        os.dup2(self.tmp.fileno(), 2)
        return self

    def __exit__(self, *exc):
        import sys
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)
        self.tmp.seek(0)
        self.text = self.tmp.read().decode("utf-8", "replace")
        self.tmp.close()
        return False


def _connect_error(address: str | None, e: Exception, log: str) -> str:
    text = " ".join(str(e).split())[:300]
    where = "start a local Ray instance" if address in (None, "local") else f"join the Ray cluster at {address}"
    said = (text + log).lower()
    if "invalidauthtoken" in said or "unauthenticated" in said or "authentication" in said:
        return (f"cannot {where}: it refused this driver's credentials (the cluster uses token "
                f"authentication: set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH)")
    return f"cannot {where}: {text}"


# ---- the driver's view of its workers ---------------------------------------------------------

@dataclass
class WorkerSlot:
    index: int
    handle: object
    info: dict = field(default_factory=dict)
    inflight: dict = field(default_factory=dict)  # key -> Request sent, output not yet back
    aborts: list = field(default_factory=list)  # keys aborted on the driver, to tell the worker
    call: object = None  # the outstanding advance() reference, if any
    starting: object = None  # a replacement's info() reference until it is up
    alive: bool = True
    error: str | None = None
    restarts: int = 0  # replacements of this slot's actor after it died
    raised: int = 0  # calls that raised inside the worker (it stayed alive)
    requests: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    handed_back: int = 0  # requests given to other workers after this one died
    summary: dict | None = None
    load: dict = field(default_factory=dict)  # its engine's load() at its last reply


class WorkerPool:
    """N ``EngineWorker`` actors built from one checkpoint object; torn down by ``close``."""

    def __init__(self, conn: Connection, ck, cfg: Config):
        ray, par = conn.ray, cfg.parallel
        self.conn, self.cfg = conn, cfg
        self._check_resources(ray, par)
        self._ref = ray.put(ck)  # the model travels through the object store, never as a path
        self.restarts_left = par.max_restarts
        self.slots = [WorkerSlot(i, self._actor(cfg)) for i in range(par.workers)]
        self._await_ready(ray)

    def _actor(self, cfg: Config):
        par = cfg.parallel
        opts = dict(num_cpus=par.worker_cpus, num_gpus=par.worker_gpus, max_restarts=0, scheduling_strategy="SPREAD")
        return self.conn.ray.remote(EngineWorker).options(**opts).remote(self._ref, cfg, max(1, int(par.worker_cpus)))

    def replace(self, s: WorkerSlot) -> bool:
        """A new actor for a slot whose actor died (the old one is killed, in case it only hangs);
        False when the restart budget is spent. The new one is up once ``s.starting`` resolves."""
        try:
            self.conn.ray.kill(s.handle, no_restart=True)
        except Exception:  # already gone
            pass
        if self.restarts_left <= 0:
            s.alive = False
            return False
        self.restarts_left -= 1
        s.handle, s.restarts, s.alive = self._actor(self.cfg), s.restarts + 1, True
        s.starting = s.handle.info.remote()
        return True

    def started(self, s: WorkerSlot, ref) -> None:
        """A replacement answered: up (its info recorded), or dead too (then replaced again)."""
        s.starting = None
        try:
            s.info = self.conn.ray.get(ref)
        except self.conn.ray.exceptions.RayError as e:
            s.error = _first_line(getattr(e, "cause", None) or e)
            self.replace(s)

    def _check_resources(self, ray, par) -> None:
        res = ray.cluster_resources()
        need = {"CPU": par.workers * par.worker_cpus, "GPU": par.workers * par.worker_gpus}
        for name, n in need.items():
            if n and res.get(name, 0) < n:
                raise TinyLLMError(f"{par.workers} workers need {n:g} {name}s but the Ray cluster has "
                                   f"{res.get(name, 0):g}; lower --workers, --worker-cpus or --worker-gpus")

    def _await_ready(self, ray) -> None:
        refs = {s.handle.info.remote(): s for s in self.slots}
        deadline = time.monotonic() + START_TIMEOUT_S
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
            for r in ready:
                try:
                    refs[r].info = ray.get(r)
                except ray.exceptions.RayError as e:
                    why = getattr(e, "cause", None) or e  # the worker's own exception, not Ray's wrapper
                    raise TinyLLMError(f"a Ray worker could not build the engine: {_first_line(why)}") from e
            if pending and time.monotonic() > deadline:
                raise TinyLLMError(f"{len(pending)} of {len(self.slots)} Ray workers did not start within "
                                   f"{START_TIMEOUT_S:.0f} s")

    def reset(self, cfg: Config) -> None:
        """Fresh engines (new KV pools) with ``cfg`` on every live worker."""
        self.cfg = cfg
        self.conn.ray.get([s.handle.reset.remote(cfg) for s in self.slots if s.alive])
        self.new_run()

    def new_run(self) -> None:
        """Zero the per-worker figures, here and in each worker's engine stats."""
        self.conn.ray.get([s.handle.reset_stats.remote() for s in self.slots if s.alive and s.starting is None])
        for s in self.slots:
            s.inflight.clear()
            s.call = None
            s.requests = s.failed = s.prompt_tokens = s.output_tokens = s.handed_back = s.raised = 0
            s.summary = None
            s.aborts = []

    def close(self) -> None:
        ray = self.conn.ray
        for s in self.slots:
            try:
                ray.kill(s.handle)
            except Exception:  # already dead
                pass
        ray.shutdown()  # a local instance stops with it


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[-1][:300]


# ---- the engine the commands drive --------------------------------------------------------------

class ClusterEngine(Engine):
    """The engine contract over a ``WorkerPool``: requests in, finished outputs out."""

    def __init__(self, pool: WorkerPool, cfg: Config):
        self.pool, self.ray, self.cfg = pool, pool.conn.ray, cfg
        self.per_worker = cfg.scheduler.max_num_seqs
        self.seed = cfg.sampling.run_seed  # as ``make_engine``'s
        self.pending: deque[tuple[int, Request]] = deque()  # (key, request) not yet sent
        self.requests: dict[int, Request] = {}  # key -> the caller's request, until its output arrives
        self.suspects: set[int] = set()  # keys aboard a worker that failed: they run alone
        self.blamed: dict[int, int] = {}  # key -> failures with it alone aboard
        self.tried: dict[int, set[int]] = {}  # key -> slots it failed on
        self.keys: dict[object, int] = {}  # the caller's request id -> key, until its output arrives
        self._deltas: list[Delta] = []
        self._key = 0
        self.reset_stats()

    # ---- requests in ------------------------------------------------------------------------

    def add_request(self, req: Request) -> RequestOutput | None:
        seed = request_seed(self.seed, req)  # fixed here, so the worker's engine uses it as given
        # arrival is a time on this process's clock, which a worker (maybe on another node) does
        # not share: a worker's TTFT counts from when it takes the request.
        req = dataclasses.replace(req, params=dataclasses.replace(req.params, seed=seed), arrival=None)
        self._key += 1
        self.requests[self._key] = req
        self.keys[req.id] = self._key
        self.pending.append((self._key, req))
        return None

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def abort(self, request_id) -> bool:
        key = self.keys.get(request_id)
        if key is None or self._drop(key) is None:
            return False
        self.pending = deque(item for item in self.pending if item[0] != key)
        for s in self.pool.slots:
            if s.inflight.pop(key, None) is not None:
                s.aborts.append(key)
        self.stats.num_aborted += 1
        return True

    def take_deltas(self) -> list[Delta]:
        out, self._deltas = self._deltas, []
        return out

    def load(self) -> dict:
        """Each live worker's figures at its last reply, summed; the driver's own queue counts as
        waiting, and the token counters are the driver's (outputs received)."""
        loads = [s.load for s in self.pool.slots if s.alive and s.load]
        out = {k: sum(x[k] for x in loads) for k in ("running", "waiting", "blocks_used", "blocks_free", "num_blocks",
                                                    "preemptions", "prefix_cache_queries", "prefix_cache_hits")}
        out["waiting"] += len(self.pending)
        out["kv_usage"] = out["blocks_used"] / max(out["num_blocks"], 1)
        return out | {"prompt_tokens": self.stats.prompt_tokens, "output_tokens": self.stats.output_tokens}

    def num_waiting(self) -> int:
        return len(self.pending)

    def default_pending(self) -> int:
        return self.per_worker * len(self.pool.slots) * 2

    def add_observer(self, observer) -> None:
        self.ray.get([s.handle.add_observer.remote(observer) for s in self.pool.slots if s.alive])

    def observed(self) -> list:
        got = self.ray.get([s.handle.observed.remote() for s in self.pool.slots if s.alive])
        return [o for per_worker in got for o in per_worker]

    def reset_stats(self) -> None:
        c = self.cfg
        self.pool.new_run()
        self.stats = ClusterStats(c.cache.kind, c.cache.block_size, 0, 0, c.scheduler.max_num_seqs, pool=self.pool)

    # ---- one round: top up every worker, wait for a reply ----------------------------------------

    def step(self) -> list[RequestOutput]:
        self._dispatch()
        calls = {s.call: s for s in self.pool.slots if s.alive and s.call is not None}
        starts = {s.starting: s for s in self.pool.slots if s.starting is not None}
        if not calls and not starts:
            return []
        ready, _ = self.ray.wait(list(calls) + list(starts), num_returns=1, timeout=POLL_S)
        done: list[RequestOutput] = []
        for ref in ready:
            if ref in starts:
                self.pool.started(starts[ref], ref)
            else:
                done += self._collect(calls[ref], ref)
        return done

    def _dispatch(self) -> None:
        """Give every ready worker without an outstanding call its next batch: queued requests go
        one at a time to the least loaded of them (up to ``per_worker`` each; a suspect only to an
        empty worker, alone), then each worker that has anything in flight gets a call (which may
        bring no new requests)."""
        live = [s for s in self.pool.slots if s.alive]
        if not live and self.requests:
            raise TinyLLMError(f"every Ray worker is gone ({self._deaths()}); {len(self.requests)} "
                               f"requests were not finished")
        idle = [s for s in live if s.call is None and s.starting is None]
        batches: dict[int, list[Request]] = {s.index: [] for s in idle}
        while self.pending:
            key, req = self.pending[0]
            s = self._place(key, idle)
            if s is None:
                break
            self.pending.popleft()
            s.inflight[key] = req
            batches[s.index].append(dataclasses.replace(req, id=key))  # the key names it on the way back
        for s in idle:
            if s.inflight or s.aborts:
                s.call = s.handle.advance.remote(batches[s.index], s.aborts, REPLY_S)
                s.aborts = []

    def _place(self, key: int, idle: list[WorkerSlot]) -> WorkerSlot | None:
        """The worker for queued request ``key``, or None while none has room for it."""
        if key in self.suspects:  # alone on an empty worker, one it has not failed on if possible
            empty = [s for s in idle if not s.inflight]
            fresh = [s for s in empty if s.index not in self.tried.get(key, ())]
            return (fresh or empty or [None])[0]
        clean = [s for s in idle if not self.suspects & s.inflight.keys()]
        return least_loaded(clean, lambda s: len(s.inflight), self.per_worker)

    def _collect(self, s: WorkerSlot, ref) -> list[RequestOutput]:
        s.call = None
        try:
            outs, deltas, s.load = self.ray.get(ref)
        except self.ray.exceptions.RayTaskError as e:  # raised inside the worker, which lives on
            s.raised += 1
            s.error = _first_line(getattr(e, "cause", None) or e)
            s.handle.reset.remote(self.cfg)  # its engine's state is unknown: a fresh one (calls run in order)
            return self._hand_back(s)
        except self.ray.exceptions.RayError as e:  # the actor died or is unreachable
            s.error = _first_line(e)
            done = self._hand_back(s)
            self.pool.replace(s)
            return done
        for d in deltas:
            req = s.inflight.get(d.id)
            if req is not None:
                self._deltas.append(dataclasses.replace(d, id=req.id))
        done = []
        for out in outs:
            req = s.inflight.pop(out.id, None)
            if req is None or self._drop(out.id) is None:
                continue  # not ours any more: never accept an output twice
            out.id = req.id
            s.prompt_tokens += len(out.prompt_token_ids) if out.num_output_tokens else 0
            s.output_tokens += out.num_output_tokens  # every completion of an n > 1 request
            done.append(self._answer(s, out))
        return done

    def _answer(self, s: WorkerSlot, out: RequestOutput) -> RequestOutput:
        s.requests += 1
        s.failed += out.finish_reason == "error"
        self.stats.record_request(out)
        return out

    def _drop(self, key: int) -> Request | None:
        """Stop holding request ``key`` (answered or aborted); None when it was not held."""
        req = self.requests.pop(key, None)
        if req is not None:
            self.keys.pop(req.id, None)
            self._forget(key)
        return req

    def _forget(self, key: int) -> None:
        self.suspects.discard(key)
        self.blamed.pop(key, None)
        self.tried.pop(key, None)

    def _hand_back(self, s: WorkerSlot) -> list[RequestOutput]:
        """A worker failed: a request that was alone aboard is blamed (and answered with an error
        after ``max_attempts`` such failures); the others go back to the front of the queue, in
        input order, as suspects that run alone from now on."""
        held = sorted(s.inflight.items(), key=lambda kv: (kv[1].index, kv[0]))
        s.inflight.clear()
        done, back = [], []
        for key, req in held:
            self.tried.setdefault(key, set()).add(s.index)
            if len(held) == 1:
                self.blamed[key] = self.blamed.get(key, 0) + 1
            if self.blamed.get(key, 0) >= self.cfg.parallel.max_attempts:
                self._drop(key)
                why = f"it failed on {len(self.tried.get(key, ())) or 1} worker(s), the last time with: {s.error}"
                done.append(self._answer(s, RequestOutput.failed(req, why)))
                continue
            self.suspects.add(key)
            back.append((key, req))
        s.handed_back += len(back)
        for item in reversed(back):
            self.pending.appendleft(item)
        return done

    def _deaths(self) -> str:
        dead = [f"worker {s.index} ({s.error}; restarted {s.restarts}x)" for s in self.pool.slots if not s.alive]
        return "; ".join(dead)[:400]



@dataclass
class ClusterStats(RunStats):
    """Totals from the outputs the driver received (``RunStats``), plus each worker's own
    engine summary for the cache figures."""

    pool: object = None

    def summary(self) -> dict:
        """The run table's keys (cache figures summed or maxed over workers) plus ``workers``."""
        ray = self.pool.conn.ray
        if self.end is None:
            self.end = time.perf_counter()
        for s in self.pool.slots:
            if s.alive and s.summary is None:
                try:
                    s.summary = ray.get(s.handle.summary.remote(), timeout=30)
                except Exception as e:  # died after its last reply
                    s.alive, s.error = False, _first_line(e)
        out = super().summary()
        got = [s.summary for s in self.pool.slots if s.summary]
        if got:
            out |= merge_worker_summaries(got, out["elapsed_s"])
        el = max(out["elapsed_s"], 1e-9)
        out["workers"] = [worker_row(s, el) for s in self.pool.slots]
        out["num_workers"] = len(self.pool.slots)
        out["retried_requests"] = sum(s.handed_back for s in self.pool.slots)
        out["failed_workers"] = [s.index for s in self.pool.slots if not s.alive]
        out["restarted_workers"] = [s.index for s in self.pool.slots if s.restarts]
        return out


def worker_row(s: WorkerSlot, elapsed: float) -> dict:
    sm = s.summary or {}
    return {"worker": s.index, "node_id": s.info.get("node_id"), "host": s.info.get("host"),
            "pid": s.info.get("pid"), "threads": s.info.get("threads"), "requests": s.requests,
            "failed_requests": s.failed, "prompt_tokens": s.prompt_tokens, "output_tokens": s.output_tokens,
            "output_tokens_per_s": round(s.output_tokens / elapsed, 2),
            "peak_blocks_used": sm.get("peak_blocks_used"), "preemptions": sm.get("preemptions"),
            "status": "ok" if s.alive else "died", "error": s.error, "retried_elsewhere": s.handed_back,
            "restarts": s.restarts, "raised": s.raised}


# ---- opening a pool ---------------------------------------------------------------------------

def wants_cluster(cfg: Config) -> bool:
    return cfg.parallel.workers > 1 or cfg.parallel.ray_address is not None


def start_pool(cfg: Config, quiet: bool) -> tuple[Runtime, WorkerPool]:
    """Connect, read the checkpoint once, start the workers; the caller closes the pool."""
    from .model.checkpoint import load_checkpoint
    par = cfg.parallel
    require_ray()  # the missing extra is a usage error before anything loads
    t0 = time.perf_counter()
    conn = connect(par.ray_address, par.workers * par.worker_cpus, par.insecure)
    try:
        ck = load_checkpoint(cfg.model, not quiet, cfg.quant)
        pool = WorkerPool(conn, ck, cfg)
    except BaseException:
        conn.ray.shutdown()
        raise
    return Runtime.of_workers(ck, pool.slots[0].info, par.workers, time.perf_counter() - t0), pool
