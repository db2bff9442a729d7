"""Transports: how a decode worker copies a request's KV blocks out of a prefill worker's
cache into its own.

Every prefill worker's whole cache is shared with its decode workers once, at start-up
(workers.py), so a transport only copies blocks: pull() enqueues the copies on a stream
of the transport's own (never the engine's, so neither waits for the other) and returns a
Pull, whose events complete with them. Blocks are copied as runs: the cache is
block-major, so consecutive block ids on both sides are one contiguous copy.

  p2p    the decode GPU's copy engine reads the prefill GPU's memory (NVLink or PCIe peer
         access); between CPU workers, a copy through shared memory
  relay  through two pinned host buffers, download and upload overlapped, for devices
         that cannot reach each other
  distributed
         point-to-point sends and receives of torch.distributed (NCCL between GPUs, gloo
         between CPUs), for workers that share no memory, on one host or several: the
         decode side posts a receive per run and asks the prefill side (a SendKV message)
         to post the matching sends
"""

import contextlib
import ctypes
import datetime
import functools
import itertools
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# A gloo receive waits this long for its sends at most; a source keeps a request's blocks
# parked for a pull as long (workers.py's HANDOFF_TIMEOUT_S is this).
RECEIVE_TIMEOUT_S = 120.0


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
    whose events complete with them (on CPUs the copy is done on return)."""
    shares_caches = True   # the caches are handed over at start-up (CUDA IPC, shared memory)

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def pull(self, src_worker: int, src: torch.Tensor | None, src_blocks: list[int], dst: torch.Tensor,
             dst_blocks: list[int]) -> "Pull":
        """Copy blocks src_blocks of worker src_worker's cache src into dst_blocks of dst."""
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

    def send(self, dst_worker: int, cache: torch.Tensor, runs: list[tuple[int, int]]) -> None:
        """The source side of a transport that needs one (distributed): nothing here."""


@dataclass
class Pull:
    """A transport's copy in flight: its size and, once done, how long the copy itself took;
    and, for a two-sided transport, the runs (first block, length) its source must send, in
    this order (messages.SendKV)."""
    nbytes: int
    began: torch.cuda.Event | None = None
    done: torch.cuda.Event | None = None
    seconds: float | None = None
    works: list = field(default_factory=list)   # torch.distributed receives in flight
    posted: float = 0.0                          # ... since (host clock)
    source_runs: list[tuple[int, int]] | None = None
    waited: threading.Event | None = None       # gloo: set by a thread that waits for the works
    error: str | None = None                    # ... or by the error that ended them (ready, not done)

    def ready(self) -> bool:
        """The copy is over: done, or failed (error); its blocks are not in use any more."""
        if self.error is not None:
            return True
        if self.seconds is None and self.works:
            done = (self.waited.is_set() if self.waited is not None
                    else all(w.is_completed() for w in self.works))
            if done:
                self.seconds = time.perf_counter() - self.posted
        elif self.seconds is None and self.done.query():
            self.seconds = self.began.elapsed_time(self.done) / 1e3
        return self.seconds is not None


class P2PTransport(Transport):
    """Device to device (NVLink or PCIe peer access; shared memory between CPU workers):
    one copy per run of consecutive blocks, done by a copy engine, not the SMs.

    The copy engine is our (the destination's) own, reading the peer's memory over the
    link: torch's copy_ between devices would run on a stream of the source device,
    pushing, which is the slower way on the H200 pair (docs/workers.md), and would give this
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
                    ctypes.c_uint64(dst.data_ptr() + d * block_bytes),
                    ctypes.c_uint64(src.data_ptr() + s * block_bytes),
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


class DistributedTransport(Transport):
    """Point-to-point receives (here) and sends (on the source) of torch.distributed, one per
    run of consecutive blocks, between workers that share no memory: NCCL between GPUs,
    gloo between CPUs, in the workers' process group (rank = worker index). The decode side
    posts its receives on the transport's stream and asks the source for the sends (the
    Pull's SendKV, which the central scheduler forwards); a backend matches the messages of
    a pair of ranks in the order they were posted, and the source posts its sends in the
    order of the runs, and serves its SendKVs in the order they come, so each run lands
    where it should."""
    shares_caches = False

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.sending: list = []   # NCCL sends in flight

    @staticmethod
    def connect_pairs(rank: int, world_size: int, device: torch.device) -> None:
        """Exchange one element with every other worker, at start-up. NCCL sets up the link of
        a pair on its first send or receive, blocking both until the other side comes: done
        mid-serving, a worker would stall on it. The pairs go in one order everywhere, so no
        worker waits on one that waits on another."""
        one = torch.zeros(1, device=device)
        for i, j in itertools.combinations(range(world_size), 2):
            if rank == i:
                dist.send(one, dst=j)
            elif rank == j:
                dist.recv(one, src=i)

    def pull(self, src_worker: int, src: torch.Tensor | None, src_blocks: list[int], dst: torch.Tensor,
             dst_blocks: list[int]) -> Pull:
        runs = block_runs(src_blocks, dst_blocks)
        pull = Pull(len(dst_blocks) * dst[0].nbytes, posted=time.perf_counter(),
                    source_runs=[(s, n) for s, _, n in runs])
        try:
            with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                pull.works = [dist.irecv(dst[d:d + n], src=src_worker) for _, d, n in runs]
        except RuntimeError as e:   # gloo: a peer already gone fails the post itself
            pull.error = f"{type(e).__name__}: {e}".splitlines()[0]
            pull.source_runs = None   # no receive waits: the source is asked for nothing
            return pull
        pull.waited = self.wait_aside(pull.works, pull)
        return pull

    def send(self, dst_worker: int, cache: torch.Tensor, runs: list[tuple[int, int]]) -> None:
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            works = [dist.isend(cache[s:s + n], dst=dst_worker) for s, n in runs]
        if self.wait_aside(works) is None:   # NCCL: kept until done (the blocks stay parked till then anyway)
            self.sending = [w for w in self.sending if not w.is_completed()] + works

    def wait_aside(self, works: list, pull: Pull | None = None) -> threading.Event | None:
        """NCCL's works say when they are done (CUDA events). gloo's only complete in wait(),
        which blocks: a thread of their own waits for them and sets the event returned. A
        peer that died or stays silent for RECEIVE_TIMEOUT_S ends them with an error, which
        the pull keeps (a send's is dropped: its blocks stay parked until released)."""
        if self.stream is not None:
            return None
        waited = threading.Event()

        def wait() -> None:
            try:
                for w in works:
                    w.wait(datetime.timedelta(seconds=RECEIVE_TIMEOUT_S))
            except RuntimeError as e:   # gloo's errors: a closed connection, a timeout
                if pull is not None:
                    pull.error = f"{type(e).__name__}: {e}".splitlines()[0]
            waited.set()
        threading.Thread(target=wait, daemon=True).start()
        return waited


TRANSPORTS = {"p2p": P2PTransport, "relay": RelayTransport, "distributed": DistributedTransport}
