"""Worker processes: one Engine per device, in a role (roles.py: both, prefill, decode or
split), and the handoff of a request's KV from a prefill worker to a decode worker.

    central scheduler (cluster.py)
        | Submit / Import / Release / Drop          ^ Tokens, Done, Handoff, Imported, Heartbeat, ...
        v  (one inbox queue per worker)             |  (one pipe per worker)
    worker 0 (prefill, cuda:0)  ==KV blocks==>  worker 1 (decode, cuda:1)

Control travels as the small dataclasses of messages.py. Tensors cross a queue only at
start-up: each prefill worker hands its whole KV cache to every decode worker once (CUDA
IPC on GPUs, shared memory on CPUs), so per request only block ids travel. A handoff:
  1. the prefill worker samples a request's first token and parks the request: its blocks
     stay allocated; it reports a Handoff (an Import naming its blocks);
  2. the central scheduler picks a decode worker and forwards it the Import;
  3. the decode worker waits for a seat and blocks, then pulls the data on a stream of its
     transport's own (transport.py), so the decodes it is running are not stalled; when
     the copy's event has completed the request joins its batch and it reports Imported;
  4. the central scheduler sends Release to the prefill worker, which frees the blocks.
A parked request nobody pulls is released after HANDOFF_TIMEOUT_S. Under the adaptive
policy every step a worker runs (a drafting step's excepted: speculate.py) is reported
too, with its shape and time (StepTimed): the router refits its model of a step on them
(router.py).
"""

import ast
import contextlib
import datetime
import multiprocessing.connection
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanopd.config import EngineConfig
from nanopd.controller import (
    CONTROL_INTERVAL_S,
    REACT_S,
    Config,
    Controller,
    Recent,
    snapshot,
)
from nanopd.engine import Engine, LaunchedStep
from nanopd.handoff import worker_engine
from nanopd.kv_cache import cdiv
from nanopd.lanes import SplitEngine, SplitLane
from nanopd.messages import (
    Abort,
    Configured,
    Control,
    Done,
    Drop,
    Expired,
    Failed,
    Handoff,
    Heartbeat,
    Import,
    Imported,
    Measure,
    Measured,
    PullFailed,
    Ready,
    Rejected,
    Release,
    SendKV,
    SetRole,
    StepTimed,
    Stop,
    Submit,
    Tokens,
    ToWorker,
)
from nanopd.request import Request, RequestMetrics, Sequence, arrival_order, seeded_generator
from nanopd.smsplit import load_kernels_at_start
from nanopd.timing import measure_engine
from nanopd.transport import RECEIVE_TIMEOUT_S, TRANSPORTS, DistributedTransport, Pull

HANDOFF_TIMEOUT_S = RECEIVE_TIMEOUT_S   # parked blocks are freed after this long without a Release
IDLE_WAIT_S = 0.02          # how long an idle worker blocks on its inbox before looking again
HEARTBEAT_S = 1.0           # a worker reports at least this often, busy or idle
GROUP_TIMEOUT_S = 600.0     # the workers' process group: joining it, and its operations


# ----------------------------------------------------------------------------- the worker loop


def imported_sequence(m: Import, block_table: list[int], device: torch.device, cls: type[Sequence] = Sequence
                      ) -> Sequence:
    """The decoding sequence of a request prefilled elsewhere (of the engine's class, cls),
    its prompt's KV copied into block_table and its first token m.token_ids[-1], its random
    stream where the prefill worker left it."""
    req = Request(m.request_id, None, m.token_ids[:m.num_prompt_tokens], m.params,
                  RequestMetrics(time.perf_counter()), num_streamed=1,   # the first token was streamed there
                  prompt_logprobs=None if m.prompt_logprobs is None else list(m.prompt_logprobs))
    seq = cls(req, 0, list(m.token_ids), m.num_prompt_tokens, block_table=block_table,
                   num_computed=m.num_prompt_tokens, cumulative_logprob=m.cumulative_logprob,
                   logprobs=list(m.logprobs), generator=seeded_generator(m.params, 0, device))
    if m.generator_state is not None:
        seq.generator.set_state(torch.frombuffer(bytearray(m.generator_state), dtype=torch.uint8))
    req.seqs.append(seq)
    return seq


class ParentGone(Exception):
    """The central scheduler is gone (the process that started this worker, or the store a
    worker on another host talks to it through): nothing will come, nobody reads."""


def parent_gone() -> bool:
    """Whether this process was started by another (spawn) that has ended since."""
    parent = mp.parent_process()
    return parent is not None and not parent.is_alive()


def report(outbox, msgs: list) -> bool:
    """Send one round's reports; False if nobody will read them: the central scheduler has
    closed our pipe, or died (a broken pipe is then the normal way to learn it, no error)."""
    try:
        outbox.send(msgs)
    except (BrokenPipeError, ConnectionResetError, ParentGone):
        return False
    return True


@dataclass
class Transfer:
    """An Import on this worker: waiting for a seat and blocks, then its copy in flight."""
    msg: Import
    arrived: float                      # when the Import came in
    order: int = field(default_factory=arrival_order)   # first come, first served with the prompts here
    block_table: list[int] | None = None   # ours, once started
    pull: Pull | None = None
    seat_wait: float = 0.0              # seconds it waited for a seat and blocks
    dropped: bool = False               # its source died: free the blocks once the copy is done


class Worker:
    """The loop of one worker process: take messages, step the engine, report."""

    def __init__(self, index: int, engine: Engine, inbox, outbox, peer_caches: dict[int, torch.Tensor],
                 transport: str, report_steps: bool = False):
        self.index, self.engine = index, engine
        self.inbox, self.outbox = inbox, outbox
        self.peer_caches = peer_caches                 # worker -> its KV cache, for those we pull from
        self.transport = TRANSPORTS[transport](engine.model.device)
        self.transfers: list[Transfer] = []            # imports, first come first served
        self.reports: list = []                        # this round's, sent at its end
        self.report_steps = report_steps               # time every step for the router (adaptive only)
        self.last_collected: tuple[float, torch.cuda.Event | None] | None = None   # when (and on the
        # device, the event at which) the engine last returned a step's tokens
        self.last_sent = 0.0                           # when the last reports went out
        self.sm_split: tuple[int, int] | None = None   # (prefill SMs, decode SMs) it runs on; None: all
        self.controller: Controller | None = None      # under adaptive (Control): its own configuration
        self.recent = Recent()                         # the arrivals and ends the controller reads
        self.controlled_at = -1e9                      # when the controller last chose
        self.waiting_seen = 0                          # ... and the prompt tokens waiting then
        self.burst = False                             # a burst has come since

    def run(self) -> None:
        while self.step():
            if parent_gone():
                return   # the central scheduler is gone: nothing will read our results

    def step(self, wait: bool = True) -> bool:
        """One round: take messages, move imports on, run one engine step, report what
        happened (with the cache's free blocks). False once told to stop, or once nobody
        reads the reports."""
        busy = self.engine.has_unfinished() or self.transfers
        msgs = self._receive(block=wait and not busy)
        for msg in msgs:
            if isinstance(msg, Stop):
                return False
            try:
                self._handle(msg)
            except Exception as e:  # noqa: BLE001 (what one request raises ends that request)
                self._request_failed(msg, e)
        self._start_imports()
        self._finish_imports()
        self._control(arrived=any(isinstance(m, Submit | Import) for m in msgs))
        if self.engine.has_unfinished():
            collecting = self.engine.in_flight   # the step whose tokens this call takes
            for request_id in self.engine.step():
                self._finished(request_id)
            new = self.engine.new_tokens()
            if new:
                self.reports.append(Tokens(new, time.perf_counter()))
            if self.report_steps or self.controller is not None:
                self._time_step(collecting)
        self._expire_parked()
        now = time.perf_counter()
        if self.reports or msgs or now - self.last_sent > HEARTBEAT_S:
            bm = self.engine.bm
            self.reports.append(Heartbeat(bm.num_free_blocks, bm.num_blocks))
            if not report(self.outbox, self.reports):
                return False
            self.reports, self.last_sent = [], now
        return True

    def _receive(self, block: bool) -> list:
        msgs = []
        try:
            msgs.append(self.inbox.get(timeout=IDLE_WAIT_S) if block else self.inbox.get_nowait())
            while True:
                msgs.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        return msgs

    def _handle(self, msg) -> None:
        match msg:
            case Submit():   # the central scheduler checked it first; this worker's cache may be smaller
                self.engine.submit(msg.prompt_token_ids, msg.params, request_id=msg.request_id,
                                   prefill_only=msg.prefill_only)
                self.recent.arrived(time.perf_counter(), len(msg.prompt_token_ids),
                                    1 if msg.prefill_only else msg.params.max_tokens)
            case Import():
                t = Transfer(msg, time.perf_counter())
                self.transfers.append(t)
                self.engine.scheduler.queue_import(t.order)   # the engine's scheduler admits it, in its turn
            case Release():
                self.engine.release(msg.request_id)
            case Drop():
                self._drop(msg.request_id)
            case Abort():
                self._drop(msg.request_id)
                self.engine.abort([msg.request_id])
            case SetRole() if self.controller is None:   # else the split is the controller's
                self._set_split(msg.sm_split)
            case Control() if self.controller is None:
                splits = list(self.engine.runner.splits) if isinstance(self.engine, SplitEngine) else []
                self.controller = Controller(msg.params, self.engine.cfg.max_num_batched_tokens, splits,
                                             msg.slo)
            case Control():
                self.controller.configure(msg.params, msg.slo)
            case SendKV():
                self.transport.send(msg.dst, self.engine.runner.kv_cache, msg.runs)
            case Measure():
                self.reports.append(Measured(measure_engine(self.engine, **msg.spec)))

    def _set_split(self, sm_split: tuple[int, int] | None) -> None:
        if sm_split != self.sm_split:   # a new split repartitions the device: only on a change
            if not isinstance(self.engine, SplitEngine):
                raise ValueError(f"sm_split {tuple(sm_split)} is not in this engine's split menu (none): "
                                 "a split worker's engine has one (split_menu)")
            self.engine.set_split(sm_split)
            self.sm_split = sm_split

    # -- the controller (adaptive)

    def _control(self, arrived: bool) -> None:
        """Every CONTROL_INTERVAL_S, while prompts are here or arriving or the configuration
        is not the idle default, let the controller choose it from the engine's state, and
        soon after a burst arrives (REACT_S after the last choice at the soonest: a burst is
        met before its first chunk runs), a burst being prompt tokens waiting, more than
        twice those at the last choice, that the next step has no room for; apply a change
        and report it. Choosing costs host time between steps: not on every arrival."""
        c, now = self.controller, time.perf_counter()
        if c is None:
            return
        sched = self.engine.scheduler
        if arrived:   # a burst stays one until the controller has seen it
            waiting = sum(seq.num_pending for seq in sched.waiting)
            self.burst |= waiting > max(2 * self.waiting_seen, c.current.token_budget - len(sched.running))
        if now - self.controlled_at < (REACT_S if self.burst else CONTROL_INTERVAL_S):
            return
        snap = snapshot(self.engine.scheduler, self.recent, now)
        self.controlled_at, self.burst, before = now, False, c.current
        self.waiting_seen = sum(p.tokens_left for p in snap.prompts if not p.admitted)
        if not snap.prompts and not snap.rate and c.current == c.default:
            return
        config: Config = c.choose(snap)
        if config != before:
            self.engine.set_token_budget(config.token_budget)
            self._set_split(config.sm_split)
            self.reports.append(Configured(config.sm_split, config.token_budget, c.error))

    def _request_failed(self, msg, error: Exception) -> None:
        """Handling msg raised: the request it is about ends here, with the error (an
        import is reported as a failed pull, which the central scheduler retries once). A
        message about no request raising is the worker's own fault: it fails."""
        request_id = getattr(msg, "request_id", None)
        if request_id is None:
            raise error
        self._drop(request_id)
        self.engine.abort([request_id])
        why = str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"
        if isinstance(msg, Import):
            self.reports.append(PullFailed(request_id, msg.src, why))
        else:
            self.reports.append(Rejected(request_id, why, invalid=isinstance(error, ValueError)))

    # -- prefill side

    def _finished(self, request_id: int) -> None:
        """A request ended here: parked for a decode worker (Handoff), or done."""
        req = self.engine.requests[request_id]
        if not req.parked:
            self.recent.ended(max(s.num_outputs for s in req.seqs), req.params.max_tokens)
            try:
                self.reports.append(Done(request_id, self.engine.output(request_id)))
            except Exception as e:  # noqa: BLE001 (its output could not be built: it alone fails)
                self.engine.requests.pop(request_id, None)
                self.reports.append(Rejected(request_id, f"{type(e).__name__}: {e}", invalid=False))
            return
        seq = req.seqs[0]
        state = seq.generator.get_state().numpy().tobytes() if seq.generator is not None else None
        n = cdiv(seq.num_prompt_tokens, self.engine.cfg.block_size)
        imp = Import(request_id, self.index, seq.block_table[:n], list(seq.token_ids), seq.num_prompt_tokens,
                     req.params, seq.logprobs, seq.cumulative_logprob, state, req.prompt_logprobs)
        self.reports.append(Handoff(imp, req.metrics.first_scheduled_time, req.metrics.first_token_time))

    def _expire_parked(self) -> None:
        now = time.perf_counter()
        for req in [r for r in self.engine.requests.values()
                    if r.parked and now - r.metrics.first_token_time > HANDOFF_TIMEOUT_S]:
            self.engine.release(req.request_id)
            self.reports.append(Expired(req.request_id))

    # -- decode side

    def _start_imports(self) -> None:
        """Seats and blocks for waiting imports, as the engine's scheduler admits them (first
        come, first served), and their copies."""
        eng = self.engine
        waiting = [t for t in self.transfers if t.block_table is None]
        for t in waiting:
            m = t.msg
            own = m.src == self.index   # our own parked request (adaptive): it keeps its blocks
            parked = eng.requests[m.request_id].seqs[0].block_table if own else None
            room = eng.scheduler.start_import(m.token_ids, t.order, parked)
            if room is None:
                break   # waits until decodes finish and free room; the later imports wait behind it
            t.block_table, cached = room
            t.seat_wait = time.perf_counter() - t.arrived
            if own:
                t.pull = Pull(0, seconds=0.0)
                continue
            # Blocks found in our prefix cache need no copy.
            first, last = cached // eng.cfg.block_size, cdiv(m.num_prompt_tokens, eng.cfg.block_size)
            try:
                t.pull = self.transport.pull(m.src, self.peer_caches.get(m.src), m.src_blocks[first:last],
                                             eng.runner.kv_cache, t.block_table[first:last])
            except Exception as e:  # noqa: BLE001 (this import fails, as a failed copy does)
                t.pull = Pull(0, error=f"{type(e).__name__}: {e}")
            if t.pull.source_runs is not None:   # a two-sided transport: the source must send
                self.reports.append(ToWorker(m.src, SendKV(m.request_id, self.index, t.pull.source_runs)))

    def _finish_imports(self) -> None:
        """Imports whose copy has completed join the decode batch; the others keep copying
        while the engine steps."""
        still = []
        for t in self.transfers:
            if t.pull is None or not t.pull.ready():
                still.append(t)
            elif t.dropped or t.pull.error is not None:   # never read blocks a copy did not fill
                self.engine.scheduler.cancel_import(t.block_table)
                if not t.dropped:
                    self.reports.append(PullFailed(t.msg.request_id, t.msg.src, t.pull.error))
            else:
                self._join_decodes(t)
        self.transfers = still

    def _join_decodes(self, t: Transfer) -> None:
        """The copy is done: the request decodes here (or, if that raises, fails as a pull)."""
        m = t.msg
        try:
            self.engine.add_imported(imported_sequence(m, t.block_table, self.engine.model.device,
                                                       self.engine.sequence_class))
        except Exception as e:  # noqa: BLE001 (this request fails, alone)
            self.engine.scheduler.cancel_import(t.block_table)
            self.reports.append(PullFailed(m.request_id, m.src, f"{type(e).__name__}: {e}"))
            return
        self.reports.append(Imported(m.request_id, time.perf_counter(), t.pull.nbytes, t.pull.seconds,
                                     t.seat_wait))

    def _drop(self, request_id: int) -> None:
        """Its source died: an import not started is forgotten, one copying is freed when done."""
        for t in self.transfers:
            if t.msg.request_id == request_id:
                t.dropped = True
                if t.block_table is None:
                    self.engine.scheduler.forget_import(t.order)
        self.transfers = [t for t in self.transfers if not (t.dropped and t.block_table is None)]
        self.engine.release(request_id)

    # -- both

    def _time_step(self, collected: LaunchedStep | None) -> None:
        """Report the step just collected with its time: the time since the previous one was
        collected, while the engine runs back to back (one step on the device while the
        host finishes the one before), so a step's time is what its decodes waited. On a GPU
        it is the time between the device events that ended the two steps: the host sees a
        step's tokens only after it launched the next, which a long prompt chunk's launch
        delays, and timed so a chunk's ms went to the step beside it. A split
        worker's steps say where they ran: on the whole GPU, or on a lane of a split, whose
        own models the router refits; its prompt chunks are reported too (decodes 0), timed
        by the engine from launch until their tokens were seen. A drafting step is not
        reported: its time is its checks' (speculate.py: rounds), not a decode step's."""
        now = time.perf_counter()
        ended = collected.output.ready if collected is not None and collected.output else None
        if collected is not None and self.last_collected is not None and collected.extra is None:
            at, before = self.last_collected
            ms = before.elapsed_time(ended) if before is not None and ended is not None else (now - at) * 1e3
            s = collected.shape
            split = collected.lane.split if isinstance(collected.lane, SplitLane) else None  # None: all SMs
            self._timed(StepTimed(s.decodes, s.context_tokens, s.prefill_tokens, ms, split))
        self.last_collected = (now, ended) if self.engine.in_flight is not None else None
        if isinstance(self.engine, SplitEngine):
            for p in self.engine.take_prefill_lane_steps():
                self._timed(StepTimed(0, 0, p.shape.prefill_tokens, p.ms, p.split))

    def _timed(self, step: StepTimed) -> None:
        """A timed step: reported to the router (adaptive), which learns it; the controller
        scores its step model on it."""
        if self.report_steps:
            self.reports.append(step)
        if self.controller is not None:
            split = None if step.sm_split is None else tuple(step.sm_split)
            self.controller.timed(step.decodes, step.context_tokens, step.prefill_tokens, step.ms, split)


# ----------------------------------------------------------------------------- the process


@dataclass
class WorkerSpec:
    """What one worker process is started with."""
    index: int
    cfg: EngineConfig                   # with this worker's device
    transport: str
    report_steps: bool                  # send StepTimed (the adaptive router reads them)
    num_sources: int                    # peer caches it will pull from, arriving on its share queue
    group: str | None = None            # a two-sided transport's process group: its init method
    world_size: int = 1                 # ... and its ranks (the workers; rank = worker index)
    name: str = ""                      # where it runs, as the central scheduler names it


def worker_main(spec: WorkerSpec, inbox, outbox, readers: list, share_queue) -> None:
    """Entry point of a worker process. readers: the share queues of the workers that will
    pull from this one's cache; share_queue: where the caches it pulls from arrive. A
    worker whose parent is gone exits quietly: there is no one to report to."""
    # Ctrl-C is the caller's: it stops or aborts its requests and tells the workers; a
    # terminal's SIGINT reaches the whole process group, and would kill them mid-serve.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        device = torch.device(spec.cfg.device)
        if device.type == "cuda":
            if spec.cfg.splits_sms:   # before CUDA starts in this process (set_device starts it)
                load_kernels_at_start()
            torch.cuda.set_device(device)
        else:
            # several workers share the cores (or OMP_NUM_THREADS's)
            torch.set_num_threads(max(1, torch.get_num_threads() // 4))
        engine = worker_engine(spec.cfg)
        peers = _share_caches(spec, engine.runner.kv_cache, readers, share_queue)
        if spec.group is not None:   # the workers' process group, for the transport's sends and receives
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=spec.group,
                                    rank=spec.index, world_size=spec.world_size,
                                    timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
            DistributedTransport.connect_pairs(spec.index, spec.world_size, device)
        if report(outbox, [Ready(engine.runner.num_blocks, engine.bm.watermark_blocks,
                                 engine.runner.kv_cache[0].nbytes // engine.cfg.block_size,
                                 spec.name or spec.cfg.device)]):
            Worker(spec.index, engine, inbox, outbox, peers, spec.transport, spec.report_steps).run()
        if dist.is_initialized():   # left by hand: NCCL warns at exit of a group never destroyed
            dist.destroy_process_group()
    except (KeyboardInterrupt, ParentGone):
        pass
    except BaseException:  # noqa: BLE001 (report any failure to the central scheduler, then die)
        report(outbox, [Failed(traceback.format_exc())])   # if nobody reads it, nobody needs it
        raise SystemExit(1) from None


def _share_caches(spec: WorkerSpec, cache: torch.Tensor, readers: list,
                  share_queue) -> dict[int, torch.Tensor]:
    """Hand our cache, once, to every worker that will pull from it; take the caches we
    pull from (worker index -> cache)."""
    if readers and not cache.is_cuda:
        cache.share_memory_()
    for q in readers:
        q.put((spec.index, cache))
    peers = dict(_get_while_parent_lives(share_queue, timeout_s=600.0) for _ in range(spec.num_sources))
    if cache.is_cuda:   # turns on peer access: our copy engine then reads the peers' memory directly
        for peer_cache in peers.values():
            peer_cache[:1].to(cache.device)
    return peers


def _get_while_parent_lives(q, timeout_s: float):
    """q.get(timeout=timeout_s), but ParentGone within a second of the parent's end: a peer
    that has not sent its cache yet never will (the parent stops every worker it started)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return q.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
        except queue.Empty:
            if parent_gone():
                raise ParentGone from None
            if time.monotonic() >= deadline:
                raise


@dataclass
class SigtermExit:
    """SIGTERM, in the process that owns workers, as an orderly exit. Python's default
    action ends the process at once: no finalizer runs, so the workers are left to find
    their parent gone and the queues' semaphores are never unlinked (the resource
    tracker's "leaked semaphore objects" warning). Raised as SystemExit instead, close()
    and the finalizers run as at any exit. While workers are being spawned or stopped, the
    exit waits until that is done (held): a worker half spawned would be nobody's, a stop
    cut short would leave what it had not released yet. During the interpreter's own exit
    it is not raised at all: that exit is under way. A second SIGTERM gets the default
    action, so a caller that must end the process at once still can."""
    holding: int = 0         # held() levels open: workers are being spawned or stopped
    pending: bool = False    # a SIGTERM came while holding

    def __call__(self, signum: int, frame) -> None:
        signal.signal(signum, signal.SIG_DFL)
        if self.holding or exiting():
            self.pending = True
        else:
            raise SystemExit(128 + signum)   # the exit status of a process a signal ended, as shells give it

    @contextlib.contextmanager
    def held(self):
        self.holding += 1
        try:
            yield
        finally:
            self.holding -= 1
            if self.pending and not self.holding:
                self.pending = False
                if not exiting():
                    raise SystemExit(128 + signal.SIGTERM)


def exiting() -> bool:
    """Whether the interpreter has begun its exit: its first step, threading's shutdown,
    sets threading._SHUTTING_DOWN (there is no public flag), then stops the main thread;
    the exit's callbacks, the finalizers among them, come after."""
    return getattr(threading, "_SHUTTING_DOWN", False) or not threading.main_thread().is_alive()


SIGTERM_EXIT = SigtermExit()


def exit_in_order_on_sigterm() -> None:
    """Make SIGTERM a SystemExit (SigtermExit) in this process, unless the program has a
    SIGTERM handler of its own (it decides then) or this is not the main thread (only it
    may set one)."""
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL):
        signal.signal(signal.SIGTERM, SIGTERM_EXIT)


class WorkerProcesses:
    """One worker process per engine config (each on its device) and the channels to them:
    an inbox queue each, a report pipe each. sources[i]: the workers whose caches worker i
    pulls from. close() releases everything it opened; so do its collection and the
    interpreter's exit."""

    def __init__(self, configs: list[EngineConfig], sources: list[list[int]], transport: str,
                 report_steps: bool, names: list[str]):
        check_main_module()
        ctx = torch.multiprocessing.get_context("spawn")
        # A two-sided transport's process group rendezvous on loopback: nothing listens beyond it.
        group = None if TRANSPORTS[transport].shares_caches else f"tcp://127.0.0.1:{free_port()}"
        self.procs, self.inboxes, self.reports, self.shares = [], [], [], []
        self.heard: set[int] = set()   # the workers that have reported (Ready first): past their start-up
        # Before anything is opened, so that a failure half-way releases what was.
        self._stop = weakref.finalize(self, stop_processes, self.procs, self.inboxes, self.reports,
                                      self.shares, self.heard)
        self.configs = configs   # each worker's engine, on its device
        n = len(configs)
        pipes = [ctx.Pipe(duplex=False) for _ in configs]
        self.reports += [reader for reader, _ in pipes]
        self.inboxes += [ctx.Queue() for _ in configs]
        # Where each worker's peer caches arrive; kept here, since a queue the parent drops
        # before a child has unpickled it is gone (its semaphore unlinked).
        self.shares += [ctx.Queue() if sources[i] else None for i in range(n)]
        for i, cfg in enumerate(configs):
            spec = WorkerSpec(i, cfg, transport, report_steps, len(sources[i]), group, n)
            readers = [self.shares[j] for j in range(n) if i in sources[j]]
            self.procs.append(ctx.Process(target=worker_main,
                                          args=(spec, self.inboxes[i], pipes[i][1], readers, self.shares[i]),
                                          daemon=True, name=names[i]))
        with SIGTERM_EXIT.held():
            for p, (_, writer) in zip(self.procs, pipes):
                p.start()
                writer.close()   # the worker holds the only writing end now

    def send(self, w: int, msg) -> None:
        if not self.inboxes:
            raise RuntimeError("the workers are stopped: close() was called")
        self.inboxes[w].put(msg)

    def receive(self, timeout: float, skip: set[int]) -> list[tuple[int, list]]:
        """(worker, its reports of one round) for every round waiting on the pipes of the
        workers not in skip, waiting up to timeout for the first."""
        live = {r: w for w, r in enumerate(self.reports) if w not in skip and not r.closed}
        got = []
        for reader in multiprocessing.connection.wait(list(live), timeout):
            try:
                while reader.poll():
                    got.append((live[reader], reader.recv()))
                    self.heard.add(live[reader])
            except (EOFError, OSError):   # its worker died; the liveness check handles the rest
                reader.close()
        return got

    def exited(self) -> list[int]:
        """The workers whose process has ended."""
        return [i for i, p in enumerate(self.procs) if not p.is_alive()]

    def kill(self, w: int) -> None:
        self.procs[w].kill()

    def why(self, w: int) -> str:
        """Why a worker that ended without a traceback ended."""
        return f"exit code {self.procs[w].exitcode}"

    def close(self) -> None:
        """Ask every worker to stop, then terminate (and at last kill) the ones that do not;
        release the channels. The lists are empty afterwards."""
        self._stop()


def free_port() -> int:
    """A TCP port free on loopback now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_processes(procs: list, inboxes: list, reports: list, shares: list, heard: set[int],
                   timeout_s: float = 10.0) -> None:
    """WorkerProcesses.close, as a function a weakref finalizer can hold (it must not hold
    the object it finalizes). A worker not heard from is still starting (LLM(...) was
    interrupted): it holds no request and reads no message before it is ready, so it is
    terminated at once, and sent nothing: a put starts the queue's feeder thread, which
    holds two of its semaphores, and one still running at the interpreter's exit can be
    frozen between unlinking them and telling the resource tracker (its "leaked"
    warning). A SIGTERM meanwhile waits until all is released (SigtermExit)."""
    with SIGTERM_EXIT.held():
        for w, q in enumerate(inboxes):
            try:
                if w in heard:
                    q.put(Stop())
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + timeout_s
        for w, p in enumerate(procs):
            if p.pid is not None and w in heard:
                p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.pid is not None and p.is_alive():
                p.terminate()
                p.join(2)
                if p.is_alive():
                    p.kill()
                    p.join(2)
        release_channels(procs, inboxes, reports, shares)
        heard.clear()


def release_channels(procs: list, inboxes: list, reports: list, shares: list) -> None:
    """Close what the workers leave behind in this process, now rather than at collection:
    each queue's pipe and feeder thread, each report pipe, each process's own pipe; then
    forget them all, so the queues go and their semaphores (files in /dev/shm) are unlinked."""
    for p, q in zip(procs, inboxes):
        q.close()   # its feeder thread writes what is left, then closes the pipe and ends
        if p.exitcode == 0:
            q.join_thread()          # the worker read up to our Stop, the last message: that is soon
        else:
            q.cancel_join_thread()   # nobody reads its pipe: a full one would keep the feeder waiting
    for q in shares:
        if q is not None:   # never written to here: no feeder thread; its pipe closes with it
            q.close()
    for reader in reports:
        reader.close()
    for p in procs:
        if not p.is_alive():   # one that would not die keeps its pipe
            p.close()
    for items in (procs, inboxes, reports, shares):
        items.clear()


def check_main_module() -> None:
    """Worker processes are started with spawn, which runs the caller's script again in
    each of them: unless the script starts the workers under `if __name__ == "__main__":`,
    every worker would start workers of its own. Refuse before starting any."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if getattr(multiprocessing.current_process(), "_inheriting", False):   # we are such a worker
        raise RuntimeError("nanoPD workers are being started while a worker process starts: put the code "
                           "that creates LLM(policy=...) under `if __name__ == \"__main__\":`")
    if path is None or not path.endswith(".py") or not os.path.isfile(path):
        return   # an interactive session, python -c, a notebook: nothing is run again
    tree = ast.parse(Path(path).read_text())
    guarded = any(isinstance(node, ast.If) and "__name__" in ast.unparse(node.test) for node in tree.body)
    if not guarded:
        raise ValueError(f"{path} has no `if __name__ == \"__main__\":` block: worker processes are "
                         "started with spawn, which runs the script again in each of them; put the code "
                         "that creates LLM(policy=...) under that block")
