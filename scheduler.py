"""Requests and the per-device scheduler: what a request asks for and gets back, the
sequences it becomes, and the Scheduler that picks every step's work.

Each step the Scheduler takes the running decodes first, then unfinished prompt chunks
(chunked prefill), then waiting sequences first come first served, under a token budget
(max_num_batched_tokens) and a seat limit (max_num_seqs). When the KV cache runs out it
preempts the newest running sequence: its blocks are freed and it is recomputed later,
through the prefix cache where possible. The engine (engine.py) turns the Batch into a
model step.
"""

import bisect
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

import torch

from kv_cache import BlockManager, OutOfBlocks

# ----------------------------------------------------------------------------- requests


@dataclass
class SamplingParams:
    max_tokens: int = 32
    temperature: float = 0.0           # 0: greedy
    top_p: float = 1.0
    top_k: int = -1                    # -1: no limit
    seed: int | None = None            # same seed, same tokens, whatever else is in the batch
    n: int = 1                         # completions per prompt
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None        # also return this many top alternatives per token

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (no limit) or positive, got {self.top_k}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0         # prompt tokens found in the prefix cache
    imported_time: float | None = None  # disaggregated: when the decode worker had the KV
    kv_bytes_moved: int = 0             # ... how much KV it copied
    kv_copy_time: float | None = None   # ... and how long the copy itself took (s)
    seat_wait: float = 0.0              # ... after waiting there for a seat and blocks (s)
    path: tuple[int, ...] = ()          # the workers that served it (prefill, then decode)
    routed: tuple | None = None         # adaptive: (predicted latency ms, prefill worker's WorkerLoad,
                                        # decode worker's WorkerLoad) when the router chose the path

    def kv_copy_GBps(self) -> float:
        """The KV copy's rate (disaggregated; needs kv_copy_time)."""
        return self.kv_bytes_moved / self.kv_copy_time / 1e9

    def phases(self) -> dict[str, float]:
        """Seconds spent queued, prefilling, handing the KV over, waiting for a seat on the
        decode worker (a handoff's wait there) and decoding: the path's cost."""
        decode_start = self.imported_time or self.first_token_time
        return {"queued": self.first_scheduled_time - self.arrival_time,
                "prefill": self.first_token_time - self.first_scheduled_time,
                "transfer": decode_start - self.first_token_time - self.seat_wait,
                "seat_wait": self.seat_wait,
                "decode": self.finish_time - decode_start}


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None          # "stop", "length", or None while running
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    finished: bool = True
    error: ValueError | None = None    # set when the request was rejected; outputs is then empty


class Status(Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


_seq_ids = itertools.count()
PENDING = -1   # a sampled token the host has not received yet


@dataclass(eq=False)
class Sequence:
    """One stream of tokens: a prompt and the completion growing after it."""
    request: "Request"
    index: int                          # which completion of its request
    token_ids: list[int]
    num_prompt_tokens: int
    seq_id: int = field(default_factory=lambda: next(_seq_ids))   # arrival order, for FCFS
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0               # tokens whose K/V are in the cache
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    beam_candidates: list[tuple[int, float]] | None = None   # beam search: (token, logprob)
    # While the step that sampled this sequence's last token is still running, that token
    # is a placeholder (PENDING) on the host, and the next step reads it on the device
    # from row `pending_row` of that step's sampled tokens.
    pending_row: int | None = None

    @property
    def num_pending(self) -> int:
        """Tokens to compute before the next token can be chosen (1 for a decode)."""
        return len(self.token_ids) - self.num_computed

    @property
    def num_outputs(self) -> int:
        """Output tokens sampled so far, the one still on its way from the device included."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:len(self.token_ids) - (self.pending_row is not None)]


@dataclass(eq=False)
class Request:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    beam_width: int = 0                 # > 0: beam search instead of sampling
    length_penalty: float = 1.0
    seqs: list[Sequence] = field(default_factory=list)        # live and finished completions
    beams_done: list[Sequence] = field(default_factory=list)  # beam search: finished hypotheses
    forked: bool = False                # n > 1: children are forked after the first token
    prefill_only: bool = False          # a prefill worker's: stop after the first token, keep the blocks

    @property
    def finished(self) -> bool:
        return all(s.status == Status.FINISHED for s in self.seqs)


# ----------------------------------------------------------------------------- scheduler


@dataclass
class Batch:
    """One step's work: each sequence computes its next num_new tokens."""
    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)   # copy-on-write block pairs


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()   # ordered by seq_id: first come, first served
        self.running: list[Sequence] = []          # in admission order; the last is preempted first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        if not self.waiting or self.waiting[-1].seq_id < seq.seq_id:   # a new arrival
            self.waiting.append(seq)
        else:   # a preempted sequence goes back to its place in arrival order
            keys = [s.seq_id for s in self.waiting]
            self.waiting.insert(bisect.bisect(keys, seq.seq_id), seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        batch, budget = Batch(), self.max_num_batched_tokens
        # Running decodes first (each waits on one token), then unfinished prompt chunks. A
        # sequence whose token in flight is its last (max_tokens) only waits to finish.
        decodes = [s for s in self.running if s.num_pending == 1 and s.num_outputs < s.request.params.max_tokens
                   and not (s.request.prefill_only and s.num_outputs)]
        chunks = [s for s in self.running if s.num_pending > 1]
        for seq in decodes + chunks:
            if budget == 0:
                break
            if seq.status != Status.RUNNING:   # preempted to make room for an earlier one
                continue
            n = min(seq.num_pending, budget)
            copies = self._append_slots(seq, n, batch)
            if copies is None:
                continue
            batch.copies += copies
            batch.seqs.append(seq)
            batch.num_new.append(n)
            budget -= n
        # Then new (or preempted) sequences, first come first served, while budget and seats remain.
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if len(self.running) + self._seats(seq) > self.max_num_seqs or not self.bm.can_allocate(seq.token_ids):
                break
            self.waiting.popleft()
            seq.block_table, seq.num_computed = self.bm.allocate(seq.token_ids)
            seq.status = Status.RUNNING
            self.running.append(seq)
            metrics = seq.request.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = time.perf_counter()
                metrics.num_cached_tokens = seq.num_computed
            n = min(seq.num_pending, budget)
            batch.seqs.append(seq)
            batch.num_new.append(n)
            budget -= n
        return batch

    def _seats(self, seq: Sequence) -> int:
        """Running sequences this one will become: n > 1 and beams fork after the prompt."""
        req = seq.request
        return 1 if req.forked or seq.num_prompt_tokens < len(seq.token_ids) else max(req.params.n, req.beam_width)

    def _append_slots(self, seq: Sequence, n: int, batch: Batch) -> list[tuple[int, int]] | None:
        """Room for seq's next n tokens (and its copy-on-write pairs), preempting the newest
        running sequences not yet in this batch while the cache is full. None if seq itself
        had to go."""
        while True:
            try:
                return self.bm.append_slots(seq.block_table, seq.num_computed, seq.num_computed + n)
            except OutOfBlocks:
                victim = next(s for s in reversed(self.running) if s not in batch.seqs)
                self.preempt(victim)
                if victim is seq:
                    return None

    def preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks; it is recomputed when readmitted (recompute preemption)."""
        self.bm.free(seq.block_table)
        seq.num_computed = 0
        self.running.remove(seq)
        self.num_preemptions += 1
        self.add(seq)

    def finish(self, seq: Sequence, free: bool = True) -> None:
        """Retire seq; free=False keeps its blocks (a prefill worker's, until handed off)."""
        if free:
            self.bm.free(seq.block_table)
        (self.running if seq.status == Status.RUNNING else self.waiting).remove(seq)
        seq.status = Status.FINISHED
