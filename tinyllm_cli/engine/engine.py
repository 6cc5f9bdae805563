"""The engine loop: requests in, one packed forward per step, finished outputs out at once.

One step = schedule -> the runner (``runner.py``, the one room that calls the model) packs decode
rows and prefill chunks into one flat batch, runs one forward (logits only for rows that sample)
and samples -> append, check stops, release finished sequences, record stats. The engine loop
holds no tensors: its scheduler talks to the block manager (``cache.blocks``), and it calls the
runner, which owns the K/V storage, through its ``Runner`` interface.

Invariants:
- Outputs are handed back the step a sequence finishes (streaming), never held to the end.
- A bad request (empty, out-of-vocabulary ids, longer than ``max_model_len``, larger than the
  whole KV pool) becomes an error output straight away; the others go on.
- One host sync per step (the sampled ids, and in the same transfer every log-probability the
  step's requests asked for), none per row.
- A step whose every row is greedy with nothing else read from its logits (``sampler.argmax_only``,
  no grammar, no prompt scoring) asks the model for the argmax alone (``forward(greedy=True)``):
  the same tokens, without logits (``model/greedy_head.py``).
- A request with ``n`` > 1 prefills its prompt once: the step that completes the prompt samples
  n tokens from its last row (one per fork, each from its own seed) and forks the sequence; its
  output is built when the last of its n sequences finishes.
- Prompt log-probabilities need the logits of every prompt row: only the requests that ask get
  those rows (``logits_index``), and they skip prefix-cache hits until their prompt is scored.
- Structured output (``constraints``) is a sampling concern: each constrained sequence (each
  fork) holds its own grammar state; the step's constrained rows get their masks in one packed
  bitmask, filled while the forward pass runs (the states only depend on tokens already
  accepted) and applied to the logits in one pass before sampling. Unconstrained steps skip it.
- Speculative decoding (``speculative``, off unless an engine is given a ``Speculation``): after
  scheduling, the drafter proposes tokens for the greedy decoding sequences, within the room
  the scheduler grants; each such sequence's last token and drafts are one chunk of the same
  packed forward, and the argmax at all of its rows comes back in the step's one readback. The
  accepted drafts and the next token are appended one by one with the usual stop checks; the
  cache then rolls back to the stored tokens that were accepted (``truncate``). With
  speculation off the step is what it was: no drafting, no verify rows.
- Streaming (``Request.stream``): every step that appends tokens to such a request's sequence
  also records a ``Delta`` with just those tokens (``take_deltas``); nothing else changes.
- ``abort(id)`` runs between steps: the request's sequences leave the queue or the batch and
  their blocks go back to the pool at once; it produces no output.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable

import torch

from ..cache.attention import sdpa_scope
from ..cache.blocks import BlockManager
from ..model.llama import LlamaModel
from ..model.tokenizer import Tokenizer
from . import constraints
from .contract import Engine
from .request import Completion, Delta, Group, Request, RequestOutput, Sequence, Status, fork_seed, request_seed
from .runner import ModelRunner, Runner, scored_span
from .scheduler import Plan, Scheduler, Verify
from .speculative import Speculation, accepted_prefix, can_speculate
from .stats import RunStats, StepRecord


class LLMEngine(Engine):
    """The in-process engine: one model, one KV pool, one scheduler (see ``contract``)."""

    def __init__(self, model: LlamaModel, cache: BlockManager, tokenizer: Tokenizer | None = None, *,
                 max_num_seqs: int = 64, max_prefill_tokens: int = 2048, max_model_len: int | None = None,
                 eos_ids: Iterable[int] | None = None, seed: int = 0, speculation: Speculation | None = None,
                 runner: Runner | None = None, clock: Callable[[], float] = time.perf_counter):
        """``cache``: the block manager the scheduler admits, grows and preempts in.
        ``runner``: what computes the steps (default: a ``ModelRunner`` on ``model`` with new
        K/V storage for ``cache``). ``clock``: every timestamp the engine and its stats take
        (wall time; the simulator passes its virtual clock)."""
        self.model, self.cache, self.tokenizer = model, cache, tokenizer
        self.clock = clock
        self.runner: Runner = runner if runner is not None else ModelRunner(model, cache)
        limit = model.cfg.max_position_embeddings
        self.max_model_len = min(max_model_len or limit, limit)
        if cache.kind == "slot":
            self.max_model_len = min(self.max_model_len, cache.max_len)
        self.eos_ids = set(eos_ids if eos_ids is not None else model.cfg.eos_token_ids)
        self.scheduler = Scheduler(cache, max_num_seqs, max_prefill_tokens)
        self.seed = seed  # the run's seed: unseeded requests derive theirs from it and their id
        self.speculation = speculation
        self.reset_stats()
        self._ids = itertools.count()
        self._step = 0
        self._token_text: dict[int, str | None] = {}
        self.observers: list = []
        self._deltas: list[Delta] = []  # streaming requests' new tokens, until ``take_deltas``

    # ---- requests in ---------------------------------------------------------------------

    def add_request(self, req: Request) -> RequestOutput | None:
        """Queue a request; returns an error output instead if it can never run."""
        error = req.error or self._check(req)
        p = req.params
        compiled = None
        if not error and p.constraint_fields:
            compiled, error = self._compiled(p)
        seed = request_seed(self.seed, req)
        now = self._arrival(req)
        seqs = [Sequence(next(self._ids), req, fork_seed(seed, i), list(req.prompt_token_ids),
                         len(req.prompt_token_ids), arrival=now, fork=i) for i in range(1 if req.error else p.n)]
        group = Group(req, seqs, prompt_logprobs=None if p.num_prompt_logprobs is None else [None])
        for s in seqs:
            s.group = group
            if p.num_logprobs is not None:
                s.logprobs = []
            if p.stop and self.tokenizer is not None:
                s.stream = self.tokenizer.stream()
            if compiled is not None:  # each fork its own state
                s.grammar = constraints.GrammarState.replay(compiled, s.output_ids)
        if error:
            return [self._finish(s, "error", error) for s in seqs][-1]
        seqs[0].pending = seqs[1:]
        self.scheduler.add(seqs[0])
        return None

    def _compiled(self, p) -> tuple[object, str | None]:
        """(compiled grammar, None) for a constrained request, or (None, why it cannot run)."""
        if self.tokenizer is None:
            return None, "structured output needs the model's tokenizer, and this model has none"
        try:
            constraints.require()
            c = constraints.compiler_for(self.tokenizer, self.model.cfg.vocab_size, self.eos_ids)
            hits, t0 = c.hits, time.perf_counter()
            try:
                return c.get(p.constraint), None
            finally:
                self.stats.grammar_compile_s += time.perf_counter() - t0
                self.stats.grammar_cache_hits += c.hits - hits
        except ValueError as e:
            return None, str(e)

    def _arrival(self, req: Request) -> float:
        return self.clock() if req.arrival is None else req.arrival

    def _check(self, req: Request) -> str | None:
        ids, vocab = req.prompt_token_ids, self.model.cfg.vocab_size
        if not ids:
            return "the prompt is empty"
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            return f"prompt token id {bad!r} is outside the vocabulary (0..{vocab - 1})"
        if len(ids) >= self.max_model_len:
            return (f"the prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}, "
                    f"which leaves no room to generate")
        n = req.params.n
        if n > self.scheduler.max_num_seqs:
            return (f"n = {n} completions run as {n} sequences at once but max_num_seqs is "
                    f"{self.scheduler.max_num_seqs}; lower n or raise --max-num-seqs")
        if req.whole:
            return self._check_whole(len(ids), req.params)
        if not self.cache.fits_alone(len(ids) + 1, n - 1):
            what = "slots" if self.cache.kind == "slot" else "KV blocks"
            need = self.cache.blocks_for(len(ids) + 1) + n - 1
            return (f"the prompt needs {need} {what}" + (f" for its n = {n} completions" if n > 1 else "")
                    + f" but the whole pool has {self.cache.num_blocks}; raise --num-blocks or --kv-memory"
                    + (" or lower n" if n > 1 else ""))
        return None

    def _check_whole(self, n_prompt: int, p) -> str | None:
        """Why a ``Request.whole`` request could never run to ``max_new_tokens``, or None."""
        total = n_prompt + p.max_new_tokens
        if total > self.max_model_len:
            return (f"the prompt ({n_prompt} tokens) plus max_tokens ({p.max_new_tokens}) is {total} tokens, "
                    f"over max_model_len {self.max_model_len}")
        if not self.cache.fits_alone(total, p.n - 1):
            need = self.cache.blocks_for(total) + p.n - 1
            what = "slots" if self.cache.kind == "slot" else "KV blocks"
            return (f"the prompt plus max_tokens needs {need} {what}" + (f" for n = {p.n}" if p.n > 1 else "")
                    + f" but the whole pool has {self.cache.num_blocks}")
        return None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def abort(self, request_id) -> bool:
        """Drop request ``request_id`` now (between steps): its sequences leave the waiting queue
        or the running batch, their blocks go back to the pool, and no output is produced.
        False when no unfinished request has that id."""
        sched = self.scheduler
        seqs = [s for s in list(sched.waiting) + sched.running if s.request.id == request_id]
        if not seqs:
            return False
        for s in seqs:
            if s in sched.running:
                sched.finish(s)  # frees its blocks (shared ones when the last reference goes)
            else:
                sched.waiting.remove(s)
            for f in [s] + s.pending:
                f.status, f.group = Status.FINISHED, None
            s.pending = []
        self.stats.num_aborted += 1
        return True

    def load(self) -> dict:
        """The figures a server's metrics show (see ``contract``): the same scheduler, cache and
        ``RunStats`` figures the run table reads."""
        c, st = self.cache, self.stats
        u = c.usage()
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "blocks_used": u.blocks_used, "blocks_free": u.blocks_free, "num_blocks": c.num_blocks,
                "kv_usage": u.blocks_used / max(c.num_blocks, 1), "preemptions": st.preemptions,
                "prefix_cache_queries": getattr(c, "prefix_queries", 0), "prefix_cache_hits": getattr(c, "prefix_hits", 0),
                "prompt_tokens": st.prompt_tokens, "output_tokens": st.output_tokens}

    def take_deltas(self) -> list[Delta]:
        """The streaming requests' new tokens since the last call, in step order."""
        out, self._deltas = self._deltas, []
        return out

    def close(self) -> None:
        """Close the runner (its grammar-mask threads stop and its K/V pools go to the next
        engine): a closed engine cannot step again."""
        self.runner.close()

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def default_pending(self) -> int:
        return 4 * self.scheduler.max_num_seqs

    def reset_stats(self) -> None:
        """A new run's figures; the pool (and the prefix cache in it) stays as it is."""
        c = self.cache
        self.stats = RunStats(c.kind, c.block_size, c.num_blocks, c.kv_bytes, self.scheduler.max_num_seqs, cache=c,
                              attention=self.runner.attention, start=self.clock(), clock=self.clock,
                              spec_method=self.speculation.method if self.speculation else "none")

    def add_observer(self, observer) -> None:
        self.observers.append(observer)

    def observed(self) -> list:
        for o in self.observers:
            o.finish(self)
        return list(self.observers)

    def running_sequences(self) -> dict[int, tuple[object, int]]:
        """seq id -> (request id, fork) for every running sequence."""
        return {s.seq_id: (s.request.id, s.fork) for s in self.scheduler.running}

    @property
    def step_index(self) -> int:
        """Steps taken so far (the index the next step's record gets)."""
        return self._step

    def record_step(self, record: StepRecord) -> None:
        """Count one step: its record joins the stats and the step index moves on. ``step``
        records its own; a caller that advances steps itself (the simulator's skip-ahead)
        records each one here."""
        self.stats.record_step(record)
        self._step += 1

    # ---- the loop ------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        clock = self.stats.phases
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        done = []
        for s in plan.failed:
            for f in [s] + s.pending:  # forks not started yet fail with their prompt
                done.append(self._finish(f, "error", "the sequence outgrew the whole KV pool; it was stopped here"))
            s.pending = []
        done = [o for o in done if o is not None]
        t1 = time.perf_counter()
        clock["schedule"] += t1 - t0
        if plan.empty:
            self._record(plan, 0.0, self.cache.usage(), len(self.scheduler.running))
            return done
        with sdpa_scope(self.model.device):  # the step's forwards: drafts and the step itself
            if self.speculation is not None and plan.decode:
                self._draft(plan)
            work = plan_work(plan)  # before the step moves its sequences on
            res = self.runner.run(plan, self.stats)
        t4 = time.perf_counter()
        self._advance(plan)
        samplers = res.samplers
        emits = self._accept(plan, res.verified) if plan.verify else []
        for s in samplers:
            if s.pending:  # its prompt is computed: the other n - 1 start from it
                self.scheduler.fork(s)
        # Memory as this step's forward used it, before finished sequences give theirs back.
        usage, running = self.cache.usage(), len(self.scheduler.running)
        for observe in self.observers:  # before releases, so a snapshot sees the final tables
            observe(self, plan)
        for s, tok, lp in zip(samplers, res.tokens, res.logprobs):
            if lp is not None:
                s.logprobs.append(lp)
            self._end_if(self._append(s, tok), s, done)
        for s, toks in emits:  # the accepted drafts, then the target's own next token
            for tok in toks:
                self.stats.spec_emitted_tokens += 1
                if self._end_if(self._append(s, tok), s, done):
                    break
        for s in samplers + [s for s, _ in emits]:
            if s.request.stream:
                self._report(s)
        clock["postprocess"] += time.perf_counter() - t4
        self._record(plan, res.forward_s, usage, running, work)
        return done

    def _report(self, s: Sequence) -> None:
        """A streaming sequence's tokens not handed out yet, as one ``Delta``."""
        new = s.output_ids[s.reported:]
        if not new:
            return
        lps = None if s.logprobs is None else [self._logprob_json(e) for e in s.logprobs[s.reported:]]
        done = s.status is Status.FINISHED
        self._deltas.append(Delta(s.request.id, s.fork, s.reported, new, lps, s.finish_reason if done else None,
                                  s.text if done and s.stream is not None else None))
        s.reported += len(new)

    def _end_if(self, reason: str | None, s: Sequence, done: list) -> bool:
        """Finish ``s`` when ``_append`` gave a reason (its output joins ``done`` once complete)."""
        if not reason:
            return False
        self.scheduler.finish(s)
        out = self._finish(s, reason, s.error)
        if out is not None:
            done.append(out)
        return True

    # ---- speculative decoding ----------------------------------------------------------------

    def _draft(self, plan: Plan) -> None:
        """Propose drafts for the plan's greedy decoding sequences, within the room the scheduler
        grants them, and move those that got any to ``plan.verify``."""
        t0 = time.perf_counter()
        spec = self.speculation
        wants = [(s, self._draft_cap(s, spec.num_tokens)) for s in plan.decode if can_speculate(s)]
        caps = self.scheduler.draft_room(plan, wants) if wants else []
        picked = [(s, k) for (s, _), k in zip(wants, caps) if k > 0]
        if picked:
            drafts = spec.drafter.propose([s for s, _ in picked], [k for _, k in picked])
            self.scheduler.speculate(plan, [Verify(s, d[:k]) for (s, k), d in zip(picked, drafts) if d])
        dt = time.perf_counter() - t0
        self.stats.spec_draft_s += dt
        self.stats.phases["prepare"] += dt

    def _draft_cap(self, s: Sequence, k: int) -> int:
        """No more drafts than the sequence could still emit after the step's own token."""
        return max(0, min(k, s.request.params.max_new_tokens - s.num_output - 1,
                          self.max_model_len - s.num_tokens - 1))

    def _accept(self, plan: Plan, verified: list[list[int]]) -> list[tuple[Sequence, list[int]]]:
        """Per verified sequence, the tokens it emits (the agreed drafts, then the argmax after
        them); its stored length rolls back to the tokens the step accepted."""
        st, out = self.stats, []
        for v, argmax in zip(plan.verify, verified):
            s, drafts = v.seq, v.drafts
            a = accepted_prefix(drafts, argmax)
            s.num_cached = s.num_tokens + a  # its last token and the agreed drafts are stored
            self.cache.truncate(s.seq_id, s.num_cached)
            st.spec_drafted_tokens += len(drafts)
            st.spec_accepted_tokens += a
            st.spec_verifications += 1
            out.append((s, drafts[:a] + [argmax[a]]))
        return out

    def _advance(self, plan: Plan) -> None:
        for s in plan.decode:
            s.num_cached += 1
        for c in plan.prefill:
            c.seq.num_cached = c.start + c.n

    def _append(self, s: Sequence, tok: int) -> str | None:
        """Append a sampled token; return a finish reason if the sequence is done."""
        s.tokens.append(tok)
        if s.first_token_time is None:
            s.first_token_time = self.clock()
        s.status = Status.DECODE
        p = s.request.params
        if not p.ignore_eos and tok in self.eos_ids:
            s.stop_reason = tok
            return "stop"
        if tok in p.stop_token_ids:
            s.stop_reason = tok
            return "stop"
        g = s.grammar
        if g is not None:
            t0 = time.perf_counter()
            ok = g.accept(tok)
            self.stats.grammar_s += time.perf_counter() - t0
            if not ok:
                s.error = f"token {tok} broke the request's constraint (a masking bug); the output stops here"
                return "error"
            if g.terminated:  # a stop token the grammar allowed (ignore_eos kept it from ending above)
                s.stop_reason = tok
                return "stop"
        if s.stream is not None and self._hit_stop_string(s, tok):
            return "stop"
        if s.num_output >= p.max_new_tokens or s.num_tokens >= self.max_model_len:
            # A constrained output cut short is not a valid output: say so.
            return "constraint_unfinished" if g is not None and not g.complete else "length"
        return None

    def _hit_stop_string(self, s: Sequence, tok: int) -> bool:
        new = s.stream.push(tok)
        if not new:
            return False
        tail_from = max(0, len(s.text) - max(len(x) for x in s.request.params.stop) + 1)
        s.text += new
        window = s.text[tail_from:]
        hits = [(window.find(x), x) for x in s.request.params.stop if x in window]
        if not hits:
            return False
        at, which = min(hits)
        s.text = s.text[:tail_from + at]  # the stop string is not part of the output
        s.stop_reason = which
        return True

    # ---- outputs and stats -----------------------------------------------------------------

    def _finish(self, s: Sequence, reason: str, error: str | None = None) -> RequestOutput | None:
        """Mark ``s`` finished; its request's output once the last of its n sequences is."""
        s.status, s.finish_reason, s.finish_time, s.error = Status.FINISHED, reason, self.clock(), error
        g = s.group
        g.finished += 1
        if g.finished < len(g.seqs):
            return None
        out = self._output(g)
        for f in g.seqs:  # Sequence <-> Group is a cycle: break it so a finished request is freed now
            f.group = None
        return out

    def _completion(self, s: Sequence) -> Completion:
        out_ids = s.output_ids
        if s.stream is not None:
            text = s.text
        elif self.tokenizer is not None:
            text = self.tokenizer.decode(out_ids)
        else:
            text = None
        ttft = tpot = None
        if s.first_token_time is not None:
            ttft = s.first_token_time - s.arrival
            if len(out_ids) > 1:
                tpot = (s.finish_time - s.first_token_time) / (len(out_ids) - 1)
        logprobs = None if s.logprobs is None else [self._logprob_json(e) for e in s.logprobs]
        return Completion(index=s.fork, token_ids=out_ids, text=text, finish_reason=s.finish_reason,
                          stop_reason=s.stop_reason, seed=s.seed, logprobs=logprobs, ttft_s=ttft, tpot_s=tpot,
                          latency_s=s.finish_time - s.arrival if out_ids else None, preemptions=s.preemptions)

    def _output(self, g: Group) -> RequestOutput:
        comps = [self._completion(s) for s in g.seqs]
        c0, r = comps[0], g.request
        error = next((s.error for s in g.seqs if s.error), None)
        ttfts = [c.ttft_s for c in comps if c.ttft_s is not None]
        tpots = [c.tpot_s for c in comps if c.tpot_s is not None]
        lats = [c.latency_s for c in comps if c.latency_s is not None]
        prompt_lps = None
        if g.prompt_logprobs is not None:
            prompt_lps = [None if e is None else self._logprob_json(e) for e in g.prompt_logprobs]
        out = RequestOutput(
            id=r.id, index=r.index, prompt=r.prompt, prompt_token_ids=list(r.prompt_token_ids),
            token_ids=c0.token_ids, text=c0.text, finish_reason=c0.finish_reason, error=error,
            stop_reason=c0.stop_reason, ttft_s=min(ttfts, default=None),
            tpot_s=sum(tpots) / len(tpots) if tpots else None, latency_s=max(lats, default=None),
            preemptions=sum(c.preemptions for c in comps), seed=c0.seed, metadata=r.metadata,
            completions=comps, n=len(comps), logprobs=c0.logprobs, prompt_logprobs=prompt_lps)
        self.stats.record_request(out)
        return out

    def _logprob_json(self, entry) -> dict:
        tok, lp, alts = entry
        return {"token_id": tok, "token": self._text_of(tok), "logprob": lp,
                "top_logprobs": [{"token_id": a, "token": self._text_of(a), "logprob": v} for a, v in alts]}

    def _text_of(self, tok: int) -> str | None:
        if self.tokenizer is None:
            return None
        if tok not in self._token_text:
            self._token_text[tok] = self.tokenizer.decode([tok])
        return self._token_text[tok]

    def _record(self, plan: Plan, forward_s: float, u, running: int, work: dict | None = None) -> None:
        n_pre = len(plan.preempted)
        self.stats.preemptions += n_pre
        self.stats.recomputed_tokens += plan.recomputed
        if n_pre:
            self.stats.preemption_steps.append(self._step)
        self.stats.forward_s += forward_s
        self.record_step(StepRecord(
            step=self._step, t=round(self.clock() - self.stats.start, 6), running=running,
            waiting=len(self.scheduler.waiting), blocks_used=u.blocks_used, blocks_free=u.blocks_free,
            tokens_stored=u.tokens_stored, slots_allocated=u.slots_allocated,
            prefill_tokens=sum(c.n for c in plan.prefill), decode_tokens=len(plan.decode) + len(plan.verify),
            preempted=n_pre,
            forward_s=round(forward_s, 6), shared_refs=u.shared_refs, cached_free=u.blocks_cached_free,
            shared_blocks=u.blocks_shared, fork_shared_blocks=u.fork_shared_blocks, fork_refs=u.fork_refs,
            **(work or {})))


def plan_work(plan: Plan) -> dict:
    """The step's model work as host integers, for ``StepRecord`` (``roofline.py`` turns them
    into FLOPs and bytes): one forward; rows through the output projection (one per sampled
    token, n for a prompt that forks n ways, plus scored prompt rows and every row of a
    speculative verify chunk); query-key pairs of causal
    attention (a decode row at context c: c; a chunk of n rows from position p: n*p + n(n+1)/2);
    and K/V token positions read (each decode row its context, each chunk its context once)."""
    logit_rows = len(plan.decode)
    pairs = kv_read = sum(s.num_tokens for s in plan.decode)  # the row's own token is stored first
    for c in plan.prefill:
        s, start, n = c.seq, c.start, c.n
        if c.completes_prompt:
            logit_rows += 1 + len(s.pending)
        if s.group is not None and s.group.scoring_prompt:
            lo, hi = scored_span(s, start, n)
            logit_rows += max(0, hi - lo)
        pairs += n * start + n * (n + 1) // 2
        kv_read += start + n
    for v in plan.verify:  # its last token and the drafts: a chunk, every row through the head
        n, start = len(v.drafts) + 1, v.seq.num_tokens - 1
        logit_rows += n
        pairs += n * start + n * (n + 1) // 2
        kv_read += start + n
    return {"forwards": 1, "logit_rows": logit_rows, "attn_pairs": pairs, "kv_read_tokens": kv_read}
