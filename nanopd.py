"""nanoPD: the single-device engine and the offline API.

    from nanopd import LLM, SamplingParams
    outs = LLM("tiny").generate(["Hello"], SamplingParams(max_tokens=32))

How a step works (Engine.step):
  1. Scheduler.schedule picks this step's work under a token budget: running decodes
     first, then prompt chunks (chunked prefill), then new requests, first come first
     served. If the KV cache runs out it preempts the newest sequence (its blocks are
     freed and it is recomputed later, through the prefix cache where possible).
  2. ModelRunner.run turns the batch into tensors (token ids, positions, slot mapping,
     block tables, lengths) and runs the model: pure-decode steps replay a CUDA graph
     captured at start-up for a padded batch size, mixed steps run eagerly.
  3. Every sequence whose last token was computed gets a new token, sampled on the device,
     or, in beam search, its candidate continuations; requests that hit a stop condition
     finish.
  Steps overlap: the host takes step N's tokens (stop checks, outputs) after launching
  step N+1, which reads them on the device (PENDING ids), so the GPU is not left idle
  while Python does its bookkeeping. Beam search, which chooses on the host, waits.

Parallel sampling (n > 1) prefills the prompt once and forks the sequence; beam search
forks and frees sequences each step. Both share blocks through the BlockManager's
copy-on-write.
"""

import argparse
import bisect
import dataclasses
import gc
import itertools
import multiprocessing.connection
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Self

import torch
from tqdm import tqdm

import kernels
from kv_cache import BlockManager, OutOfBlocks, allocate_kv_cache, blocks_for_memory, cdiv, kv_bytes_per_block
from model import AttentionMetadata, Qwen3, load_config, load_model

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
    path: tuple[int, ...] = ()          # the workers that served it (prefill, then decode)

    def phases(self) -> dict[str, float]:
        """Seconds spent queued, prefilling, transferring the KV and decoding (the path's cost)."""
        decode_start = self.imported_time or self.first_token_time
        return {"queued": self.first_scheduled_time - self.arrival_time,
                "prefill": self.first_token_time - self.first_scheduled_time,
                "transfer": decode_start - self.first_token_time,
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


# ----------------------------------------------------------------------------- model runner


class PinnedRing:
    """Pinned host buffers used in turn for asynchronous host <-> device copies.

    Allocating pinned memory, as torch does for every pin_memory=True tensor or
    non-blocking copy to the host, synchronizes with the device, and that would stall the
    overlap of steps. A few reused buffers never allocate. A buffer is reused only after
    its last copy has finished, and 32 copies later: a step makes at most four, and the
    host reads a step's downloads within two steps."""

    def __init__(self, slots: int = 32):
        self.buffers = [torch.empty(0, dtype=torch.uint8, pin_memory=True) for _ in range(slots)]
        self.copied: list[torch.cuda.Event | None] = [None] * slots
        self.next = 0

    def _take(self, like: torch.Tensor) -> tuple[int, torch.Tensor]:
        i, self.next = self.next, (self.next + 1) % len(self.buffers)
        if self.copied[i] is not None:
            self.copied[i].synchronize()
        if self.buffers[i].numel() < like.nbytes:
            self.buffers[i] = torch.empty(2 * like.nbytes, dtype=torch.uint8, pin_memory=True)
        return i, self.buffers[i][:like.nbytes].view(like.dtype).view(like.shape)

    def _record(self, i: int) -> None:
        self.copied[i] = torch.cuda.Event()
        self.copied[i].record()

    def to_device(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        i, pinned = self._take(t)
        pinned.copy_(t)
        out = torch.empty_like(t, device=device).copy_(pinned, non_blocking=True)
        self._record(i)
        return out

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        i, pinned = self._take(t)
        pinned.copy_(t, non_blocking=True)
        self._record(i)
        return pinned


class ModelRunner:
    """Owns the model and its KV cache; turns a Batch into tensors and logits."""

    def __init__(self, model: Qwen3, cfg: "EngineConfig"):
        self.model, self.cfg, self.device = model, cfg, model.device
        if self.device.type == "cuda":   # the streams, graphs and memory queries below mean this device
            torch.cuda.set_device(self.device)
        self.max_blocks_per_seq = cdiv(cfg.max_model_len, cfg.block_size)
        self.num_blocks = cfg.num_kv_blocks or self._blocks_that_fit()
        self.kv_cache = allocate_kv_cache(self.num_blocks, model.num_layers, model.num_kv_heads,
                                          cfg.block_size, model.head_dim, model.dtype, self.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_sizes: list[int] = []
        if self.device.type == "cuda":
            self.uploads, self.downloads = PinnedRing(), PinnedRing()
        if self.device.type == "cuda" and not cfg.enforce_eager:
            self._capture_decode_graphs()

    def upload(self, data: list, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        """A host list as a tensor on the device, without waiting for the device (see PinnedRing)."""
        t = torch.tensor(data, dtype=dtype)
        return self.uploads.to_device(t, self.device) if self.device.type == "cuda" else t

    def _upload(self, *lists: list[int]) -> list[torch.Tensor]:
        """Integer lists -> int32 tensors on the device, all in one copy."""
        return list(self.upload(list(itertools.chain.from_iterable(lists))).split([len(x) for x in lists]))

    def prepare(self, batch: Batch, prev_tokens: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Token ids, positions [num_tokens] and the attention metadata, on the device.
        A PENDING token id is taken, on the device, from prev_tokens (the sampled tokens of
        the step still running), so the host never waits for it."""
        ids, positions, slots, tables, cu, ctx, fills = [], [], [], [], [0], [], []
        bs = self.cfg.block_size
        for seq, n in zip(batch.seqs, batch.num_new):
            start = seq.num_computed
            if seq.pending_row is not None and start <= len(seq.token_ids) - 1 < start + n:
                fills += (len(ids) + len(seq.token_ids) - 1 - start, seq.pending_row)
            ids += seq.token_ids[start:start + n]
            positions += range(start, start + n)
            slots += [seq.block_table[p // bs] * bs + p % bs for p in range(start, start + n)]
            tables.append(seq.block_table)
            cu.append(cu[-1] + n)
            ctx.append(start)
        width = max(len(t) for t in tables)
        flat_tables = [b for t in tables for b in itertools.chain(t, itertools.repeat(0, width - len(t)))]
        ids, positions, slots, cu, ctx, flat_tables, fills = self._upload(
            ids, positions, slots, cu, ctx, flat_tables, fills)
        if len(fills):
            dst, src = fills.view(-1, 2).unbind(1)
            ids[dst] = prev_tokens[src].to(ids.dtype)
        num_decodes = next((i for i, n in enumerate(batch.num_new) if n > 1), len(batch.num_new))
        max_kv_len = max(s.num_computed + n for s, n in zip(batch.seqs, batch.num_new))
        meta = AttentionMetadata(
            slot_mapping=slots, block_tables=flat_tables.view(len(tables), width), cu_q_lens=cu, ctx_lens=ctx,
            max_q_len=max(batch.num_new), num_decodes=num_decodes,
            num_splits=kernels.choose_num_splits(num_decodes, self.model.num_kv_heads, 1, max_kv_len,
                                                 self.device))
        return ids, positions, meta

    @torch.inference_mode()
    def run(self, batch: Batch, sample_rows: list[int], prev_tokens: torch.Tensor | None = None
            ) -> torch.Tensor:
        """Logits [len(sample_rows), vocab], in the model's dtype, of the batch sequences at
        sample_rows. prev_tokens: the running step's sampled tokens (see prepare)."""
        pairs, rows = self._upload([b for pair in batch.copies for b in pair], sample_rows)
        if batch.copies:
            kernels.copy_blocks(self.kv_cache, pairs.view(-1, 2))
        num_seqs = len(batch.seqs)
        graph_bs = next((b for b in self.graph_sizes if b >= num_seqs), None)
        if graph_bs is not None and max(batch.num_new) == 1:
            hidden = self._replay(batch, graph_bs, prev_tokens)   # one token per sequence
        else:
            ids, positions, meta = self.prepare(batch, prev_tokens)
            hidden = self.model(ids, positions, self.kv_cache, meta)
            rows = (meta.cu_q_lens[1:] - 1)[rows]   # each sequence's last new token
        return self.model.compute_logits(hidden[rows])

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """Start copying t to the host; the result is valid once the device reaches this point."""
        return self.downloads.to_host(t) if t.is_cuda else t

    # -- CUDA graphs for decode: one per padded batch size, sharing one memory pool

    def _capture_decode_graphs(self) -> None:
        """Graphs of the model body (logits are computed afterwards, for the rows needed)
        at batch sizes 1, 2, 4, 8, then every 16 up to 256 and every 64 beyond."""
        max_bs = self.cfg.max_num_seqs
        sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(320, max_bs + 64, 64))
        sizes = [b for b in sizes if b < max_bs] + [max_bs]
        dev, n = self.device, sizes[-1]
        self.static = {
            "ids": torch.zeros(n, dtype=torch.long, device=dev), "pos": torch.zeros(n, dtype=torch.long, device=dev),
            "slots": torch.full((n,), -1, dtype=torch.int32, device=dev),
            "tables": torch.zeros(n, self.max_blocks_per_seq, dtype=torch.int32, device=dev),
            "cu": torch.arange(n + 1, dtype=torch.int32, device=dev),
            "ctx": torch.zeros(n, dtype=torch.int32, device=dev)}
        st, pool = self.static, None
        # Warm up and capture on one side stream, with the garbage collector off: a
        # collection mid-capture can free CUDA objects (events of pinned buffers, old
        # graphs), which invalidates the capture.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        gc.collect()
        gc.disable()
        try:
            with torch.cuda.stream(stream):
                self._capture_graphs(sizes, st, pool, stream)
        finally:
            gc.enable()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph_sizes = sorted(self.graphs)
        torch.cuda.synchronize()

    def _capture_graphs(self, sizes: list[int], st: dict, pool, stream: torch.cuda.Stream) -> None:
        dev = self.device
        for bs in tqdm(sorted(sizes, reverse=True), desc="capturing decode CUDA graphs", leave=False):
            meta = AttentionMetadata(
                slot_mapping=st["slots"][:bs], block_tables=st["tables"][:bs], cu_q_lens=st["cu"][:bs + 1],
                ctx_lens=st["ctx"][:bs], max_q_len=1, num_decodes=bs,
                num_splits=kernels.choose_num_splits(bs, self.model.num_kv_heads, 1, self.cfg.max_model_len,
                                                     dev))

            def forward(bs=bs, meta=meta):
                return self.model(st["ids"][:bs], st["pos"][:bs], self.kv_cache, meta)
            forward()   # compile and warm up outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool, stream=stream, capture_error_mode="thread_local"):
                hidden = forward()
            pool = graph.pool()
            self.graphs[bs] = (graph, hidden)

    def _replay(self, batch: Batch, bs: int, prev_tokens: torch.Tensor | None) -> torch.Tensor:
        """Copy the step's inputs into the graph's static buffers (padding the batch to bs
        sequences with no tokens and no cache writes), then replay the graph."""
        st, n = self.static, len(batch.seqs)
        ids, positions, meta = self.prepare(batch, prev_tokens)
        width = meta.block_tables.shape[1]
        st["ids"][:n].copy_(ids)
        st["pos"][:n].copy_(positions)
        st["slots"][:bs].fill_(-1)
        st["slots"][:n].copy_(meta.slot_mapping)
        st["tables"][:n, :width].copy_(meta.block_tables)
        st["cu"][:n + 1].copy_(meta.cu_q_lens)
        st["cu"][n + 1:bs + 1].fill_(n)
        st["ctx"][:n].copy_(meta.ctx_lens)
        graph, hidden = self.graphs[bs]
        graph.replay()
        return hidden[:n]

    # -- KV cache sizing

    def _blocks_that_fit(self) -> int:
        cfg, m = self.cfg, self.model
        per_block = kv_bytes_per_block(m.num_layers, m.num_kv_heads, cfg.block_size, m.head_dim, m.dtype)
        if self.device.type != "cuda":   # CPU: a fixed 256 MiB, enough for tests and demos
            return max(blocks_for_memory(1 << 28, per_block), self.max_blocks_per_seq + 1)
        # Profile the largest step (a full token budget, and logits for every seat), then
        # give the cache what is left of gpu_memory_utilization.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        n = cfg.max_num_batched_tokens
        scratch = allocate_kv_cache(cdiv(n, cfg.block_size), m.num_layers, m.num_kv_heads, cfg.block_size,
                                    m.head_dim, m.dtype, self.device)
        with torch.inference_mode():
            ids = torch.zeros(n, dtype=torch.long, device=self.device)
            meta = AttentionMetadata(
                slot_mapping=torch.arange(n, dtype=torch.int32, device=self.device),
                block_tables=torch.arange(scratch.shape[0], dtype=torch.int32, device=self.device)[None],
                cu_q_lens=torch.tensor([0, n], dtype=torch.int32, device=self.device),
                ctx_lens=torch.zeros(1, dtype=torch.int32, device=self.device), max_q_len=n)
            hidden = m(ids, ids, scratch, meta)
            rows = min(cfg.max_num_seqs, n)
            logits = m.compute_logits(hidden[:1].expand(rows, -1))
            sample(logits, [SamplingParams(temperature=1.0, top_p=0.9)] * rows, [None] * rows)
        peak = torch.cuda.max_memory_allocated() - before - scratch.nbytes
        del scratch, hidden, logits
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        budget = cfg.gpu_memory_utilization * total - (total - free) - peak
        num = blocks_for_memory(int(budget), per_block)
        if num < self.max_blocks_per_seq:
            raise ValueError(f"only {num} KV blocks fit in gpu_memory_utilization="
                             f"{cfg.gpu_memory_utilization}; one max_model_len sequence needs "
                             f"{self.max_blocks_per_seq}")
        return num


# ----------------------------------------------------------------------------- sampling


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           upload: Callable[[list, torch.dtype], torch.Tensor] | None = None) -> torch.Tensor:
    """One token per row of logits [R, vocab]. Greedy rows take the argmax; the others draw
    from softmax(logits / T) restricted by top-k and top-p, through the exponential race
    argmax(p / E), E ~ Exp(1): seeded rows draw E from their own generator, so their tokens
    do not depend on the other rows. upload puts host lists on the logits' device
    (ModelRunner.upload, which never waits for the device)."""
    upload = upload or (lambda data, dtype: torch.tensor(data, dtype=dtype, device=logits.device))
    greedy = logits.argmax(-1)
    rows = [i for i, p in enumerate(params) if p.temperature > 0]
    if not rows:
        return greedy
    top_k = [params[i].top_k if params[i].top_k > 0 else logits.shape[1] for i in rows]
    top_p = [params[i].top_p for i in rows]
    knobs = upload([[params[i].temperature, top_p[j], top_k[j]] for j, i in enumerate(rows)], torch.float32)
    row_ids = upload(rows, torch.int64)
    x = logits[row_ids].float() / knobs[:, :1]
    if min(top_k) < x.shape[1] or min(top_p) < 1.0:
        x = apply_top_k_top_p(x, knobs[:, 2], knobs[:, 1])
    noise = torch.empty_like(x).exponential_()
    for j, i in enumerate(rows):
        if generators[i] is not None:
            noise[j].exponential_(generator=generators[i])
    greedy[row_ids] = (x.softmax(-1) / noise).argmax(-1)
    return greedy


def apply_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf the logits outside each row's top_k, then outside the smallest set whose
    probability reaches top_p (the most likely token always stays)."""
    sorted_x, order = x.sort(-1, descending=True)
    rank = torch.arange(x.shape[1], device=x.device)
    sorted_x.masked_fill_(rank[None] >= top_k[:, None], float("-inf"))
    probs = sorted_x.softmax(-1)
    sorted_x.masked_fill_(probs.cumsum(-1) - probs > top_p[:, None], float("-inf"))
    return torch.full_like(x, float("-inf")).scatter_(-1, order, sorted_x)


# ----------------------------------------------------------------------------- the engine


def check_request(ids: list[int], params: SamplingParams, beam_width: int, vocab: int, cfg: "EngineConfig",
                  room_blocks: int) -> None:
    """Raise a ValueError naming what is wrong with a request; room_blocks is the KV cache's
    size less its watermark (the most one request may ever hold)."""
    params.validate()
    if not ids:
        raise ValueError("the prompt is empty")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
    if len(ids) + params.max_tokens > cfg.max_model_len:
        raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                         f"max_model_len ({cfg.max_model_len})")
    if params.logprobs is not None and params.logprobs > vocab:
        raise ValueError(f"logprobs={params.logprobs} exceeds the vocabulary size ({vocab})")
    width = max(params.n, beam_width)
    if width > cfg.max_num_seqs:
        raise ValueError(f"{'beam_width' if beam_width else 'n'}={width} exceeds max_num_seqs ({cfg.max_num_seqs})")
    # Beams advance together, so all of them must fit at once (full prompt blocks are
    # shared; each beam owns the rest). Samples of n > 1 progress independently: one must fit.
    bs = cfg.block_size
    shared = len(ids) // bs if beam_width else 0
    need = shared + (beam_width or 1) * (cdiv(len(ids) + params.max_tokens, bs) - shared)
    if need > room_blocks:
        raise ValueError(f"the request needs {need} KV blocks, more than the whole cache holds ({room_blocks})")


@dataclass
class EngineConfig:
    model: str = "tiny"
    dtype: str | torch.dtype | None = None
    device: str | None = None
    block_size: int = 16
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 256
    max_model_len: int = 4096
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enforce_eager: bool = False        # no CUDA graphs
    seed: int = 0                      # random weights of presets

    def validate(self) -> None:
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1 (or None to size it), got {self.num_kv_blocks}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.device is not None and str(self.device).startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} asked for, but CUDA is not available")


class ByteTokenizer:
    """For random-weight presets (and checkpoints without tokenizer files): UTF-8 bytes."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], **_) -> str:
        return bytes(i for i in ids if i < 256).decode(errors="replace")


def load_tokenizer(model_name: str):
    folder = Path(model_name)
    if folder.is_dir() and any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(folder)
    return ByteTokenizer()


@dataclass
class LaunchedStep:
    """A step whose sampled tokens are still on their way to the host (see Engine.step)."""
    seqs: list[Sequence]                 # the sequences whose last token this step computed
    beams: list[Sequence]                # ... those in beam search: the host picks their tokens
    beam_logits: torch.Tensor | None = None
    targets: list[tuple[Sequence, int]] = field(default_factory=list)   # per sampled row: where its token goes
    tokens: torch.Tensor | None = None   # [rows] on the device: the next step's PENDING ids come from here
    want_logprobs: list[int] = field(default_factory=list)   # rows that report logprobs
    host: list[torch.Tensor] = field(default_factory=list)   # tokens (and logprobs), copying to the host
    ready: torch.cuda.Event | None = None


class Engine:
    def __init__(self, cfg: EngineConfig):
        cfg.validate()
        self.model = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device, seed=cfg.seed)
        config = self.model.config
        cfg.max_model_len = min(cfg.max_model_len, config.max_position_embeddings)
        self.cfg = cfg
        self.tokenizer = load_tokenizer(cfg.model)
        eos = config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.runner = ModelRunner(self.model, cfg)
        self.bm = BlockManager(self.runner.num_blocks, cfg.block_size,
                               enable_prefix_caching=cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.bm, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.num_prefill_tokens = 0   # prompt tokens actually computed (prefix hits excluded)
        self.in_flight: LaunchedStep | None = None   # launched, its tokens not yet taken
        self._request_ids = itertools.count()

    # -- requests

    def add_request(self, prompt: str | list[int], params: SamplingParams, beam_width: int = 0,
                    length_penalty: float = 1.0, request_id: int | None = None,
                    prefill_only: bool = False) -> Request:
        """Validate and queue a request; a bad one raises ValueError and changes nothing."""
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_request(ids, params, beam_width, self.model.config.vocab_size, self.cfg,
                      self.bm.num_blocks - self.bm.watermark_blocks)
        req = Request(next(self._request_ids) if request_id is None else request_id, text, ids, params,
                      RequestMetrics(time.perf_counter()), beam_width=beam_width, length_penalty=length_penalty,
                      prefill_only=prefill_only)
        self._add_seq(req, 0, list(ids))
        return req

    def add_prefilled(self, request_id: int, token_ids: list[int], num_prompt_tokens: int,
                      params: SamplingParams, block_table: list[int], logprobs: list[dict[int, float]],
                      cumulative_logprob: float, generator_state: bytes | None) -> Request:
        """A request whose prompt was prefilled elsewhere (a decode worker's import): its KV for
        the prompt is already in block_table, and its first token is token_ids[-1]."""
        req = Request(request_id, None, token_ids[:num_prompt_tokens], params, RequestMetrics(time.perf_counter()),
                      forked=True)
        seq = Sequence(req, 0, list(token_ids), num_prompt_tokens, status=Status.RUNNING, block_table=block_table,
                       num_computed=num_prompt_tokens, cumulative_logprob=cumulative_logprob,
                       logprobs=list(logprobs), generator=self._generator(req, 0))
        if generator_state is not None:   # carry on the random stream where the prefill worker left it
            seq.generator.set_state(torch.frombuffer(bytearray(generator_state), dtype=torch.uint8))
        req.seqs.append(seq)
        self.scheduler.running.append(seq)
        return req

    def _add_seq(self, req: Request, index: int, token_ids: list[int]) -> Sequence:
        seq = Sequence(req, index, token_ids, len(req.prompt_token_ids), generator=self._generator(req, index))
        req.seqs.append(seq)
        self.scheduler.add(seq)
        return seq

    def fork(self, seq: Sequence, index: int) -> Sequence:
        """A running child sharing every block of seq (copy-on-write)."""
        child = Sequence(seq.request, index, list(seq.token_ids), seq.num_prompt_tokens,
                         status=Status.RUNNING, block_table=self.bm.fork(seq.block_table),
                         num_computed=seq.num_computed, cumulative_logprob=seq.cumulative_logprob,
                         logprobs=list(seq.logprobs), generator=self._generator(seq.request, index))
        seq.request.seqs.append(child)
        self.scheduler.running.append(child)
        return child

    def _generator(self, req: Request, index: int) -> torch.Generator | None:
        """Completion `index` of a seeded request draws from its own generator, seeded seed + index."""
        if req.params.seed is None:
            return None
        return torch.Generator(self.model.device).manual_seed(req.params.seed + index)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self.in_flight is not None

    # -- one step: launch it, then finish the previous one while the device computes

    def step(self) -> list[Request]:
        """Schedule and launch a batch, then finish the step launched before it, whose
        sampled tokens were copied to the host meanwhile: the host's bookkeeping overlaps
        the device's work instead of leaving it idle. Returns the requests that finished."""
        batch = self.scheduler.schedule()
        launched = self._launch(batch) if batch.seqs else None
        finished = self._finish(self.in_flight) if self.in_flight else []
        self.in_flight = launched
        if launched is not None and launched.beams:   # beam search chooses on the host, now
            finished += self._finish(launched)
            self.in_flight = None
        return finished

    def _launch(self, batch: Batch) -> "LaunchedStep":
        """Run the model on the batch and sample on the device; each sampled sequence gets a
        PENDING token, filled in by _finish."""
        for seq, n in zip(batch.seqs, batch.num_new):
            if seq.num_computed < seq.num_prompt_tokens:
                self.num_prefill_tokens += min(n, seq.num_prompt_tokens - seq.num_computed)
        done = [i for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new)) if n == s.num_pending]
        logits = self.runner.run(batch, done, self.in_flight.tokens if self.in_flight else None)
        for seq, n in zip(batch.seqs, batch.num_new):
            seq.num_computed += n
            # A block enters the prefix cache once its tokens are known: never with a PENDING one.
            known = len(seq.token_ids) - (seq.pending_row is not None)
            self.bm.cache_computed_blocks(seq.block_table, seq.token_ids, min(seq.num_computed, known))
        seqs = [batch.seqs[i] for i in done]
        step = LaunchedStep(seqs, [s for s in seqs if s.request.beam_width])
        if step.beams:
            step.beam_logits = logits[[i for i, s in enumerate(seqs) if s.request.beam_width]].float()
        rows = [i for i, s in enumerate(seqs) if not s.request.beam_width]
        # n > 1: the prompt's only sequence is forked before its first token, and each child
        # draws its own first token from the same logits.
        expanded = [(i, j) for i in rows for j in range(self._draws(seqs[i]))]
        targets = [seqs[i] if j == 0 else self.fork(seqs[i], j) for i, j in expanded]
        for i in rows:
            seqs[i].request.forked = True
        if not targets:
            return step
        upload = self.runner.upload
        source_rows = [i for i, _ in expanded]
        row_logits = logits if source_rows == list(range(len(logits))) else logits[upload(source_rows)]
        step.tokens = sample(row_logits, [t.request.params for t in targets], [t.generator for t in targets],
                             upload)
        host = [step.tokens]
        step.want_logprobs = [k for k, t in enumerate(targets) if t.request.params.logprobs is not None]
        if step.want_logprobs:   # the chosen token's logprob and the top alternatives, on the device
            want = upload(step.want_logprobs, torch.int64)
            lp = torch.log_softmax(row_logits[want].float(), -1)
            top = lp.topk(max(1, max(targets[k].request.params.logprobs for k in step.want_logprobs)), -1)
            host += [lp.gather(1, step.tokens[want, None])[:, 0], top.values, top.indices]
        step.host = [self.runner.to_host(t) for t in host]
        if self.model.device.type == "cuda":
            step.ready = torch.cuda.Event()
            step.ready.record()
        for k, seq in enumerate(targets):
            seq.token_ids.append(PENDING)
            seq.pending_row = k
            step.targets.append((seq, len(seq.token_ids) - 1))
        return step

    def _finish(self, step: "LaunchedStep") -> list[Request]:
        """Fill a launched step's PENDING tokens, record logprobs, stop sequences, advance
        beams. Returns the requests that finished."""
        if step.ready is not None:
            step.ready.synchronize()
        now = time.perf_counter()
        for seq in step.seqs:
            if seq.request.metrics.first_token_time is None:
                seq.request.metrics.first_token_time = now
        tokens, *logprobs = [t.tolist() for t in step.host] or [[]]
        logprobs = dict(zip(step.want_logprobs, zip(*logprobs)))
        for k, ((seq, index), token) in enumerate(zip(step.targets, tokens)):
            if seq.status == Status.FINISHED:   # it stopped one step earlier: this token is void
                continue
            seq.token_ids[index] = token
            if index == len(seq.token_ids) - 1:   # no later step has sampled after it yet
                seq.pending_row = None
            if k in logprobs:
                self._record_logprobs(seq, token, *logprobs[k])
            self._check_stop(seq, index)
        if step.beams:
            self._store_beam_candidates(step.beams, step.beam_logits)
        # Requests that may have finished: a sequence of theirs stopped, or a beam step ran.
        touched = {s.request: None for s, _ in step.targets if s.status == Status.FINISHED}
        touched.update({s.request: None for s in step.beams})
        finished = []
        for req in touched:
            if req.beam_width and not req.finished and all(s.beam_candidates is not None for s in req.seqs
                                                           if s.status != Status.FINISHED):
                self._advance_beams(req)
            if req.finished and req.metrics.finish_time is None:
                req.metrics.finish_time = now
                finished.append(req)
        return finished

    def _draws(self, seq: Sequence) -> int:
        return seq.request.params.n if not seq.request.forked else 1

    def _record_logprobs(self, seq: Sequence, token: int, token_logprob: float, top_values: list[float],
                         top_ids: list[int]) -> None:
        k = seq.request.params.logprobs
        entry = dict(zip(top_ids[:k], top_values[:k]))
        entry[token] = token_logprob
        seq.logprobs.append(entry)
        seq.cumulative_logprob += token_logprob

    def _check_stop(self, seq: Sequence, index: int) -> None:
        """Finish seq if its token at index ends it; a later token, already sampled by the
        step running now, is dropped."""
        params, token = seq.request.params, seq.token_ids[index]
        if token in params.stop_token_ids or (token in self.eos_ids and not params.ignore_eos):
            seq.finish_reason = "stop"
        elif index + 1 - seq.num_prompt_tokens >= params.max_tokens:
            seq.finish_reason = "length"
        elif not seq.request.prefill_only:
            return
        del seq.token_ids[index + 1:]
        seq.pending_row = None
        # A prefill worker's request ends after its first token with finish_reason None;
        # its blocks stay until a decode worker has pulled them (workers.py).
        self.scheduler.finish(seq, free=seq.finish_reason is not None)

    # -- beam search: fork the best continuations, free the rest (HF's algorithm)

    def _store_beam_candidates(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        logprobs = torch.log_softmax(logits, -1)
        top = logprobs.topk(2 * max(s.request.beam_width for s in seqs), -1)
        for seq, tokens, values in zip(seqs, top.indices.tolist(), top.values.tolist()):
            k = 2 * seq.request.beam_width
            seq.beam_candidates = list(zip(tokens[:k], values[:k]))

    def _advance_beams(self, req: Request) -> None:
        """One beam-search step over all live beams' candidates, as HF's beam search does:
        of the 2k best continuations (by summed logprob), those among the first k that end
        (EOS, or max_tokens reached) become finished hypotheses, scored by summed logprob /
        length ** length_penalty, of which the best k are kept; the best k that do not end
        go on as the live beams. The search stops when nothing is live or, with k finished,
        when the best live beam can no longer beat the worst finished one."""
        k, live = req.beam_width, [s for s in req.seqs if s.status != Status.FINISHED]
        last_step = len(live[0].output_ids) + 1 >= req.params.max_tokens
        cands = sorted(((s.cumulative_logprob + lp, s, t) for s in live for t, lp in s.beam_candidates),
                       key=lambda c: -c[0])[:2 * k]
        keep = []
        for rank, (score, parent, token) in enumerate(cands):
            is_eos = token in self.eos_ids and not req.params.ignore_eos
            if is_eos or last_step:
                if rank < k:
                    req.beams_done.append(self._finished_beam(parent, token, score, "stop" if is_eos else "length"))
            elif len(keep) < k:
                keep.append((score, parent, token))
        req.beams_done = sorted(req.beams_done, key=lambda b: -self.beam_score(b))[:k]
        # A parent chosen more than once is forked; all forks before any token is appended.
        taken, chosen = set(), []
        for score, parent, token in keep:
            chosen.append((parent if parent not in taken else self.fork(parent, len(req.seqs)), score, token))
            taken.add(parent)
        for seq, score, token in chosen:
            seq.token_ids.append(token)
            seq.cumulative_logprob = score
            seq.beam_candidates = None
        for seq in live:
            if seq not in taken:
                self._drop_beam(req, seq)
        best_live = keep[0][0] / (len(live[0].output_ids) + 1) ** req.length_penalty if keep else None
        if best_live is None or (len(req.beams_done) == k and best_live <= self.beam_score(req.beams_done[-1])):
            for seq in [s for s in req.seqs if s.status != Status.FINISHED]:
                self._drop_beam(req, seq)
            req.seqs = req.beams_done

    def _drop_beam(self, req: Request, seq: Sequence) -> None:
        self.scheduler.finish(seq)   # its blocks go back (shared ones stay with the other beams)
        req.seqs.remove(seq)

    def _finished_beam(self, parent: Sequence, token: int, score: float, reason: str) -> Sequence:
        return Sequence(parent.request, -1, parent.token_ids + [token], parent.num_prompt_tokens,
                        status=Status.FINISHED, cumulative_logprob=score, finish_reason=reason)

    def beam_score(self, seq: Sequence) -> float:
        return seq.cumulative_logprob / len(seq.output_ids) ** seq.request.length_penalty

    # -- outputs

    def output(self, req: Request) -> RequestOutput:
        def text(ids):
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        want_lp = req.params.logprobs is not None or req.beam_width > 0
        outs = [CompletionOutput(i if req.beam_width else s.index, s.output_ids, text(s.output_ids),
                                 s.finish_reason, s.cumulative_logprob if want_lp else None,
                                 s.logprobs if req.params.logprobs is not None else None)
                for i, s in enumerate(sorted(req.seqs, key=lambda s: s.index) if not req.beam_width
                                      else req.seqs)]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, req.metrics,
                             finished=req.finished)


# ----------------------------------------------------------------------------- many devices: the central scheduler

POLICIES = ("collocated", "disaggregated")


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
    samples: list[int] = field(default_factory=list)  # n > 1 split into samples (disaggregated)
    parent: int | None = None


class CentralScheduler:
    """Serves requests on worker processes (workers.py), one per device, under a policy:

      collocated     every device runs a whole engine; a request goes to the least loaded
      disaggregated  num_prefill devices prefill, the others decode; a prefilled request's
                     KV moves to the decode worker with the fewest requests

    A worker that dies: the requests it held (prefilling, decoding, or with KV parked on
    it for a transfer) start again from their prompt on live workers, once; if no live
    worker can take them, or they fail a second time, they end with a RuntimeError in
    RequestOutput.error. Nothing waits on a dead worker. close() (also run at exit and
    when the object is collected) stops every worker process."""

    def __init__(self, model: str, policy: str, devices: list[str], num_prefill: int = 1,
                 transport: str = "p2p", startup_timeout_s: float = 600.0, **engine_kwargs):
        from workers import TRANSPORTS, worker_main
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r} is not one of {', '.join(POLICIES)}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport {transport!r} is not one of {', '.join(TRANSPORTS)}")
        if not devices:
            raise ValueError("devices is empty")
        if policy == "disaggregated" and not 0 < num_prefill < len(devices):
            raise ValueError(f"disaggregated needs 1 <= num_prefill < len(devices), got num_prefill={num_prefill} "
                             f"with {len(devices)} devices")
        self.cfg = EngineConfig(model=model, **engine_kwargs)
        self.cfg.validate()
        config = load_config(model)
        self.cfg.max_model_len = min(self.cfg.max_model_len, config.max_position_embeddings)
        self.vocab_size, self.tokenizer = config.vocab_size, load_tokenizer(model)
        self.policy, self.devices = policy, list(devices)
        self.roles = (["collocated"] * len(devices) if policy == "collocated"
                      else ["prefill"] * num_prefill + ["decode"] * (len(devices) - num_prefill))
        ctx = torch.multiprocessing.get_context("spawn")
        # Reports come back on one pipe per worker: a worker killed in the middle of a
        # write can break only its own pipe (a queue shared by all would stay locked).
        pipes = [ctx.Pipe(duplex=False) for _ in devices]
        self.reports = [reader for reader, _ in pipes]
        self.inboxes = [ctx.Queue() for _ in devices]
        shares = [ctx.Queue() if role == "decode" else None for role in self.roles]
        decode_shares = [q for q in shares if q is not None]
        self.procs = []
        for i, (role, device) in enumerate(zip(self.roles, devices)):
            kwargs = dataclasses.asdict(self.cfg) | {"device": device}
            args = (i, role, kwargs, self.inboxes[i], pipes[i][1], decode_shares if role == "prefill" else [],
                    shares[i], self.roles.count("prefill"), transport)
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
        self._rids = itertools.count()
        self.room = self._wait_ready(startup_timeout_s)

    def _wait_ready(self, timeout_s: float) -> int:
        """Block until every worker reports ready; the smallest cache's room in blocks."""
        rooms, deadline = {}, time.monotonic() + timeout_s
        with tqdm(total=len(self.procs), desc="starting workers", leave=False) as bar:
            while len(rooms) < len(self.procs):
                for w, events in self._receive(0.5):
                    for event in events:
                        if event[0] == "ready":
                            rooms[w] = event[1] - event[2]
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
        if self.policy == "disaggregated" and params.n > 1 and not beam_width:
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

    def _dispatch(self, t: Tracked) -> None:
        from workers import Submit
        # Beam search runs whole on one worker (its beams fork and die every step).
        whole = self.policy == "collocated" or t.beam_width > 0
        live = self._live("collocated" if self.policy == "collocated" else "prefill")
        if not live or (self.policy == "disaggregated" and not self._live("decode")):
            return self._fail(t, RuntimeError(f"no live worker can serve it (dead: {self._dead_summary()})"))
        w = min(live, key=self._load)
        t.worker = t.prefill_worker = w
        t.phase = "prefill"
        self.inboxes[w].put(Submit(t.rid, t.prompt_ids, t.params, prefill_only=not whole,
                                   beam_width=t.beam_width, length_penalty=t.length_penalty))

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
        from workers import Import, Release
        kind = event[0]
        if kind == "failed":
            self.errors[w] = event[1]
            return []
        if kind == "status":   # (free KV blocks, all KV blocks, requests held)
            self.status[w] = event[1:]
            return []
        if kind == "tokens":
            for rid, ids in event[1].items():
                t = self.active.get(rid)
                if t is not None and t.worker == w:
                    t.tokens += ids
                    t.metrics.first_token_time = t.metrics.first_token_time or event[2]
            return []
        t = self.active.get(event[1])
        if t is None or (kind != "handoff" and t.worker != w and not (kind == "expired" and t.prefill_worker == w)):
            return []   # a stale report from an attempt that was restarted elsewhere
        if kind == "handoff":
            (_, rid, blocks, token_ids, num_prompt, logprobs, cum_lp, gen_state, scheduled, first) = event
            t.metrics.first_scheduled_time, t.metrics.first_token_time = scheduled, first
            t.tokens = token_ids[num_prompt:]
            decoders = self._live("decode")
            if not decoders:
                self.inboxes[w].put(Release(rid))
                return self._fail(t, RuntimeError(f"no live decode worker (dead: {self._dead_summary()})"))
            d = min(decoders, key=self._load)
            t.worker, t.phase = d, "transfer"
            self.inboxes[d].put(Import(rid, w, blocks, token_ids, num_prompt, t.params, logprobs, cum_lp, gen_state))
        elif kind == "imported":
            _, _, t.metrics.imported_time, t.metrics.kv_bytes_moved, t.metrics.kv_copy_time = event
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
            return self._end(t)
        elif kind == "expired" and t.phase == "transfer":
            return self._fail(t, RuntimeError(f"its KV was never pulled from worker {w}"))
        return []

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
        from workers import Drop, Release
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
                 num_prefill: int = 1, transport: str = "p2p", **kwargs):
        self.engine = self.cluster = None
        if policy is None:
            self.engine = Engine(EngineConfig(model=model, **kwargs))
        else:
            if devices is None:   # every GPU, or two CPU workers
                devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())] or ["cpu", "cpu"]
            self.cluster = CentralScheduler(model, policy, devices, num_prefill, transport, **kwargs)

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
