"""nanoPD's front: the offline LLM API, the CentralScheduler that serves it on worker
processes under a policy, and the CLI.

    from nanopd import LLM, SamplingParams
    outs = LLM("tiny").generate(["Hello"], SamplingParams(max_tokens=32))
    outs = LLM("qwen3-8b", policy="disaggregated", devices=["cuda:0", "cuda:1"]).generate(...)

Without a policy, LLM runs one Engine (engine.py) in this process. With one, the
CentralScheduler starts a worker process per device (workers.py) and routes requests:
collocated (each worker prefills and decodes) or disaggregated (prefill workers hand
their KV to decode workers).
"""

import argparse
import collections
import dataclasses
import itertools
import multiprocessing.connection
import time
import weakref
from dataclasses import dataclass, field
from typing import Self

import torch
from tqdm import tqdm

from engine import Engine, EngineConfig, check_device, check_request, load_tokenizer
from kv_cache import cdiv
from model import load_config
from profiler import profile_cluster
from router import HardwareParams, Observation, Router, WorkerLoad
from scheduler import RequestMetrics, RequestOutput, SamplingParams
from workers import TRANSPORTS, Drop, Measure, Release, Submit, worker_main

__all__ = ["LLM", "CentralScheduler", "RequestMetrics", "RequestOutput", "SamplingParams"]


# ----------------------------------------------------------------------------- many devices: the central scheduler

POLICIES = ("collocated", "disaggregated", "adaptive")
PREFILL_RATE_WINDOW_S = 2.0   # the prefill rate counts the steps reported this long ago at most


@dataclass(eq=False)
class Tracked:
    """The central scheduler's record of one request."""
    rid: int
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    beam_width: int = 0
    length_penalty: float = 1.0
    worker: int | None = None          # where it runs now (its decode worker once handed off)
    prefill_worker: int | None = None
    phase: str = "queued"              # prefill, transfer, decode, done
    tokens: list[int] = field(default_factory=list)   # streamed so far
    output: RequestOutput | None = None
    metrics: RequestMetrics | None = None
    retried: bool = False
    samples: list[int] = field(default_factory=list)  # n > 1 split into samples (not collocated)
    parent: int | None = None
    decode_worker: int | None = None   # adaptive: where the router sends it after prefill


class CentralScheduler:
    """Serves requests on worker processes (workers.py), one per device, under a policy:

      collocated     every device runs a whole engine; a request goes to the least loaded
      disaggregated  num_prefill devices prefill, the others decode; a prefilled request's
                     KV moves to the decode worker with the fewest requests
      adaptive       every device can do both; per request the Router (router.py) picks
                     the prefill and the decode worker by predicted cost (the same one:
                     collocated), and learns from what each request really cost

    A worker that dies: the requests it held (prefilling, decoding, or with KV parked on
    it for a transfer) start again from their prompt on live workers, once; if no live
    worker can take them, or they fail a second time, they end with a RuntimeError in
    RequestOutput.error. Nothing waits on a dead worker. close() (also run at exit and
    when the object is collected) stops every worker process."""

    def __init__(self, model: str, policy: str, devices: list[str], num_prefill: int = 1,
                 transport: str = "p2p", profile: "HardwareParams | bool | None" = None,
                 startup_timeout_s: float = 600.0, **engine_kwargs):
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r} is not one of {', '.join(POLICIES)}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport {transport!r} is not one of {', '.join(TRANSPORTS)}")
        if not devices:
            raise ValueError("devices is empty")
        if len({check_device(d).type for d in devices}) > 1:   # the KV handoff shares caches of one kind
            raise ValueError(f"devices {list(devices)} mix cpu and cuda")
        if policy == "disaggregated" and not 0 < num_prefill < len(devices):
            raise ValueError(f"disaggregated needs 1 <= num_prefill < len(devices), got num_prefill={num_prefill} "
                             f"with {len(devices)} devices")
        self.cfg = EngineConfig(model=model, **engine_kwargs)
        self.cfg.validate()
        config = load_config(model)
        self.cfg.max_model_len = min(self.cfg.max_model_len, config.max_position_embeddings)
        self.vocab_size, self.tokenizer = config.vocab_size, load_tokenizer(model)
        self.policy, self.devices, self.transport = policy, list(devices), transport
        self.roles = (["prefill"] * num_prefill + ["decode"] * (len(devices) - num_prefill)
                      if policy == "disaggregated" else ["collocated"] * len(devices))
        ctx = torch.multiprocessing.get_context("spawn")
        # Reports come back on one pipe per worker: a worker killed in the middle of a
        # write can break only its own pipe (a queue shared by all would stay locked).
        pipes = [ctx.Pipe(duplex=False) for _ in devices]
        self.reports = [reader for reader, _ in pipes]
        self.inboxes = [ctx.Queue() for _ in devices]
        # Whose KV cache each worker reads: decode workers every prefill worker's; under
        # adaptive, every worker every other's.
        sources = [[j for j in range(len(devices)) if j != i and (policy == "adaptive" or
                    (self.roles[i], self.roles[j]) == ("decode", "prefill"))] for i in range(len(devices))]
        shares = [ctx.Queue() if sources[i] else None for i in range(len(devices))]
        self.procs = []
        for i, (role, device) in enumerate(zip(self.roles, devices)):
            kwargs = dataclasses.asdict(self.cfg) | {"device": device}
            readers = [shares[j] for j in range(len(devices)) if i in sources[j]]
            args = (i, kwargs, self.inboxes[i], pipes[i][1], readers, shares[i], len(sources[i]), transport,
                    policy == "adaptive" and profile is not False)   # only a router reads steps
            self.procs.append(ctx.Process(target=worker_main, args=args, daemon=True, name=f"nanopd-{role}-{i}"))
        self._close = weakref.finalize(self, _stop_workers, self.procs, self.inboxes, self.reports)
        for p, (_, writer) in zip(self.procs, pipes):
            p.start()
            writer.close()   # the worker holds the only writing end now
        self.active: dict[int, Tracked] = {}
        self.done: dict[int, Tracked] = {}
        self.dead: dict[int, str] = {}
        self.errors: dict[int, str] = {}
        self.status: dict[int, tuple[int, int, int]] = {}   # worker -> its last (free blocks, blocks, requests)
        self.measured: dict[int, dict] = {}
        self.prefilled: collections.deque[tuple[float, int]] = collections.deque()   # (time, tokens) steps prefilled
        self.prefilled_tokens = 0   # ... their sum
        self._rids = itertools.count()
        self.room = self._wait_ready(startup_timeout_s)
        self.router = None
        if policy == "adaptive" and profile is not False:
            self.profile = profile if isinstance(profile, HardwareParams) else profile_cluster(self).params
            self.router = Router(dataclasses.replace(self.profile))

    def _wait_ready(self, timeout_s: float) -> int:
        """Block until every worker reports ready; the smallest cache's room in blocks."""
        rooms, deadline = {}, time.monotonic() + timeout_s
        with tqdm(total=len(self.procs), desc="starting workers", leave=False) as bar:
            while len(rooms) < len(self.procs):
                for w, events in self._receive(0.5):
                    for event in events:
                        if event[0] == "ready":
                            rooms[w], self.kv_bytes_per_token = event[1] - event[2], event[3]
                            self.status[w] = (event[1], event[1], 0)   # all blocks free, nothing held
                            bar.update()
                        elif event[0] == "failed":
                            self.errors[w] = event[1]
                failed = [i for i, p in enumerate(self.procs) if not p.is_alive()]
                if failed or time.monotonic() > deadline:
                    self.close()
                    i = failed[0] if failed else None
                    why = self.errors.get(i, "no traceback") if failed else f"not ready after {timeout_s:.0f} s"
                    raise RuntimeError(f"worker {i} ({self.devices[i] if failed else '?'}) did not start: {why}")
        return min(rooms.values())

    def close(self) -> None:
        self._close()

    # -- requests

    def submit(self, prompt: str | list[int], params: SamplingParams, beam_width: int = 0,
               length_penalty: float = 1.0) -> int:
        """Validate (ValueError, as the single engine) and dispatch a request; its id."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_request(ids, params, beam_width, self.vocab_size, self.cfg, self.room)
        t = Tracked(next(self._rids), prompt if isinstance(prompt, str) else None, ids, params, beam_width,
                    length_penalty, metrics=RequestMetrics(time.perf_counter()))
        self.active[t.rid] = t
        if self.policy != "collocated" and params.n > 1 and not beam_width:
            # Samples travel separately; sample j draws from seed + j, as a child does in one engine.
            for j in range(params.n):
                seed = None if params.seed is None else params.seed + j
                sample = Tracked(next(self._rids), t.prompt, ids, dataclasses.replace(params, n=1, seed=seed),
                                 metrics=RequestMetrics(t.metrics.arrival_time), parent=t.rid)
                t.samples.append(sample.rid)
                self.active[sample.rid] = sample
                self._dispatch(sample)
        else:
            self._dispatch(t)
        return t.rid

    def _live(self, role: str) -> list[int]:
        return [i for i, r in enumerate(self.roles) if r == role and i not in self.dead]

    def _load(self, w: int) -> int:
        """Tokens of work a worker holds: prompts still to prefill and outputs still to decode."""
        load = 0
        for t in self.active.values():
            if t.worker == w and t.phase != "done":
                load += (len(t.prompt_ids) if t.phase == "prefill" else 0)
                load += 0 if self.roles[w] == "prefill" else t.params.max_tokens - len(t.tokens)
        return load

    def _dispatch(self, t: Tracked, path: tuple[int, int] | None = None) -> None:
        """Send t to its prefill (or whole-request) worker: path's, the router's pick, or the least loaded."""
        live = self._live("collocated" if self.policy != "disaggregated" else "prefill")
        if not live or (self.policy == "disaggregated" and not self._live("decode")):
            return self._fail(t, RuntimeError(f"no live worker can serve it (dead: {self._dead_summary()})"))
        if path is not None:
            w, t.decode_worker = path
        elif self.router is not None and not t.beam_width:
            loads = self.worker_loads(live)
            blocks = cdiv(len(t.prompt_ids) + t.params.max_tokens, self.cfg.block_size)
            w, t.decode_worker, predicted = self.router.route(len(t.prompt_ids), t.params.max_tokens, loads, blocks)
            t.metrics.routed = (predicted, loads[w], loads[t.decode_worker])
        else:
            w = min(live, key=self._load)
            # Beam search runs whole on one worker (its beams fork and die every step).
            t.decode_worker = w if self.policy != "disaggregated" or t.beam_width else None
        t.worker = t.prefill_worker = w
        t.phase = "prefill"
        self.inboxes[w].put(Submit(t.rid, t.prompt_ids, t.params, prefill_only=t.decode_worker != w,
                                   beam_width=t.beam_width, length_penalty=t.length_penalty))

    def worker_loads(self, workers: list[int]) -> dict[int, WorkerLoad]:
        """What the router weighs, per worker: prompts waiting for prefill, sequences
        decoding, free blocks, seats, and the prompt tokens per ms the workers' steps
        prefilled lately, per worker (router.WorkerLoad says why not each worker's own).
        One pass over the active requests."""
        now = time.perf_counter()
        while self.prefilled and now - self.prefilled[0][0] > PREFILL_RATE_WINDOW_S:
            self.prefilled_tokens -= self.prefilled.popleft()[1]
        rate = self.prefilled_tokens / (PREFILL_RATE_WINDOW_S * 1e3) / max(1, len(self.procs) - len(self.dead))
        loads = {w: WorkerLoad(free_blocks=self.status[w][0] if w in self.status else self.room,
                               prefill_rate=rate, seats=self.cfg.max_num_seqs) for w in workers}
        for t in self.active.values():
            load = loads.get(t.worker)
            if load is None:
                continue
            if t.phase == "prefill" and not t.tokens:
                load.queued_prefill_tokens += len(t.prompt_ids)
                load.queued_prefills += 1
            elif t.phase != "done":
                load.decode_batch += 1
                load.context_tokens += len(t.prompt_ids) + len(t.tokens)
        return loads

    # -- events from the workers

    def poll(self, timeout: float = 0.05) -> list[int]:
        """Handle what the workers reported; the ids of requests that ended (submit's ids)."""
        ended = []
        for w, events in self._receive(timeout):
            if w in self.dead:
                continue
            for event in events:
                ended += self._on_event(w, event)
        for i, p in enumerate(self.procs):
            if i not in self.dead and not p.is_alive():
                ended += self._worker_died(i)
        return ended

    def _receive(self, timeout: float) -> list[tuple[int, list[tuple]]]:
        """Every report waiting on the live workers' pipes, waiting up to timeout for one."""
        live = [r for i, r in enumerate(self.reports) if i not in self.dead and not r.closed]
        got = []
        for reader in multiprocessing.connection.wait(live, timeout):
            try:
                while reader.poll():
                    got.append(reader.recv())
            except (EOFError, OSError):   # its worker died; the liveness check handles the rest
                reader.close()
        return got

    def _on_event(self, w: int, event: tuple) -> list[int]:
        kind = event[0]
        if kind == "failed":
            self.errors[w] = event[1]
            return []
        if kind == "status":   # (free KV blocks, all KV blocks, requests held)
            self.status[w] = event[1:]
            return []
        if kind == "step":   # (decodes, their context tokens, prefill tokens, ms): the router refits
            if self.router is not None:
                self.router.observe_step(*event[1:])
            if event[3]:
                self.prefilled.append((time.perf_counter(), event[3]))
                self.prefilled_tokens += event[3]
            return []
        if kind == "measured":
            self.measured[w] = event[1]
            return []
        if kind == "tokens":
            for rid, ids in event[1].items():
                t = self.active.get(rid)
                if t is not None and t.worker == w:
                    t.tokens += ids
                    t.metrics.first_token_time = t.metrics.first_token_time or event[2]
            return []
        t = self.active.get(event[1].rid if kind == "handoff" else event[1])
        if t is None or (kind != "handoff" and t.worker != w and not (kind == "expired" and t.prefill_worker == w)):
            return []   # a stale report from an attempt that was restarted elsewhere
        if kind == "handoff":   # forward the prefill worker's Import to the decode worker
            _, imp, t.metrics.first_scheduled_time, t.metrics.first_token_time = event
            t.tokens = imp.token_ids[imp.num_prompt_tokens:]
            # Under adaptive, w itself may decode it (its planned decode worker died, say):
            # the Import then keeps the blocks where they are.
            decoders = self._live("decode" if self.policy == "disaggregated" else "collocated")
            if not decoders:
                self.inboxes[w].put(Release(imp.rid))
                return self._fail(t, RuntimeError(f"no live decode worker (dead: {self._dead_summary()})"))
            d = t.decode_worker if t.decode_worker in decoders else min(decoders, key=self._load)
            t.worker, t.phase = d, "transfer"
            self.inboxes[d].put(imp)
        elif kind == "imported":
            _, _, t.metrics.imported_time, t.metrics.kv_bytes_moved, t.metrics.kv_copy_time, t.metrics.seat_wait = event
            t.phase = "decode"
            self.inboxes[t.prefill_worker].put(Release(t.rid))
        elif kind == "done":   # the worker's metrics fill in what this process did not see
            _, _, output, theirs = event
            m = t.metrics
            m.first_scheduled_time = m.first_scheduled_time or theirs.first_scheduled_time
            m.first_token_time = m.first_token_time or theirs.first_token_time
            m.finish_time, m.num_cached_tokens = theirs.finish_time, theirs.num_cached_tokens
            m.path = (t.prefill_worker,) + ((w,) if w != t.prefill_worker else ())
            t.output = dataclasses.replace(output, request_id=t.rid, prompt=t.prompt, metrics=m)
            if self.router is not None and m.routed is not None:
                self._teach_router(t, w)
            return self._end(t)
        elif kind == "rejected":
            return self._fail(t, ValueError(event[2]))
        elif kind == "expired" and t.phase == "transfer":
            return self._fail(t, RuntimeError(f"its KV was never pulled from worker {w}"))
        return []

    def _teach_router(self, t: Tracked, w: int) -> None:
        """Feed the router what this request's path really cost."""
        phases, (predicted, load_p, load_d) = t.metrics.phases(), t.metrics.routed
        self.router.observe(Observation(
            len(t.prompt_ids), len(t.output.outputs[0].token_ids), t.prefill_worker, w, load_p, load_d,
            (phases["queued"] + phases["prefill"]) * 1e3, phases["transfer"] * 1e3,
            (phases["seat_wait"] + phases["decode"]) * 1e3,
            predicted, t.params.max_tokens))

    # -- for the profiler

    def measure(self, w: int, spec: dict, timeout_s: float = 600.0) -> dict:
        """Run profiler.measure_engine(**spec) on idle worker w; its timings."""
        self.measured.pop(w, None)
        self.inboxes[w].put(Measure(spec))
        deadline = time.monotonic() + timeout_s
        while w not in self.measured:
            self.poll(0.05)
            if w in self.dead or time.monotonic() > deadline:
                raise RuntimeError(f"worker {w} did not finish measuring: {self.dead.get(w, 'timed out')}")
        return self.measured.pop(w)

    def run_on_path(self, prompt_ids: list[int], path: tuple[int, int], max_tokens: int = 2) -> RequestMetrics:
        """Serve one request on a given (prefill worker, decode worker); its metrics."""
        t = Tracked(next(self._rids), None, prompt_ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                    metrics=RequestMetrics(time.perf_counter()))
        self.active[t.rid] = t
        self._dispatch(t, path)
        while t.rid not in self.done:
            self.poll(0.05)
        return self.done[t.rid].output.metrics

    def _end(self, t: Tracked) -> list[int]:
        """Retire t; the ids of top-level requests that are now complete."""
        t.phase = "done"
        self.done[t.rid] = self.active.pop(t.rid)
        if t.parent is None:
            return [t.rid]
        parent = self.active[t.parent]
        samples = [self.done.get(r) for r in parent.samples]
        if any(s is None for s in samples):
            return []
        errors = [s.output.error for s in samples if s.output.error is not None]
        outs = [dataclasses.replace(s.output.outputs[0], index=j) for j, s in enumerate(samples) if not s.output.error]
        ms = [s.metrics for s in samples]
        parent.metrics = dataclasses.replace(ms[0], finish_time=max(m.finish_time or 0.0 for m in ms))
        parent.output = RequestOutput(parent.rid, parent.prompt, parent.prompt_ids, [] if errors else outs,
                                      parent.metrics, error=errors[0] if errors else None)
        return self._end(parent)

    def _fail(self, t: Tracked, error: Exception) -> list[int]:
        t.metrics.finish_time = time.perf_counter()
        t.output = RequestOutput(t.rid, t.prompt, t.prompt_ids, [], t.metrics, error=error)
        return self._end(t)

    def _worker_died(self, w: int) -> list[int]:
        why = self.errors.get(w, "").strip().splitlines()[-1:] or [f"exit code {self.procs[w].exitcode}"]
        self.dead[w] = why[0]
        ended = []
        for t in list(self.active.values()):
            if t.samples or t.phase == "done":
                continue
            if t.phase == "transfer" and t.prefill_worker == w and t.worker != w:
                self.inboxes[t.worker].put(Drop(t.rid))          # its source is gone: discard the copy
            elif t.phase == "transfer" and t.worker == w and t.prefill_worker not in self.dead:
                self.inboxes[t.prefill_worker].put(Release(t.rid))   # nobody will pull it now
            if t.worker == w or (t.phase == "transfer" and t.prefill_worker == w):
                if t.retried:
                    ended += self._fail(t, RuntimeError(f"worker {w} ({self.devices[w]}) died: {why[0]}"))
                else:   # start again from the prompt on a live worker
                    t.retried, t.tokens, t.worker, t.prefill_worker = True, [], None, None
                    t.metrics = RequestMetrics(t.metrics.arrival_time)
                    self._dispatch(t)
                    ended += [t.rid] if t.phase == "done" else []
        return ended

    def _dead_summary(self) -> str:
        return ", ".join(f"worker {w} ({self.devices[w]}): {why}" for w, why in self.dead.items()) or "none"

    def output(self, rid: int) -> RequestOutput:
        return self.done[rid].output


def _stop_workers(procs: list, inboxes: list, reports: list, timeout_s: float = 10.0) -> None:
    """Ask every worker to stop, then terminate (and at last kill) the ones that do not."""
    for q in inboxes:
        try:
            q.put(None)
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + timeout_s
    for p in procs:
        if p.pid is not None:
            p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.terminate()
            p.join(2)
            if p.is_alive():
                p.kill()
                p.join(2)
    for q in inboxes:
        q.cancel_join_thread()
        q.close()
    for reader in reports:
        reader.close()


# ----------------------------------------------------------------------------- the offline API


class LLM:
    """The offline API: LLM(model, **EngineConfig fields).generate(prompts, params).

    Without a policy it is one engine in this process. With policy="collocated" or
    "disaggregated" it serves the same calls on worker processes, one per entry of
    devices (a CentralScheduler); close() stops them (so does exiting, or `with LLM(...)`)."""

    def __init__(self, model: str = "tiny", policy: str | None = None, devices: list[str] | None = None,
                 num_prefill: int = 1, transport: str = "p2p", profile: "HardwareParams | bool | None" = None,
                 **kwargs):
        self.engine = self.cluster = None
        if policy is None:
            given = [name for name, value, default in [("devices", devices, None), ("num_prefill", num_prefill, 1),
                                                       ("transport", transport, "p2p"), ("profile", profile, None)]
                     if value != default]
            if given:
                raise ValueError(f"{', '.join(given)} only apply with a policy (collocated, disaggregated, adaptive); "
                                 "without one, LLM is a single engine on `device`")
            self.engine = Engine(EngineConfig(model=model, **kwargs))
        else:
            if devices is None:   # every GPU, or two CPU workers
                devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())] or ["cpu", "cpu"]
            self.cluster = CentralScheduler(model, policy, devices, num_prefill, transport, profile, **kwargs)

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: list[str] | list[list[int]] | str, params: SamplingParams | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Outputs in the order of prompts. A prompt that fails validation gets an output with
        .error set (a ValueError saying why) and no completions; the others still run."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run([(p, params or SamplingParams(), {}) for p in prompts], use_tqdm)

    def beam_search(self, prompts: list[str] | list[list[int]], beam_width: int, max_tokens: int,
                    ignore_eos: bool = False, length_penalty: float = 1.0,
                    use_tqdm: bool = True) -> list[RequestOutput]:
        """Beams best first (score = cumulative logprob / output length ** length_penalty);
        outputs[j].cumulative_logprob holds each beam's sum of token logprobs."""
        if beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {beam_width}")
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
        extra = {"beam_width": beam_width, "length_penalty": length_penalty}
        return self._run([(p, params, extra) for p in prompts], use_tqdm)

    def _run(self, work, use_tqdm: bool) -> list[RequestOutput | None]:
        if self.cluster is not None:
            return self._run_cluster(work, use_tqdm)
        engine, outputs, reqs = self.engine, [None] * len(work), {}
        for i, (prompt, params, extra) in enumerate(work):
            try:
                reqs[engine.add_request(prompt, params, **extra).request_id] = i
            except ValueError as e:
                ids = prompt if isinstance(prompt, list) else []
                outputs[i] = RequestOutput(-1, prompt if isinstance(prompt, str) else None, ids, [],
                                           RequestMetrics(time.perf_counter()), error=e)
        bar = tqdm(total=len(reqs), desc="generating", disable=not use_tqdm or len(reqs) < 2)
        while engine.has_unfinished():
            for req in engine.step():
                outputs[reqs[req.request_id]] = engine.output(req)
                bar.update()
        bar.close()
        return outputs

    def _run_cluster(self, work, use_tqdm: bool) -> list[RequestOutput | None]:
        cluster, outputs, rids = self.cluster, [None] * len(work), {}
        for i, (prompt, params, extra) in enumerate(work):
            try:
                rids[cluster.submit(prompt, params, **extra)] = i
            except ValueError as e:
                ids = prompt if isinstance(prompt, list) else []
                outputs[i] = RequestOutput(-1, prompt if isinstance(prompt, str) else None, ids, [],
                                           RequestMetrics(time.perf_counter()), error=e)
        with tqdm(total=len(rids), desc="generating", disable=not use_tqdm or len(rids) < 2) as bar:
            pending = set(rids)
            while pending:
                for rid in cluster.poll():
                    if rid in pending:
                        outputs[rids[rid]] = cluster.output(rid)
                        pending.discard(rid)
                        bar.update()
        return outputs


def main() -> None:
    p = argparse.ArgumentParser(description="nanoPD: generate text, streaming it as it comes")
    p.add_argument("--model", default="qwen3-8b" if torch.cuda.is_available() else "tiny",
                   help="preset (tiny, qwen3-0.6b, qwen3-8b) or a local HF checkpoint folder")
    p.add_argument("--prompt", default="The quick brown fox")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16")
    args = p.parse_args()
    try:
        engine = Engine(EngineConfig(model=args.model, dtype=args.dtype))
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed)
        req = engine.add_request(args.prompt, params)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    print(f"{args.model} on {engine.model.device} ({engine.model.dtype}), "
          f"{engine.runner.num_blocks} KV blocks; prompt: {len(req.prompt_token_ids)} tokens")
    printed, start = "", time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        text = engine.tokenizer.decode(req.seqs[0].output_ids, skip_special_tokens=True)
        if engine.has_unfinished():   # a trailing U+FFFD may be a character still missing bytes
            text = text.rstrip("\ufffd")
        print(text[len(printed):], end="", flush=True)
        printed = text
    n, elapsed = len(req.seqs[0].output_ids), time.perf_counter() - start
    print(f"\n[{n} tokens in {elapsed:.2f} s: {n / elapsed:.1f} tokens/s]")


if __name__ == "__main__":
    main()
