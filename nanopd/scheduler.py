"""The per-device scheduler: it picks every step's work and owns the lifetime of every
sequence's KV blocks (through the BlockManager).

Each step the Scheduler takes the running decodes first, then unfinished prompt chunks
(chunked prefill), then waiting sequences first come first served, under a token budget
(max_num_batched_tokens) and a seat limit (max_num_seqs). When the KV cache runs out it
preempts the newest running sequence: its blocks are freed and it is recomputed later,
through the prefix cache where possible.
The engine (engine.py) turns the Batch into a model step and tells the scheduler what was
computed, forked and finished.
"""

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from nanopd.kv_cache import BlockManager, OutOfBlocks
from nanopd.request import Sequence, Status

# ----------------------------------------------------------------------------- scheduler


@dataclass
class Batch:
    """One step's work: each sequence computes its next num_new tokens."""
    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    # (src, dst) blocks to copy before the model runs, and the sequence each copy is for
    copies: list[tuple[int, int]] = field(default_factory=list)
    copied_for: list[Sequence] = field(default_factory=list)
    # sequence -> tokens computed after its own (a decode's last), each an attention row of
    # its own, as a decode's: guesses the step checks, not the sequence's yet. Most steps: none.
    ahead: dict[Sequence, list[int]] = field(default_factory=dict)

    def add(self, seq: Sequence, n: int, copies: list[tuple[int, int]] = ()) -> None:
        self.seqs.append(seq)
        self.num_new.append(n)
        for pair in copies:
            self.copies.append(pair)
            self.copied_for.append(seq)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()   # ordered by arrival: first come, first served
        self.running: list[Sequence] = []          # in admission order; the last is preempted first
        self.token_budget: int | None = None       # tokens per step, if cut (Engine.set_token_budget)
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        if not self.waiting or self.waiting[-1].arrival < seq.arrival:   # a new arrival
            self.waiting.append(seq)
        else:   # a preempted sequence goes back to its place in arrival order
            keys = [s.arrival for s in self.waiting]
            self.waiting.insert(bisect.bisect(keys, seq.arrival), seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, decodes: bool = True, prompts: bool = True,
                 busy: set[Sequence] = frozenset()) -> Batch:
        """This step's work: running decodes, unfinished prompt chunks and new sequences, or
        only the decodes or only the prompts (an engine that steps them apart). busy: the
        sequences another step is computing now; they are neither scheduled nor preempted."""
        # The step's tokens, decodes and prompt chunks together (vLLM's max_num_batched_tokens),
        # may be cut for a while (token_budget), so that a step carrying prompt tokens stays
        # short for the decodes beside it (Sarathi-Serve's token budget).
        budget = min(self.max_num_batched_tokens, self.token_budget or self.max_num_batched_tokens)
        batch = Batch()
        # Running decodes first (each waits on one token), then unfinished prompt chunks. A
        # sequence whose token in flight is its last (max_tokens) only waits to finish.
        todo, chunks = [], []
        for s in self.running:   # one pass: this runs for every sequence of every step
            pending = s.num_pending
            if pending > 1:
                chunks.append(s)
            elif pending == 1 and s.num_outputs < s.request.params.max_tokens:
                todo.append(s)
        todo = (todo if decodes else []) + (chunks if prompts else [])
        for seq in todo:
            if budget == 0:
                break
            # preempted for an earlier one, or the other lane's
            if seq.status != Status.RUNNING or seq in busy:
                continue
            n = min(self._wanted(seq), budget)
            n = self._append_slots(seq, n, batch, busy) if n else 0
            if n == 0:
                continue
            budget -= n + self._scheduled(seq, n, batch, budget - n)
        # Then new (or preempted) sequences, first come first served, while budget and seats remain.
        while prompts and self.waiting and budget > 0:
            seq = self.waiting[0]
            reuse = not seq.request.scores_prompt   # prompt logprobs: every position computed
            if self._seats_held() + self._seats(seq) > self.max_num_seqs \
                    or not self.bm.can_allocate(seq.token_ids, reuse) or not self._admits(seq) or seq in busy:
                break
            self.waiting.popleft()
            seq.block_table, seq.num_computed = self.bm.allocate(seq.token_ids, reuse)
            seq.status = Status.RUNNING
            self.running.append(seq)
            metrics = seq.request.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = time.perf_counter()
                metrics.num_cached_tokens = seq.num_computed
            n = min(seq.num_pending, budget)
            batch.add(seq, n)
            budget -= n
        return batch

    def _seats_held(self) -> int:
        """Seats taken: by the running sequences (a feature's scheduler may hold more)."""
        return len(self.running)

    def _admits(self, seq: Sequence) -> bool:
        """Whether seq, first in the queue, may take a seat now (yes, if one is free)."""
        return True

    def _seats(self, seq: Sequence) -> int:
        """Running sequences this one will become: n > 1 forks after the prompt."""
        return 1 if seq.num_outputs else seq.request.params.n

    # -- what a feature's scheduler changes: a running sequence's tokens, its seats

    def _wanted(self, seq: Sequence) -> int:
        """The tokens seq would compute this step: those before its next token."""
        return seq.num_pending

    def _scheduled(self, seq: Sequence, n: int, batch: Batch, left: int) -> int:
        """seq was given n of its tokens, the step has room for left more: the tokens of the
        step that more work for it took (none here)."""
        return 0

    def _shed(self, seq: Sequence) -> int:
        """The cache is full: tokens of seq's that may go before anyone is preempted (none here)."""
        return 0

    def _append_slots(self, seq: Sequence, n: int, batch: Batch, busy: set[Sequence]) -> int:
        """Room for seq's next n tokens (and its copy-on-write pairs), and seq in the batch;
        the tokens placed. While the cache is full, what seq may shed goes first, then the
        newest running sequences not yet in this batch nor busy are preempted. 0 if seq
        itself had to go."""
        while True:
            try:
                copies = self.bm.append_slots(seq.block_table, seq.num_computed, seq.num_computed + n)
            except OutOfBlocks:
                if shed := self._shed(seq):
                    n -= shed
                    continue
                self.preempt(next(s for s in reversed(self.running) if s not in batch.seqs and s not in busy))
                if seq.status != Status.RUNNING:
                    return 0
                continue
            batch.add(seq, n, copies)
            return n

    def computed(self, batch: Batch) -> None:
        """After a step is launched: its tokens' K/V are (being) written. A block enters the
        prefix cache once its tokens are known, never with a PENDING one."""
        for seq, n in zip(batch.seqs, batch.num_new):
            seq.num_computed += n
            known = len(seq.token_ids) - (seq.pending_row is not None)
            self.bm.cache_computed_blocks(seq.block_table, seq.token_ids, min(seq.num_computed, known))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child runs from now on, sharing every block of parent (copy-on-write). It joins
        the running list beside its parent: it is as old as its request, not a newcomer to
        preempt first."""
        child.block_table = self.bm.fork(parent.block_table)
        child.status = Status.RUNNING
        self.running.insert(self.running.index(parent) + 1, child)

    def allocate(self, token_ids: list[int]) -> tuple[list[int], int] | None:
        """Blocks for token_ids and how many leading tokens the prefix cache already holds;
        None if they do not fit (beside the watermark)."""
        return self.bm.allocate(token_ids) if self.bm.can_allocate(token_ids) else None

    def free(self, block_table: list[int]) -> None:
        """Give blocks back that no running sequence holds (allocate's)."""
        self.bm.free(block_table)

    def preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks; it is recomputed when readmitted (recompute preemption)."""
        self.num_preemptions += 1
        self.bm.free(seq.block_table)
        seq.num_computed = 0
        self.running.remove(seq)
        self.add(seq)

    def finish(self, seq: Sequence, free: bool = True) -> None:
        """Retire seq; free=False keeps its blocks (a prefill worker's, until handed off)."""
        if free:
            self.bm.free(seq.block_table)
        (self.running if seq.status == Status.RUNNING else self.waiting).remove(seq)
        seq.status = Status.FINISHED
