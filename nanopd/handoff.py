"""The KV handoff's engine side (workers.py drives it, docs/workers.md).

A prefill worker's engine parks a request it was sent prefill_only: the request ends after
its first token with finish_reason None, its blocks kept until a decode worker has pulled
them (release). A decode worker's scheduler seats the requests it imports while their KV is
copied in, first come, first served beside its own prompts: an import that arrived before a
prompt takes its seat first (queue_import, start_import), holds it while copying
(importing), then joins the decodes (Engine.add_imported) or gives it back (cancel_import).

with_handoff(engine class) gives any engine (plain, speculating, split) both sides, as
every worker's engine has them; the offline LLM's engine has neither.
"""

import bisect
import functools

from nanopd.config import EngineConfig
from nanopd.engine import Engine, engine_class
from nanopd.request import Request, Sequence, Status
from nanopd.scheduler import Scheduler


class HandoffSeats(Scheduler):
    """A Scheduler that also holds seats for imports (mixed in before a Scheduler class)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.importing = 0                     # seats held by imports whose KV is being copied in
        self.imports_waiting: list[int] = []   # arrival orders of imports waiting for seats, oldest first

    def _seats_held(self) -> int:
        return super()._seats_held() + self.importing

    def _admits(self, seq: Sequence) -> bool:
        """An import that arrived before seq is waiting for a seat: it goes first."""
        return super()._admits(seq) and not (self.imports_waiting and self.imports_waiting[0] < seq.arrival)

    def _wanted(self, seq: Sequence) -> int:
        """A prefill_only request whose first token is in flight only waits to park."""
        return 0 if seq.request.prefill_only and seq.num_outputs else super()._wanted(seq)

    def queue_import(self, order: int) -> None:
        """An import arrived `order`-th (request.arrival_order) and waits for a seat: the
        prompts that arrive after it wait for it, and so do the imports."""
        bisect.insort(self.imports_waiting, order)

    def forget_import(self, order: int) -> None:
        """An import that was waiting for a seat will not start (dropped, or started now)."""
        if order in self.imports_waiting:
            self.imports_waiting.remove(order)

    def start_import(self, token_ids: list[int], order: int, block_table: list[int] | None = None
                     ) -> tuple[list[int], int] | None:
        """A seat, and blocks, for a sequence whose K/V is about to be copied in from another
        worker (block_table given: it is already here), which arrived `order`-th (see
        request.arrival_order). None while none is free, or while a prompt or a queued
        import that arrived earlier waits for a seat: seats go first come, first served.
        A queued import that gets its seat leaves the queue."""
        if self._seats_held() >= self.max_num_seqs:
            return None
        if self.waiting and self.waiting[0].arrival < order:   # a prompt that came first goes first
            return None
        if self.imports_waiting and self.imports_waiting[0] < order:   # so does an import
            return None
        room = (block_table, 0) if block_table is not None else self.allocate(token_ids)
        if room is not None:
            self.importing += 1
            self.forget_import(order)
        return room

    def cancel_import(self, block_table: list[int]) -> None:
        self.importing -= 1
        self.free(block_table)

    def finish_import(self, seq: Sequence) -> None:
        """The imported sequence's K/V is in its block table: it joins the decodes."""
        self.importing -= 1
        seq.status = Status.RUNNING
        self.running.append(seq)


class HandoffEngine(Engine):
    """An Engine that parks its prefill_only requests and takes imported ones (mixed in
    before an Engine class, its scheduler a HandoffSeats)."""

    def submit(self, prompt: str | list[int], params, request_id: int | None = None,
               prefill_only: bool = False) -> int:
        """Engine.submit; prefill_only: end after the first token and park (keep the blocks)."""
        request_id = super().submit(prompt, params, request_id)
        self.requests[request_id].prefill_only = prefill_only
        return request_id

    def _check_stop(self, seq: Sequence, index: int) -> None:
        """A prefill_only request's first token, unless it stopped it, parks it."""
        super()._check_stop(seq, index)
        if seq.status != Status.FINISHED and seq.request.prefill_only:
            self._stop(seq, index, free=False)

    def add_imported(self, seq: Sequence) -> None:
        """A request prefilled elsewhere, whose KV is in seq's blocks (workers.py copied it in
        on a seat the scheduler gave it), joins the decodes."""
        # our own parked record gives way to the decoding one
        self.requests.pop(seq.request.request_id, None)
        self.requests[seq.request.request_id] = seq.request
        self.scheduler.finish_import(seq)

    def release(self, request_id: int) -> None:
        """Forget a parked request and free its blocks (its KV has been copied, or never will be)."""
        req = self.requests.get(request_id)
        if req is not None and req.parked:
            self._retire(req)
            del self.requests[request_id]

    def _retire(self, req: Request) -> None:
        """Engine._retire; a parked request's blocks go back too."""
        super()._retire(req)
        if req.parked:
            self.scheduler.free(req.seqs[0].block_table)

    def _end_unschedulable(self) -> list[int]:
        """Nothing is stuck while an import or a handoff will free seats or blocks."""
        sched = self.scheduler
        if sched.importing or sched.imports_waiting or any(r.parked for r in self.requests.values()):
            return []
        return super()._end_unschedulable()

    def new_tokens(self) -> dict:
        """Engine.new_tokens, but a parked request's: its first token goes with its handoff."""
        return {r: new for r, new in super().new_tokens().items() if not self.requests[r].parked}


@functools.cache
def with_handoff(engine: type[Engine]) -> type[Engine]:
    """engine's class with both sides of the handoff, its scheduler's too."""
    seats = type(f"Handoff{engine.scheduler_class.__name__}", (HandoffSeats, engine.scheduler_class), {})
    return type(f"Handoff{engine.__name__}", (HandoffEngine, engine), {"scheduler_class": seats})


def worker_engine(cfg: EngineConfig) -> Engine:
    """A worker's engine: the one cfg asks for (engine.py:make_engine), with the handoff."""
    return with_handoff(engine_class(cfg))(cfg)
