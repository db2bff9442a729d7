"""Load telemetry: what the central scheduler (cluster.py) knows of each worker's load, from
the requests it has sent there and the workers' own reports.

One measure of load, per worker (costmodel.py:WorkerLoad), from one pass over the active
requests: what the router weighs, and the work tokens the least loaded worker is picked by
where no router picks. Three of its parts are rates, each a Window: the prompt tokens the
workers' steps prefilled (StepTimed) and each worker's decode batch over the last WINDOW_S,
and the prompt tokens that arrived over the last ARRIVAL_WINDOW_S.
"""

import collections
from collections.abc import Iterable
from dataclasses import dataclass, field

from nanopd.costmodel import WorkerLoad
from nanopd.lifecycle import RequestRecord
from nanopd.messages import Configured, Heartbeat, StepTimed
from nanopd.roles import RoleMap

WINDOW_S = 2.0           # the rates count the change of the last this many seconds
BATCH_READING_S = 0.1    # a decode batch is read this often at most (a reading is kept per worker)
ARRIVAL_WINDOW_S = 1.0   # the arrivals' rate counts the last second: a change of phase shows there first


@dataclass
class Window:
    """Readings of a quantity that holds its value between them (a running total read at
    each change, or a level read often), over the last span_s seconds and the one before:
    its rate of change over that span. It had the value `first` from `start` on."""
    span_s: float
    start: float
    first: float = 0.0
    gap_s: float = 0.0          # a reading sooner than this after the last one is not kept
    readings: collections.deque[tuple[float, float]] = field(default_factory=collections.deque)

    def __post_init__(self):
        self.readings.append((self.start, self.first))

    def read(self, now: float, value: float) -> None:
        if now - self.readings[-1][0] >= self.gap_s:
            self.readings.append((now, value))

    def rate(self, now: float, value: float) -> float:
        """Per ms: value (now) less its value span_s ago (the last reading by then), over span_s."""
        while len(self.readings) > 1 and now - self.readings[1][0] > self.span_s:
            self.readings.popleft()
        return (value - self.readings[0][1]) / (self.span_s * 1e3)


class Telemetry:
    """The workers' load: their last Heartbeat (free blocks), the prompt tokens their steps
    prefilled and those that arrived, and, on request, each one's WorkerLoad."""

    def __init__(self, num_workers: int, room: int, seats: int, now: float):
        self.room, self.seats = room, seats   # a worker's blocks before its first heartbeat; its max_num_seqs
        self.status: dict[int, Heartbeat] = {}   # worker -> its last Heartbeat
        self.prefilled = 0                       # prompt tokens the workers' steps prefilled, in all
        self.prefill = Window(WINDOW_S, now)
        self.submitted = 0                       # prompt tokens of the requests that arrived, in all
        self.arrivals = Window(ARRIVAL_WINDOW_S, now)
        self.batches = {w: Window(WINDOW_S, now, gap_s=BATCH_READING_S) for w in range(num_workers)}
        self.configured: dict[int, Configured] = {}   # the workers' controllers' last choices (adaptive)

    def heartbeat(self, w: int, msg: Heartbeat) -> None:
        self.status[w] = msg

    def arrived(self, now: float, prompt_tokens: int) -> None:
        """A request came: its prompt tokens count toward the arrival rate."""
        self.submitted += prompt_tokens
        self.arrivals.read(now, self.submitted)

    def stepped(self, now: float, msg: StepTimed) -> None:
        """A step a worker timed: its prompt tokens count toward the prefill rate."""
        if msg.prefill_tokens:
            self.prefilled += msg.prefill_tokens
            self.prefill.read(now, self.prefilled)

    def loads(self, workers: list[int], active: Iterable[RequestRecord], roles: RoleMap, now: float
              ) -> dict[int, WorkerLoad]:
        """What each of workers holds: prompts waiting for prefill, sequences decoding (and
        their context), its work tokens, free blocks, seats, token budget; the prompt
        tokens per ms the workers' steps prefilled lately, but no more than arrived lately,
        shared by the workers that take prompts (costmodel.WorkerLoad says why); the growth of its
        decode batch, sequences per ms, over the last WINDOW_S (past saturation the batches
        grow while a request decodes). One pass over the active requests."""
        takers = roles.takers(workers)
        rate = min(self.prefill.rate(now, self.prefilled), self.arrivals.rate(now, self.submitted))
        rate /= max(1, len(takers))
        budgets = {w: c.token_budget for w, c in self.configured.items()}   # its controller's, else none
        loads = {w: WorkerLoad(free_blocks=self.status[w].free_blocks if w in self.status else self.room,
                               prefill_rate=rate if w in takers else 0.0, seats=self.seats,
                               token_budget=budgets.get(w), sm_split=self.sm_split(w, roles))
                 for w in workers}
        for t in active:
            load = loads.get(t.worker)
            if load is None or t.phase == "done":
                continue
            # Work tokens: its prompt while it is here for its prefill, its outputs still to
            # come where its worker's role decodes what it prefills (or what it is handed).
            load.work_tokens += len(t.prompt_token_ids) if t.phase == "prefill" else 0
            load.work_tokens += 0 if roles.role(t.worker).hands_off else t.params.max_tokens - len(t.tokens)
            if t.phase == "prefill" and not t.tokens:
                load.queued_prefill_tokens += len(t.prompt_token_ids)
                load.queued_prefills += 1
            else:
                load.decode_batch += 1
                load.context_tokens += len(t.prompt_token_ids) + len(t.tokens)
        for w, load in loads.items():
            self.batches[w].read(now, load.decode_batch)
            load.batch_growth = self.batches[w].rate(now, load.decode_batch)
        return loads

    def sm_split(self, w: int, roles: RoleMap) -> tuple[int, int] | None:
        """The SM split worker w runs on: its controller's, else its role's."""
        return self.configured[w].sm_split if w in self.configured else roles.parts[w].sm_split

    def least_loaded(self, workers: list[int], active: Iterable[RequestRecord], roles: RoleMap,
                     now: float) -> int:
        """The one of workers with the fewest work tokens."""
        loads = self.loads(workers, active, roles, now)
        return min(workers, key=lambda w: loads[w].work_tokens)
