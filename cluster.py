"""The central scheduler: serves requests on worker processes (workers.py), one per device,
under a policy:

  collocated     every worker prefills and decodes; a request goes to the least loaded
  disaggregated  num_prefill workers prefill, the others decode; a prefilled request's
                 KV moves to the decode worker with the least work
  adaptive       every worker can do both; per request the Router (router.py) picks the
                 prefill and the decode worker by predicted cost (the same one:
                 collocated), and learns from what each request and step really cost

It offers the interface the single Engine offers (submit, poll, output), so the offline
LLM (nanopd.py) drives either with one loop. A worker that dies: the requests it held
(prefilling, decoding, or with KV parked on it for a transfer) start again from their
prompt on live workers, once; if no live worker can take them, or they fail a second
time, they end with a RuntimeError in RequestOutput.error. Nothing waits on a dead
worker. close() (also run at exit and when the object is collected) stops every worker.
"""

import collections
import dataclasses
import itertools
import logging
import time
import weakref
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from config import EngineConfig, check_device, check_int, check_real
from hosts import RemoteWorkers, parse_address
from kv_cache import cdiv
from messages import (
    Abort,
    Done,
    Drop,
    Expired,
    Failed,
    Handoff,
    Heartbeat,
    Imported,
    Measure,
    Measured,
    PullFailed,
    Ready,
    Rejected,
    Release,
    SetRole,
    StepTimed,
    Submit,
    Tokens,
    ToWorker,
)
from model import load_config, load_tokenizer
from planner import Planner
from request import RequestMetrics, RequestOutput, SamplingParams, check_request, tokenize
from router import Observation, Router, WorkerLoad
from transport import TRANSPORTS
from workers import HEARTBEAT_S, WorkerProcesses, exit_in_order_on_sigterm

POLICIES = ("collocated", "disaggregated", "adaptive")
log = logging.getLogger("nanopd")
PREFILL_RATE_WINDOW_S = 2.0   # the prefill rate counts the steps reported this long ago at most


@dataclass(eq=False)
class Tracked:
    """The central scheduler's record of one request."""
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    beam_width: int = 0
    length_penalty: float = 1.0
    worker: int | None = None          # where it runs now (its decode worker once handed off)
    prefill_worker: int | None = None
    decode_worker: int | None = None   # where it goes after its prefill (None: the least loaded then)
    phase: str = "queued"              # prefill, transfer, decode, done
    tokens: list[int] = field(default_factory=list)   # streamed so far
    output: RequestOutput | None = None
    retried: bool = False
    samples: list[int] = field(default_factory=list)  # n > 1 split into samples (not collocated)
    parent: int | None = None


class CentralScheduler:
    """Serves requests on one worker process per entry of devices, under a policy (see the
    module's docstring). Under adaptive, `router` must be set before the first submit
    (nanopd.LLM does it, from the profiler's measurements)."""

    def __init__(self, model: str, policy: str, devices: list[str] | None, num_prefill: int = 1,
                 transport: str = "p2p", worker_timeout_s: float = 60.0, slo: tuple[float, float] | None = None,
                 join: str | None = None, startup_timeout_s: float = 600.0, **engine_kwargs):
        check_cluster(policy, devices, num_prefill, transport, worker_timeout_s, slo, join)
        self.cfg = EngineConfig(model=model, **engine_kwargs)
        self.cfg.validate()
        config = load_config(model)
        self.cfg.max_model_len = min(self.cfg.max_model_len, config.max_position_embeddings)
        self.vocab_size, self.tokenizer = config.vocab_size, load_tokenizer(model)
        self.policy, self.transport, self.worker_timeout_s = policy, transport, worker_timeout_s
        self._start_workers(devices, num_prefill, join, startup_timeout_s)
        self.active: dict[int, Tracked] = {}
        self.done: dict[int, Tracked] = {}
        self.dead: dict[int, str] = {}        # worker -> why
        self.errors: dict[int, str] = {}      # worker -> the traceback it reported
        self.status: dict[int, Heartbeat] = {}   # worker -> its last Heartbeat
        self.measured: dict[int, dict] = {}
        self.heard: dict[int, float] = {}     # worker -> when its last reports came
        self.prefilled: collections.deque[tuple[float, int]] = collections.deque()   # (time, tokens) steps prefilled
        self.prefilled_tokens = 0   # ... their sum
        self.router: Router | None = None
        # adaptive: each worker's role in the regime, replanned as the arrivals change
        self.planner = Planner(list(range(len(self.devices))), slo) if policy == "adaptive" else None
        self.budgets_sent: dict[int, int | None] = {}
        self.batches: collections.deque[tuple[float, dict[int, int]]] = collections.deque()   # (time, decode batches)
        self.ended: list[int] = []            # ids ended since the last poll, wherever they ended
        self._ids = itertools.count()
        self.room = self._wait_ready(startup_timeout_s)

    def _start_workers(self, devices: list[str] | None, num_prefill: int, join: str | None, timeout_s: float) -> None:
        """Spawn a worker per device on this host, or listen at `join` for workers torchrun
        starts on their hosts (hosts.py); their roles under the policy."""
        report_steps = self.policy == "adaptive"
        exit_in_order_on_sigterm()   # a SIGTERM then stops the workers too, as any exit does
        if join is not None:
            self.workers = RemoteWorkers(join, self.cfg, self.transport, report_steps, timeout_s)
            self._close = weakref.finalize(self, self.workers.close)
            devices = [f"worker {w}" for w in range(self.workers.count)]   # named by their Ready
        self.devices = list(devices)
        if self.policy == "disaggregated" and not 0 < num_prefill < len(devices):
            raise ValueError(f"disaggregated needs 1 <= num_prefill < the number of workers, got num_prefill="
                             f"{num_prefill} with {len(devices)} workers")
        self.roles = (["prefill"] * num_prefill + ["decode"] * (len(devices) - num_prefill)
                      if self.policy == "disaggregated" else ["collocated"] * len(devices))
        if join is None:
            self.workers = WorkerProcesses(self.cfg, self.devices, self._sources(), self.transport, report_steps,
                                           [f"nanopd-{role}-{i}" for i, role in enumerate(self.roles)])
            self._close = weakref.finalize(self, self.workers.close)   # it holds the workers, not this object

    def _sources(self) -> list[list[int]]:
        """Whose KV cache each worker reads: decode workers every prefill worker's; under
        adaptive, every worker every other's."""
        n = len(self.devices)
        if not TRANSPORTS[self.transport].shares_caches:   # two-sided: nothing is shared
            return [[] for _ in range(n)]
        return [[j for j in range(n) if j != i and (self.policy == "adaptive" or
                 (self.roles[i], self.roles[j]) == ("decode", "prefill"))] for i in range(n)]

    def _wait_ready(self, timeout_s: float) -> int:
        """Block until every worker reports Ready; the smallest cache's room in blocks."""
        rooms, deadline = {}, time.monotonic() + timeout_s
        with tqdm(total=len(self.devices), desc="starting workers", leave=False, disable=None) as bar:
            while len(rooms) < len(self.devices):
                for w, reports in self.workers.receive(0.5, skip=set()):
                    for msg in reports:
                        if isinstance(msg, Ready):
                            rooms[w], self.kv_bytes_per_token = msg.num_blocks - msg.watermark_blocks, msg.kv_bytes_per_token
                            self.devices[w] = msg.device or self.devices[w]
                            self.status[w] = Heartbeat(msg.num_blocks, msg.num_blocks)
                            bar.update()
                        elif isinstance(msg, Failed):
                            self.errors[w] = msg.traceback
                failed = self.workers.exited()
                if failed or time.monotonic() > deadline:
                    error = self._start_error(failed[0] if failed else None, timeout_s)   # before close forgets them
                    self.close()
                    raise error
        self.heard = dict.fromkeys(range(len(self.devices)), time.monotonic())
        return min(rooms.values())

    def _start_error(self, w: int | None, timeout_s: float) -> Exception:
        """Why the cluster could not start: a worker's own ValueError (a setting its device
        cannot meet) as a ValueError, anything else as a RuntimeError naming the worker."""
        if w is None:
            return RuntimeError(f"a worker was not ready after {timeout_s:.0f} s")
        last = (self.errors.get(w, "").strip().splitlines() or [""])[-1]
        if last.startswith("ValueError: "):
            return ValueError(f"worker {w} ({self.devices[w]}): {last.removeprefix('ValueError: ')}")
        if not last:   # it died before it could say why: most often in the spawn bootstrap
            last = (f"{self.workers.why(w)}, before it ran (a script that starts "
                    "workers must do so under `if __name__ == \"__main__\":`)")
        return RuntimeError(f"worker {w} ({self.devices[w]}) did not start: {last}")

    def close(self) -> None:
        self._close()

    # -- requests

    def submit(self, prompt: str | list[int], params: SamplingParams, beam_width: int = 0,
               length_penalty: float = 1.0) -> int:
        """Validate (ValueError, as the single engine) and dispatch a request; its id."""
        text, ids = tokenize(prompt, self.tokenizer)
        params = check_request(ids, params, beam_width, self.vocab_size, self.cfg, self.room, length_penalty)
        t = Tracked(next(self._ids), text, ids, params, RequestMetrics(time.perf_counter()), beam_width,
                    length_penalty)
        self.active[t.request_id] = t
        if self.planner is not None and self.router is not None:
            predicted = self.router.predictor.predict(len(ids), params.max_tokens).mean
            self.planner.arrived(time.perf_counter(), len(ids), predicted)
        if self.policy != "collocated" and params.n > 1 and not beam_width:
            self._split_samples(t)
        else:
            self._dispatch(t)
        return t.request_id

    def _split_samples(self, t: Tracked) -> None:
        """n > 1 across workers: n requests of one sample each. Sample j draws from seed + j,
        as child j does in one engine."""
        for j in range(t.params.n):
            seed = None if t.params.seed is None else t.params.seed + j
            sample = Tracked(next(self._ids), t.prompt, t.prompt_token_ids,
                             dataclasses.replace(t.params, n=1, seed=seed), RequestMetrics(t.metrics.arrival_time),
                             parent=t.request_id)
            t.samples.append(sample.request_id)
            self.active[sample.request_id] = sample
            self._dispatch(sample)

    def _live(self, role: str) -> list[int]:
        return [i for i, r in enumerate(self.roles) if r == role and i not in self.dead]

    def _load(self, w: int) -> int:
        """Tokens of work a worker holds: prompts still to prefill and outputs still to decode."""
        load = 0
        for t in self.active.values():
            if t.worker == w and t.phase != "done":
                load += (len(t.prompt_token_ids) if t.phase == "prefill" else 0)
                load += 0 if self.roles[w] == "prefill" else t.params.max_tokens - len(t.tokens)
        return load

    def _dispatch(self, t: Tracked, path: tuple[int, int] | None = None) -> None:
        """Send t to its prefill (or whole-request) worker: path's, the router's pick, or the
        least loaded; t fails if no live worker can take it."""
        live = self._live("collocated" if self.policy != "disaggregated" else "prefill")
        if not live or (self.policy == "disaggregated" and not self._live("decode")):
            return self._fail(t, RuntimeError(f"no live worker can serve it (dead: {self._dead_summary()})"))
        if path is not None:
            w, t.decode_worker = path
        elif self.router is not None and not t.beam_width:
            loads = self.worker_loads(live)
            blocks = cdiv(len(t.prompt_token_ids) + t.params.max_tokens, self.cfg.block_size)
            w, t.decode_worker, predicted = self.router.route(
                len(t.prompt_token_ids), t.params.max_tokens, loads, blocks, self.planner.takers("prefill", live),
                self.planner.takers("decode", live))
            t.metrics.routed = (predicted, loads[w], loads[t.decode_worker])
        else:
            w = min(live, key=self._load)
            # Beam search runs whole on one worker (its beams fork and die every step).
            t.decode_worker = w if self.policy != "disaggregated" or t.beam_width else None
        t.worker = t.prefill_worker = w
        t.phase = "prefill"
        self.workers.send(w, Submit(t.request_id, t.prompt_token_ids, t.params, prefill_only=t.decode_worker != w,
                                    beam_width=t.beam_width, length_penalty=t.length_penalty))

    def worker_loads(self, workers: list[int]) -> dict[int, WorkerLoad]:
        """What the router weighs, per worker: prompts waiting for prefill, sequences
        decoding, free blocks, seats, and the prompt tokens per ms the workers' steps
        prefilled lately, shared by the workers that take prompts (router.WorkerLoad says
        why not each worker's own). One pass over the active requests."""
        now = time.perf_counter()
        while self.prefilled and now - self.prefilled[0][0] > PREFILL_RATE_WINDOW_S:
            self.prefilled_tokens -= self.prefilled.popleft()[1]
        takers = self.planner.takers("prefill", workers) if self.planner is not None else workers
        rate = self.prefilled_tokens / (PREFILL_RATE_WINDOW_S * 1e3) / max(1, len(takers))
        budgets = self.planner.budgets if self.planner is not None else {}
        loads = {w: WorkerLoad(free_blocks=self.status[w].free_blocks if w in self.status else self.room,
                               prefill_rate=rate if w in takers else 0.0, seats=self.cfg.max_num_seqs,
                               prefill_budget=budgets.get(w))
                 for w in workers}
        for t in self.active.values():
            load = loads.get(t.worker)
            if load is None:
                continue
            if t.phase == "prefill" and not t.tokens:
                load.queued_prefill_tokens += len(t.prompt_token_ids)
                load.queued_prefills += 1
            elif t.phase != "done":
                load.decode_batch += 1
                load.context_tokens += len(t.prompt_token_ids) + len(t.tokens)
        self._batch_growth(now, loads)
        return loads

    def _batch_growth(self, now: float, loads: dict[int, WorkerLoad]) -> None:
        """Each worker's decode batch growth, sequences per ms, over the last
        PREFILL_RATE_WINDOW_S: past saturation the batches grow while a request decodes."""
        if not self.batches or now - self.batches[-1][0] > 0.1:
            self.batches.append((now, {w: ld.decode_batch for w, ld in loads.items()}))
        while len(self.batches) > 1 and now - self.batches[1][0] > PREFILL_RATE_WINDOW_S:
            self.batches.popleft()
        then, batches = self.batches[0]
        if now - then > 0.5:   # a shorter span says more about noise than growth
            for w, ld in loads.items():
                ld.batch_growth = (ld.decode_batch - batches.get(w, ld.decode_batch)) / ((now - then) * 1e3)

    # -- reports from the workers

    def poll(self, timeout: float = 0.05) -> list[int]:
        """Handle what the workers reported, waiting up to timeout for it; the ids of the
        requests that ended since the last poll (submit's ids), wherever they ended."""
        for w, reports in self.workers.receive(timeout, skip=set(self.dead)):
            self.heard[w] = time.monotonic()
            for msg in reports:
                self._on_report(w, msg)
        for w in self.workers.exited():
            if w not in self.dead:
                self._worker_died(w)
        self._check_silent()
        if self.planner is not None and self.router is not None:
            self._replan()
        ended, self.ended = self.ended, []
        return ended

    def _replan(self) -> None:
        """Let the planner replan the regime (every planner.PLAN_INTERVAL_S); send the
        workers whose prefill budget changed their new one."""
        now = time.perf_counter()
        if not self.planner.due(now):   # the loads pass over every active request: not on every poll
            return
        live = [w for w in range(len(self.devices)) if w not in self.dead]
        if self.planner.plan(self.router.cost, self.worker_loads(live), self.cfg.max_num_seqs, now):
            for w, budget in self.planner.budgets.items():
                if self.budgets_sent.get(w) != budget:
                    self.workers.send(w, SetRole(self.planner.roles[w], budget))
                    self.budgets_sent[w] = budget
            log.info("regime %s, roles %s, budgets %s", self.planner.regime, self.planner.roles, self.planner.budgets)

    def _check_silent(self) -> None:
        """A live worker reports at least every workers.HEARTBEAT_S, busy or idle; one silent
        for worker_timeout_s (stopped, hung, or starved) is killed and treated as dead."""
        now = time.monotonic()
        for w, heard in self.heard.items():
            if w not in self.dead and now - heard > self.worker_timeout_s:
                self.workers.kill(w)
                self._worker_died(w, f"no report for {now - heard:.0f} s (worker_timeout_s={self.worker_timeout_s:g})")

    def _on_report(self, w: int, msg) -> None:
        """Handle one report of worker w."""
        match msg:
            case Failed():
                self.errors[w] = msg.traceback
            case Heartbeat():
                self.status[w] = msg
            case StepTimed():
                self._on_step(msg)
            case Measured():
                self.measured[w] = msg.timings
            case Tokens():
                for request_id, ids in msg.new.items():
                    t = self._current(w, request_id)
                    if t is not None:
                        t.tokens += ids
                        t.metrics.first_token_time = t.metrics.first_token_time or msg.time
            case Handoff():
                self._on_handoff(w, msg)
            case Imported():
                self._on_imported(w, msg)
            case Done():
                self._on_done(w, msg)
            case ToWorker() if msg.worker not in self.dead:
                self.workers.send(msg.worker, msg.msg)
            case Rejected() if self._current(w, msg.request_id):
                self._fail(self.active[msg.request_id], (ValueError if msg.invalid else RuntimeError)(msg.error))
            case PullFailed() if (t := self._current(w, msg.request_id)) and t.prefill_worker == msg.src:
                if msg.src not in self.dead:
                    self.workers.send(msg.src, Release(t.request_id))   # nobody will pull it now
                self._retry(t, f"its KV copy from worker {msg.src} to worker {w} failed: {msg.error}")
            case Expired() if self._current(w, msg.request_id, prefill_side=True):
                t = self.active[msg.request_id]
                if t.phase == "transfer":   # the decode worker must not pull the freed blocks now
                    self.workers.send(t.worker, Drop(t.request_id))
                    self._fail(t, RuntimeError(f"its KV was never pulled from worker {w}"))

    def _current(self, w: int, request_id: int, prefill_side: bool = False) -> Tracked | None:
        """The request, if w's report is about its current attempt (not one restarted elsewhere)."""
        t = self.active.get(request_id)
        if t is None or not (t.worker == w or (prefill_side and t.prefill_worker == w)):
            return None
        return t

    def _on_step(self, msg: StepTimed) -> None:
        """A step a worker timed: the router refits its step model; prefill tokens count
        toward the cluster's prefill rate."""
        if self.router is not None:
            self.router.observe_step(msg.decodes, msg.context_tokens, msg.prefill_tokens, msg.ms)
        if msg.prefill_tokens:
            self.prefilled.append((time.perf_counter(), msg.prefill_tokens))
            self.prefilled_tokens += msg.prefill_tokens

    def _on_handoff(self, w: int, msg: Handoff) -> None:
        """Forward the prefill worker's Import to the decode worker. Under adaptive, w
        itself may decode it (its planned decode worker died, say): the Import then keeps
        the blocks where they are."""
        t = self._current(w, msg.imp.request_id)
        if t is None:
            return
        imp = msg.imp
        t.metrics.first_scheduled_time, t.metrics.first_token_time = msg.first_scheduled_time, msg.first_token_time
        t.tokens = imp.token_ids[imp.num_prompt_tokens:]
        decoders = self._live("decode" if self.policy == "disaggregated" else "collocated")
        if self.planner is not None:
            decoders = self.planner.takers("decode", decoders)
        if not decoders:
            self.workers.send(w, Release(t.request_id))
            return self._fail(t, RuntimeError(f"no live decode worker (dead: {self._dead_summary()})"))
        d = t.decode_worker if t.decode_worker in decoders else min(decoders, key=self._load)
        t.worker, t.phase = d, "transfer"
        self.workers.send(d, imp)

    def _on_imported(self, w: int, msg: Imported) -> None:
        t = self._current(w, msg.request_id)
        if t is None:
            return
        m = t.metrics
        m.imported_time, m.kv_bytes_moved, m.kv_copy_time, m.seat_wait = msg.time, msg.nbytes, msg.copy_seconds, \
            msg.seat_wait
        t.phase = "decode"
        self.workers.send(t.prefill_worker, Release(t.request_id))

    def _on_done(self, w: int, msg: Done) -> None:
        """The worker's metrics fill in what this process did not see."""
        t = self._current(w, msg.request_id)
        if t is None:
            return
        m, theirs = t.metrics, msg.output.metrics
        m.first_scheduled_time = m.first_scheduled_time or theirs.first_scheduled_time
        m.first_token_time = m.first_token_time or theirs.first_token_time
        m.finish_time, m.num_cached_tokens = theirs.finish_time, theirs.num_cached_tokens
        m.path = (t.prefill_worker,) + ((w,) if w != t.prefill_worker else ())
        t.output = dataclasses.replace(msg.output, request_id=t.request_id, prompt=t.prompt, metrics=m)
        if self.router is not None and m.routed is not None:
            self._teach_router(t, w)
        self._end(t)

    def _teach_router(self, t: Tracked, w: int) -> None:
        """Feed the router what this request's path really cost."""
        phases, (predicted, load_p, load_d) = t.metrics.phases(), t.metrics.routed
        self.router.observe(Observation(
            len(t.prompt_token_ids), len(t.output.outputs[0].token_ids), t.prefill_worker, w, load_p, load_d,
            (phases["queued"] + phases["prefill"]) * 1e3, phases["transfer"] * 1e3,
            (phases["seat_wait"] + phases["decode"]) * 1e3,
            predicted, t.params.max_tokens))

    # -- endings

    def _end(self, t: Tracked) -> None:
        """Retire t; a top-level request that is now complete goes to `ended`."""
        t.phase = "done"
        self.done[t.request_id] = self.active.pop(t.request_id)
        if t.parent is None:
            self.ended.append(t.request_id)
            return
        parent = self.active[t.parent]
        if any(s not in self.done for s in parent.samples):
            return
        samples = [self.done.pop(s) for s in parent.samples]
        errors = [s.output.error for s in samples if s.output.error is not None]
        outs = [dataclasses.replace(s.output.outputs[0], index=j) for j, s in enumerate(samples) if not s.output.error]
        ms = [s.metrics for s in samples]
        parent.metrics = dataclasses.replace(ms[0], finish_time=max(m.finish_time or 0.0 for m in ms))
        parent.output = RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids,
                                      [] if errors else outs, parent.metrics, error=errors[0] if errors else None)
        self._end(parent)

    def _fail(self, t: Tracked, error: Exception) -> None:
        t.metrics.finish_time = time.perf_counter()
        t.output = RequestOutput(t.request_id, t.prompt, t.prompt_token_ids, [], t.metrics, error=error)
        self._end(t)

    def _worker_died(self, w: int, why: str | None = None) -> None:
        """Every request w held starts again from its prompt on a live worker, or fails."""
        why = [why] if why else (self.errors.get(w, "").strip().splitlines()[-1:] or [self.workers.why(w)])
        self.dead[w] = why[0]
        for t in list(self.active.values()):
            if t.samples or t.phase == "done":
                continue
            if t.phase == "transfer" and t.prefill_worker == w and t.worker != w:
                self.workers.send(t.worker, Drop(t.request_id))          # its source is gone: discard the copy
            elif t.phase == "transfer" and t.worker == w and t.prefill_worker not in self.dead:
                self.workers.send(t.prefill_worker, Release(t.request_id))   # nobody will pull it now
            if t.worker == w or (t.phase == "transfer" and t.prefill_worker == w):
                self._retry(t, f"worker {w} ({self.devices[w]}) died: {why[0]}")

    def _retry(self, t: Tracked, why: str) -> None:
        """Start the request again from its prompt on a live worker, once; the second time
        its path breaks it fails, with why."""
        if t.retried:
            self._fail(t, RuntimeError(why))
            return
        t.retried, t.tokens, t.worker, t.prefill_worker = True, [], None, None
        t.metrics = RequestMetrics(t.metrics.arrival_time)
        self._dispatch(t)

    def _dead_summary(self) -> str:
        return ", ".join(f"worker {w} ({self.devices[w]}): {why}" for w, why in self.dead.items()) or "none"

    def output(self, request_id: int) -> RequestOutput:
        """An ended request's output; the cluster forgets it."""
        return self.done.pop(request_id).output

    def abort(self, request_ids: list[int]) -> None:
        """End these requests now and forget them: every worker that may hold one (its
        worker, and the prefill worker where its KV may be parked) is told to drop it."""
        for request_id in request_ids:
            self.done.pop(request_id, None)
            t = self.active.pop(request_id, None)
            if t is None:
                continue
            self.abort(t.samples)
            for w in {t.worker, t.prefill_worker} - {None} - set(self.dead):
                self.workers.send(w, Abort(request_id))

    # -- for the profiler

    def measure(self, w: int, spec: dict, timeout_s: float = 600.0) -> dict:
        """Run timing.measure_engine(**spec) on idle worker w; its timings."""
        self.measured.pop(w, None)
        self.workers.send(w, Measure(spec))
        deadline = time.monotonic() + timeout_s
        while w not in self.measured:
            self._poll_keeping_others(0.05)
            if w in self.dead or time.monotonic() > deadline:
                raise RuntimeError(f"worker {w} did not finish measuring: {self.dead.get(w, 'timed out')}")
        return self.measured.pop(w)

    def run_on_path(self, prompt_ids: list[int], path: tuple[int, int], max_tokens: int = 2) -> RequestMetrics:
        """Serve one request on a given (prefill worker, decode worker); its metrics."""
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        t = Tracked(next(self._ids), None, prompt_ids, params, RequestMetrics(time.perf_counter()))
        self.active[t.request_id] = t
        self._dispatch(t, path)
        while t.request_id not in self.done:
            self._poll_keeping_others(0.05)
        self.ended.remove(t.request_id)
        return self.output(t.request_id).metrics

    def _poll_keeping_others(self, timeout: float) -> None:
        """Poll, leaving the ids it ends for the caller's next poll."""
        self.ended = self.poll(timeout)


def default_devices() -> list[str]:
    """Every GPU, or two CPU workers."""
    return [f"cuda:{i}" for i in range(torch.cuda.device_count())] or ["cpu", "cpu"]


def check_cluster(policy: str, devices: list[str] | None, num_prefill: int, transport: str,
                  worker_timeout_s: float, slo: tuple[float, float] | None = None, join: str | None = None) -> None:
    """Raise a ValueError naming the first bad cluster setting, before any worker starts."""
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r} is not one of {', '.join(POLICIES)}")
    if transport not in TRANSPORTS:
        raise ValueError(f"transport {transport!r} is not one of {', '.join(TRANSPORTS)}")
    if join is not None:   # the workers are on their hosts, torchrun's: their devices are theirs
        parse_address(join)
        if devices is not None or transport != "distributed":
            raise ValueError("join (workers on other hosts) takes transport='distributed' and no devices")
        devices = ["cpu"]
    if not isinstance(devices, list | tuple) or not devices:
        raise ValueError(f"devices must be a non-empty list of device names, got {devices!r}")
    check_int("num_prefill", num_prefill, low=0)
    check_real("worker_timeout_s", worker_timeout_s)
    if worker_timeout_s <= 2 * HEARTBEAT_S:
        raise ValueError(f"worker_timeout_s must be above {2 * HEARTBEAT_S:g} s (the workers' heartbeat "
                         f"is {HEARTBEAT_S:g} s), got {worker_timeout_s}")
    if slo is not None:
        if policy != "adaptive":
            raise ValueError(f"slo applies to the adaptive policy (it steers its router), not to {policy}")
        if not isinstance(slo, list | tuple) or len(slo) != 2:
            raise ValueError(f"slo must be (ttft_s, tpot_s), got {slo!r}")
        for name, value in zip(("slo's ttft_s", "slo's tpot_s"), slo):
            check_real(name, value)
            if value <= 0:
                raise ValueError(f"{name} must be above 0, got {value}")
    if len({check_device(d).type for d in devices}) > 1:   # the KV handoff shares caches of one kind
        raise ValueError(f"devices {list(devices)} mix cpu and cuda")
    if transport == "distributed" and str(devices[0]).startswith("cuda") and len(set(map(str, devices))) < len(devices):
        raise ValueError(f"the distributed transport (NCCL) needs a GPU of its own per worker, got {list(devices)}")
