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
"""

import ctypes
import functools
import time
from dataclasses import dataclass

import torch


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
    pushing, which was slower on the H200 pair (docs/workers.md), and would give this
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
