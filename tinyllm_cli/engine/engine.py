"""The engine loop: requests in, one packed forward per step, finished outputs out at once.

One step = schedule -> pack decode rows and prefill chunks into one flat batch -> one forward
(logits only for rows that sample) -> sample -> append, check stops, release finished sequences.

Invariants:
- Outputs are handed back the step a sequence finishes (streaming), never held to the end.
- A bad request (empty, out-of-vocabulary ids, longer than ``max_model_len``, larger than the
  whole KV pool) becomes an error output straight away; the others go on.
- One host sync per step (the sampled ids), none per row.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Iterable, Iterator

import torch

from ..cache.kv import PagedKVCache
from ..model.llama import LlamaModel
from ..model.tokenizer import Tokenizer
from ..transfer import to_device
from . import sampler
from .request import Request, RequestOutput, Sequence, Status
from .scheduler import Plan, Scheduler
from .stats import RunStats, StepRecord


class LLMEngine:
    def __init__(self, model: LlamaModel, cache: PagedKVCache, tokenizer: Tokenizer | None = None, *,
                 max_num_seqs: int = 64, max_prefill_tokens: int = 2048, max_model_len: int | None = None,
                 eos_ids: Iterable[int] | None = None, seed: int = 0):
        self.model, self.cache, self.tokenizer = model, cache, tokenizer
        limit = model.cfg.max_position_embeddings
        self.max_model_len = min(max_model_len or limit, limit)
        if cache.kind == "slot":
            self.max_model_len = min(self.max_model_len, cache.max_len)
        self.eos_ids = set(eos_ids if eos_ids is not None else model.cfg.eos_token_ids)
        self.scheduler = Scheduler(cache, max_num_seqs, max_prefill_tokens)
        self.stats = RunStats(cache.kind, cache.block_size, cache.num_blocks, cache.kv_bytes, max_num_seqs,
                              cache=cache)
        self._ids = itertools.count()
        self._rng = random.Random(seed)
        self._step = 0
        self.observers: list = []

    # ---- requests in ---------------------------------------------------------------------

    def add_request(self, req: Request) -> RequestOutput | None:
        """Queue a request; returns an error output instead if it can never run."""
        error = req.error or self._check(req)
        seed = req.params.seed if req.params.seed is not None else self._rng.getrandbits(63)
        seq = Sequence(next(self._ids), req, seed, list(req.prompt_token_ids), len(req.prompt_token_ids))
        if error:
            return self._output(seq, "error", error)
        if req.params.stop and self.tokenizer is not None:
            seq.stream = self.tokenizer.stream()
        self.scheduler.add(seq)
        return None

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
        if not self.cache.fits_alone(len(ids) + 1):
            return (f"the prompt needs {self.cache.blocks_for(len(ids) + 1)} KV blocks but the whole pool has "
                    f"{self.cache.num_blocks}; raise --num-blocks or --kv-memory")
        return None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- the loop ------------------------------------------------------------------------

    def run(self, requests: Iterable[Request], max_pending: int | None = None) -> Iterator[RequestOutput]:
        """Feed ``requests`` lazily (at most ``max_pending`` waiting) and yield outputs as they finish."""
        pending = max_pending or 4 * self.scheduler.max_num_seqs
        it = iter(requests)
        exhausted = False
        while True:
            while not exhausted and len(self.scheduler.waiting) < pending:
                req = next(it, None)
                if req is None:
                    exhausted = True
                    break
                out = self.add_request(req)
                if out is not None:
                    yield out
            if not self.has_unfinished():
                if exhausted:
                    break
                continue
            yield from self.step()
        self.stats.end = time.perf_counter()

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        clock = self.stats.phases
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        done = [self._output(s, "length", "the sequence outgrew the whole KV pool; it was stopped here")
                for s in plan.failed]
        t1 = time.perf_counter()
        clock["schedule"] += t1 - t0
        if plan.empty:
            self._record(plan, 0.0, self.cache.usage(), len(self.scheduler.running))
            return done
        samplers, ids, pos, rows, attn = self._prepare(plan)
        t2 = time.perf_counter()
        logits = self.model(ids, pos, attn, rows)
        t3 = time.perf_counter()
        # The one host sync of the step: on a GPU, queued forward work finishes inside it.
        tokens = sampler.sample(logits, samplers).tolist() if samplers else []
        t4 = time.perf_counter()
        self._advance(plan)
        # Memory as this step's forward used it, before finished sequences give theirs back.
        usage, running = self.cache.usage(), len(self.scheduler.running)
        for observe in self.observers:  # before releases, so a snapshot sees the final tables
            observe(self, plan)
        for s, tok in zip(samplers, tokens):
            reason = self._append(s, tok)
            if reason:
                self.scheduler.finish(s)
                done.append(self._output(s, reason))
        t5 = time.perf_counter()
        clock["prepare"] += t2 - t1
        clock["forward"] += t3 - t2
        clock["sample"] += t4 - t3
        clock["postprocess"] += t5 - t4
        self._record(plan, t3 - t2, usage, running)
        return done

    def _prepare(self, plan: Plan):
        """Pack the step's tokens; returns (samplers, ids, positions, logit rows, attention)."""
        # Decode rows first (one token each, all sample), then the prefill chunks.
        ids = [s.tokens[-1] for s in plan.decode]
        pos = [s.num_tokens - 1 for s in plan.decode]
        logit_rows = list(range(len(plan.decode)))
        samplers = list(plan.decode)
        row = len(plan.decode)
        for s, start, n in plan.prefill:
            ids += s.tokens[start:start + n]
            pos += range(start, start + n)
            row += n
            if start + n == s.num_tokens:  # the chunk that completes the prompt samples
                logit_rows.append(row - 1)
                samplers.append(s)
        attn = self.cache.plan_step([s.seq_id for s in plan.decode],
                                    [(s.seq_id, start, n) for s, start, n in plan.prefill])
        dev = self.model.device
        return samplers, to_device(ids, dev), to_device(pos, dev), to_device(logit_rows, dev), attn

    def _advance(self, plan: Plan) -> None:
        for s in plan.decode:
            s.num_cached += 1
        for s, start, n in plan.prefill:
            s.num_cached = start + n

    def _append(self, s: Sequence, tok: int) -> str | None:
        """Append a sampled token; return a finish reason if the sequence is done."""
        s.tokens.append(tok)
        if s.first_token_time is None:
            s.first_token_time = time.perf_counter()
        s.status = Status.DECODE
        p = s.request.params
        if not p.ignore_eos and tok in self.eos_ids:
            s.stop_reason = tok
            return "stop"
        if tok in p.stop_token_ids:
            s.stop_reason = tok
            return "stop"
        if s.stream is not None and self._hit_stop_string(s, tok):
            return "stop"
        if s.num_output >= p.max_new_tokens or s.num_tokens >= self.max_model_len:
            return "length"
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

    def _output(self, s: Sequence, reason: str, error: str | None = None) -> RequestOutput:
        now = time.perf_counter()
        s.status, s.finish_reason, s.finish_time = Status.FINISHED, reason, now
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
                tpot = (now - s.first_token_time) / (len(out_ids) - 1)
        r = s.request
        out = RequestOutput(r.id, r.index, r.prompt, list(r.prompt_token_ids), out_ids, text, reason,
                            error, s.stop_reason, ttft, tpot, now - s.arrival if out_ids else None,
                            s.preemptions, s.seed, r.metadata)
        self.stats.record_request(out)
        return out

    def _record(self, plan: Plan, forward_s: float, u, running: int) -> None:
        n_pre = len(plan.preempted)
        self.stats.preemptions += n_pre
        self.stats.recomputed_tokens += plan.recomputed
        if n_pre:
            self.stats.preemption_steps.append(self._step)
        self.stats.forward_s += forward_s
        self.stats.steps.append(StepRecord(
            self._step, round(time.perf_counter() - self.stats.start, 6), running,
            len(self.scheduler.waiting), u.blocks_used, u.blocks_free, u.tokens_stored, u.slots_allocated,
            sum(n for _, _, n in plan.prefill), len(plan.decode), n_pre, round(forward_s, 6),
            u.shared_refs, u.blocks_cached_free, u.blocks_shared))
        self._step += 1
