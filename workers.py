"""Worker processes: one Engine per device, in the role collocated, prefill or decode, and
the transports that move a request's KV blocks from a prefill worker to a decode worker.

    central scheduler (nanopd.CentralScheduler)
        | Submit / Import / Release / Drop            ^ events: tokens, done, handoff, imported, step
        v  (one inbox queue per worker)               |  (one pipe per worker)
    worker 0 (prefill, cuda:0)  ==KV blocks==>  worker 1 (decode, cuda:1)

Control travels as small picklable messages. Tensors cross a queue only at start-up: each
prefill worker hands its whole KV cache to every decode worker once (CUDA IPC on GPUs,
shared memory on CPUs), so per request only block ids travel. A handoff:
  1. the prefill worker samples a request's first token and parks the request: its blocks
     stay allocated; it reports ("handoff", an Import naming its blocks) to the central
     scheduler;
  2. the central scheduler picks a decode worker and forwards it the Import;
  3. the decode worker allocates its own blocks and pulls the data on its own CUDA stream
     (the Transport), so the decodes it is running are not stalled; when the copy's event
     has completed it adds the request to its batch and reports ("imported");
  4. the central scheduler sends Release to the prefill worker, which frees the blocks.
A parked request nobody pulls is released after HANDOFF_TIMEOUT_S.
Under the adaptive policy every step a worker runs is reported too, with its shape and
time ("step"): the router refits its model of a step on them (router.py).
"""

import ctypes
import functools
import os
import queue
import time
import traceback
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.multiprocessing as mp

import profiler
from engine import Engine, EngineConfig
from kv_cache import cdiv

HANDOFF_TIMEOUT_S = 120.0   # parked blocks are freed after this long without a Release
IDLE_WAIT_S = 0.02          # how long an idle worker blocks on its inbox before looking again


# ----------------------------------------------------------------------------- messages


@dataclass
class Submit:
    """Run a request: prefill_only on a prefill worker, the whole request otherwise."""
    rid: int
    prompt_ids: list[int]
    params: object                      # nanopd.SamplingParams
    prefill_only: bool = False
    beam_width: int = 0
    length_penalty: float = 1.0


@dataclass
class Import:
    """Pull a prefilled request's blocks from worker src and decode it."""
    rid: int
    src: int
    src_blocks: list[int]
    token_ids: list[int]                # prompt + first token
    num_prompt_tokens: int
    params: object
    logprobs: list = field(default_factory=list)
    cumulative_logprob: float = 0.0
    generator_state: bytes | None = None


@dataclass
class Measure:
    spec: dict                          # profiler.measure_engine's arguments; the worker must be idle


@dataclass
class Release:
    rid: int                            # a decode worker has the blocks: free them


@dataclass
class Drop:
    rid: int                            # forget this request (its path broke; it is retried elsewhere)


# ----------------------------------------------------------------------------- transports


def block_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) for the runs where both block-id lists count up by one:
    each run is a single contiguous copy in the block-major cache."""
    runs = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


class Transport:
    """Copies blocks of another worker's KV cache (shared at start-up) into this worker's.
    pull() only enqueues the copies, on a stream of the transport's own, and returns a Pull
    whose events complete with them (on CPUs the copy is done on return). A transport for
    workers on different hosts (torch.distributed send/recv of the same runs) would
    implement the same copy()."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def pull(self, src: torch.Tensor, src_blocks: list[int], dst: torch.Tensor, dst_blocks: list[int]) -> "Pull":
        nbytes = len(dst_blocks) * dst[0].nbytes
        if self.stream is None:
            start = time.perf_counter()
            self.copy(src, src_blocks, dst, dst_blocks)
            return Pull(nbytes, seconds=time.perf_counter() - start)
        # Our own stream: the copies wait on nothing of the engine's, and the engine's
        # steps wait on nothing of theirs.
        with torch.cuda.stream(self.stream):
            began, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            began.record()
            self.copy(src, src_blocks, dst, dst_blocks)
            done.record()
        return Pull(nbytes, began, done)

    def copy(self, src, src_blocks, dst, dst_blocks) -> None:
        raise NotImplementedError


@dataclass
class Pull:
    """A transport's copy in flight: its size and, once done, how long the copy itself took."""
    nbytes: int
    began: torch.cuda.Event | None = None
    done: torch.cuda.Event | None = None
    seconds: float | None = None

    def ready(self) -> bool:
        if self.seconds is None and self.done.query():
            self.seconds = self.began.elapsed_time(self.done) / 1e3
        return self.seconds is not None


class P2PTransport(Transport):
    """Device to device (NVLink or PCIe peer access; shared memory between CPU workers):
    one copy per run of consecutive blocks, done by a copy engine, not the SMs.

    The copy engine is our (the destination's) own, reading the peer's memory over the
    link: torch's copy_ between devices would run on a stream of the source device,
    pushing, which was slower on the H200 pair (README, "Workers"), and would give this
    process a context on the prefill worker's GPU. torch has no call for a copy between
    devices on the destination's stream, so it is the driver's cuMemcpyAsync. It goes
    peer to peer once peer access is on, which worker_main's first copy from each peer
    cache turns on (without it the driver stages the copy through the host, far slower)."""

    def copy(self, src, src_blocks, dst, dst_blocks) -> None:
        if not dst.is_cuda:
            for s, d, n in block_runs(src_blocks, dst_blocks):
                dst[d:d + n].copy_(src[s:s + n])
            return
        block_bytes = dst[0].nbytes   # both caches are contiguous and block-major
        with torch.cuda.device(dst.device):   # the driver call uses the current context
            stream = torch.cuda.current_stream().cuda_stream   # the pull's
            for s, d, n in block_runs(src_blocks, dst_blocks):
                rc = _cuda_driver().cuMemcpyAsync(
                    ctypes.c_uint64(dst.data_ptr() + d * block_bytes), ctypes.c_uint64(src.data_ptr() + s * block_bytes),
                    ctypes.c_size_t(n * block_bytes), ctypes.c_void_p(stream))
                if rc != 0:
                    raise RuntimeError(f"cuMemcpyAsync failed with CUDA error {rc}")


@functools.cache
def _cuda_driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


class RelayTransport(Transport):
    """Through pinned host memory, for devices that cannot reach each other: device to
    host on a stream of the source device, host to device on ours, in chunks through two
    buffers so both directions run at once. Small chunks (8 blocks, ~19 MB for Qwen3-8B)
    keep the pipeline's fill and drain, one chunk each way, short."""

    def __init__(self, device: torch.device, chunk_blocks: int = 8):
        super().__init__(device)
        self.chunk_blocks = chunk_blocks
        self.source_streams: dict[torch.device, torch.cuda.Stream] = {}   # the downloads
        self.buffers: list[torch.Tensor] = []
        self.freed: list[torch.cuda.Event | None] = [None, None]   # a buffer's last upload finished

    def copy(self, src, src_blocks, dst, dst_blocks) -> None:
        if not self.buffers:
            shape = (self.chunk_blocks, *src.shape[1:])
            self.buffers = [torch.empty(shape, dtype=src.dtype, pin_memory=src.is_cuda) for _ in range(2)]
        chunks = [(s + i, d + i, min(self.chunk_blocks, n - i))
                  for s, d, n in block_runs(src_blocks, dst_blocks) for i in range(0, n, self.chunk_blocks)]
        for k, (s, d, n) in enumerate(chunks):
            buf = self.buffers[k % 2][:n]
            if not src.is_cuda:
                buf.copy_(src[s:s + n])
                dst[d:d + n].copy_(buf)
                continue
            down = self.source_streams.setdefault(src.device, torch.cuda.Stream(src.device))
            if self.freed[k % 2] is not None:
                down.wait_event(self.freed[k % 2])
            with torch.cuda.stream(down):
                buf.copy_(src[s:s + n], non_blocking=True)
                downloaded = torch.cuda.Event()
                downloaded.record(down)
            self.stream.wait_event(downloaded)
            dst[d:d + n].copy_(buf, non_blocking=True)   # on self.stream (pull made it current)
            self.freed[k % 2] = torch.cuda.Event()
            self.freed[k % 2].record(self.stream)


TRANSPORTS = {"p2p": P2PTransport, "relay": RelayTransport}


# ----------------------------------------------------------------------------- the worker


@dataclass
class Transfer:
    """An Import whose copy is in flight."""
    msg: Import
    block_table: list[int]
    pull: Pull
    seat_wait: float   # seconds the Import waited here for a seat and blocks


class Worker:
    """The loop of one worker process: take messages, step the engine, report events."""

    def __init__(self, index: int, engine, inbox, outbox, peer_caches: dict[int, torch.Tensor], transport: str,
                 report_steps: bool = False):
        self.index, self.engine = index, engine
        self.inbox, self.outbox = inbox, outbox
        self.peer_caches = peer_caches                 # worker -> its KV cache, for those we pull from
        self.transport = TRANSPORTS[transport](engine.model.device)
        self.requests: dict[int, object] = {}          # rid -> scheduler.Request running here
        self.reported: dict[int, int] = {}             # rid -> output tokens already streamed
        self.parked: dict[int, tuple[object, float]] = {}   # prefill: rid -> (Sequence, parked at)
        self.imports: deque[tuple[float, Import]] = deque()   # decode: (arrival, import) waiting for room
        self.transfers: list[Transfer] = []            # decode: copies in flight
        self.dropped: set[int] = set()
        self.events: list[tuple] = []
        self.report_steps = report_steps               # time every step for the router (adaptive only)
        self.last_collected: float | None = None       # when the engine last returned a step's tokens

    def run(self) -> None:
        parent = mp.parent_process()
        while self.step():
            if parent is not None and not parent.is_alive():
                return   # the central scheduler is gone: nothing will read our results

    def step(self, wait: bool = True) -> bool:
        """One round: take messages, move transfers on, run one engine step, report what
        happened (with the cache's free blocks). False once told to stop."""
        busy = self.engine.has_unfinished() or self.transfers or self.imports
        msgs = self._receive(block=wait and not busy)
        for msg in msgs:
            if msg is None:
                return False
            self._handle(msg)
        self._start_imports()
        self._finish_transfers()
        if self.engine.has_unfinished():
            collecting = self.engine.in_flight   # the step whose tokens this call takes
            for req in self.engine.step():
                self._finished(req)
            self._stream_tokens()
            if self.report_steps:
                self._time_step(collecting)
        self._expire_parked()
        if self.events or msgs:
            status = ("status", self.engine.bm.num_free_blocks, self.engine.bm.num_blocks,
                      len(self.requests) + len(self.transfers) + len(self.imports))
            self.outbox.send((self.index, [*self.events, status]))
            self.events = []
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
        if isinstance(msg, Submit):
            try:
                self.requests[msg.rid] = self.engine.add_request(
                    msg.prompt_ids, msg.params, beam_width=msg.beam_width, length_penalty=msg.length_penalty,
                    request_id=msg.rid, prefill_only=msg.prefill_only)
            except ValueError as e:   # the central scheduler checks first; this worker's cache may be smaller
                self.events.append(("rejected", msg.rid, str(e)))
        elif isinstance(msg, Import):
            self.imports.append((time.perf_counter(), msg))
        elif isinstance(msg, Release):
            self._release(msg.rid)
        elif isinstance(msg, Drop):
            self._drop(msg.rid)
        elif isinstance(msg, Measure):
            self.events.append(("measured", profiler.measure_engine(self.engine, **msg.spec)))

    # -- prefill side

    def _finished(self, req) -> None:
        seq = req.seqs[0]
        if req.prefill_only and seq.finish_reason is None:   # prefilled: hand it to a decode worker
            self.parked[req.request_id] = (seq, time.monotonic())
            state = seq.generator.get_state().numpy().tobytes() if seq.generator is not None else None
            n = cdiv(seq.num_prompt_tokens, self.engine.cfg.block_size)
            imp = Import(req.request_id, self.index, seq.block_table[:n], list(seq.token_ids), seq.num_prompt_tokens,
                         req.params, seq.logprobs, seq.cumulative_logprob, state)
            self.events.append(("handoff", imp, req.metrics.first_scheduled_time, req.metrics.first_token_time))
        else:
            self.events.append(("done", req.request_id, self.engine.output(req), req.metrics))
        self.requests.pop(req.request_id, None)
        self.reported.pop(req.request_id, None)

    def _release(self, rid: int) -> None:
        seq, _ = self.parked.pop(rid, (None, 0.0))
        if seq is not None:
            self.engine.bm.free(seq.block_table)

    def _expire_parked(self) -> None:
        now = time.monotonic()
        for rid in [r for r, (_, t) in self.parked.items() if now - t > HANDOFF_TIMEOUT_S]:
            self._release(rid)
            self.events.append(("expired", rid))

    # -- decode side

    def _start_imports(self) -> None:
        """Allocate blocks for waiting imports (first come, first served) and start their copies."""
        eng = self.engine
        while self.imports:
            arrived, msg = self.imports[0]
            if msg.rid in self.dropped:
                self.imports.popleft()
                continue
            own = msg.src == self.index   # our own parked request (adaptive): it keeps its blocks
            seats = len(eng.scheduler.running) + len(self.transfers)
            if seats >= eng.cfg.max_num_seqs or not (own or eng.bm.can_allocate(msg.token_ids)):
                return   # waits until decodes finish and free room
            self.imports.popleft()
            waited = time.perf_counter() - arrived
            if own:
                seq, _ = self.parked.pop(msg.rid)
                self.transfers.append(Transfer(msg, seq.block_table, Pull(0, seconds=0.0), waited))
                continue
            table, cached = eng.bm.allocate(msg.token_ids)   # blocks found in our prefix cache need no copy
            first, last = cached // eng.cfg.block_size, cdiv(msg.num_prompt_tokens, eng.cfg.block_size)
            pull = self.transport.pull(self.peer_caches[msg.src], msg.src_blocks[first:last], eng.runner.kv_cache,
                                       table[first:last])
            self.transfers.append(Transfer(msg, table, pull, waited))

    def _finish_transfers(self) -> None:
        """Requests whose copy has completed join the decode batch; the others keep copying
        while the engine steps."""
        still = []
        for t in self.transfers:
            if not t.pull.ready():
                still.append(t)
                continue
            m = t.msg
            if m.rid in self.dropped:
                self.engine.bm.free(t.block_table)
                continue
            req = self.engine.add_prefilled(m.rid, m.token_ids, m.num_prompt_tokens, m.params, t.block_table,
                                            m.logprobs, m.cumulative_logprob, m.generator_state)
            self.requests[m.rid] = req
            self.reported[m.rid] = 1   # the first token was streamed by the prefill worker
            self.events.append(("imported", m.rid, time.perf_counter(), t.pull.nbytes, t.pull.seconds, t.seat_wait))
        self.transfers = still

    def _drop(self, rid: int) -> None:
        self.dropped.add(rid)
        self._release(rid)

    # -- both

    def _time_step(self, collected) -> None:
        """Report the step just collected with its time: the time since the previous one was
        collected, while the engine runs back to back (one step on the device while the
        host finishes the one before), so a step's time is what its decodes waited."""
        now = time.perf_counter()
        if collected is not None and self.last_collected is not None:
            s = collected.shape
            self.events.append(("step", s.decodes, s.context_tokens, s.prefill_tokens,
                                (now - self.last_collected) * 1e3))
        self.last_collected = now if self.engine.in_flight is not None else None

    def _stream_tokens(self) -> None:
        """New output tokens of every running request since the last report: one event per step."""
        new = {}
        for rid, req in self.requests.items():
            if req.beam_width or req.params.n > 1:
                continue   # these report their completions when done
            ids = req.seqs[0].output_ids
            if len(ids) > self.reported.get(rid, 0):
                new[rid] = ids[self.reported.get(rid, 0):]
                self.reported[rid] = len(ids)
        if new:
            self.events.append(("tokens", new, time.perf_counter()))


def worker_main(index: int, engine_kwargs: dict, inbox, outbox, readers: list,
                my_share_queue, num_sources: int, transport: str, report_steps: bool = False) -> None:
    """Entry point of a worker process (spawned by nanopd.CentralScheduler). readers: the
    queues of the workers that will pull from this one's cache; num_sources: how many
    caches this one will pull from, arriving on my_share_queue; report_steps: send every
    step's shape and time (for the adaptive router)."""
    try:
        device = torch.device(engine_kwargs["device"])
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // 4))   # several workers share the cores
        engine = Engine(EngineConfig(**engine_kwargs))
        cache = engine.runner.kv_cache
        if readers:   # hand the cache, once, to every worker that will pull from it
            if not cache.is_cuda:
                cache.share_memory_()
            for q in readers:
                q.put((index, cache))
        peers = {}
        for _ in range(num_sources):
            src, peer_cache = my_share_queue.get(timeout=600)
            peers[src] = peer_cache
        if device.type == "cuda":   # let our copy engine read the peers' memory directly (P2P)
            for peer_cache in peers.values():
                peer_cache[:1].to(device)
        outbox.send((index, [("ready", engine.runner.num_blocks, engine.bm.watermark_blocks,
                              cache[0].nbytes // engine.cfg.block_size)]))
        Worker(index, engine, inbox, outbox, peers, transport, report_steps).run()
    except KeyboardInterrupt:
        pass
    except BaseException:  # noqa: BLE001 (report any failure to the central scheduler, then die)
        outbox.send((index, [("failed", traceback.format_exc())]))
        raise SystemExit(1) from None
