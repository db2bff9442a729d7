"""The per-worker controller: every CONTROL_INTERVAL_S it chooses the worker's configuration,
its SM split (a split engine's, lanes.py) and its token budget per step (the scheduler's
token_budget: decodes and prompt chunks together), from the state its engine holds now.

  Config       a configuration: (sm_split or None, tokens per step)
  StepModel    a step's ms from its shape and where it ran (costmodel.py's: the whole GPU, a
               split's decode lane, a split's prefill lane), as the router learned it and the
               cluster sends it (messages.py:Control); scored here on the engine's own timed
               steps (Controller.timed), which say how far it may be trusted at each place
  Snapshot     what the engine holds now: prompts queued, decodes running, recent arrivals
  forecast     one configuration over the next HORIZON_S, step by step, as the scheduler
               would run it (chunked prefill, first come first served, seats)
  Controller   the best configuration of the menu by forecast, with hysteresis

The objective (docs/controller.md): without an SLO the sum of the latency of the requests
present and arriving (the time each spends in the system over the horizon, by Little's law
what the mean latency grows with, plus an estimate of what each still needs at its end);
with an SLO (ttft_s, tpot_s) the share predicted to meet both first, that sum second.
"""

import collections
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from nanopd.costmodel import WHOLE, HardwareParams, Place, StepModel, place_of, split_key
from nanopd.request import Status

CONTROL_INTERVAL_S = 0.25  # how often a worker with prompt work chooses its configuration
REACT_S = 0.025            # ... and, on work arriving at an idle one, how soon after its last choice
HORIZON_MS = 1000.0        # what a forecast simulates: the next second of steps
# The token budgets weighed on the whole GPU (capped by max_num_batched_tokens; those below
# twice max_num_seqs left out: they would leave a full decode batch little room for prompts).
# A split's prefill lane runs prompts only: it is weighed at the largest, its most efficient.
BUDGETS = (512, 1024, 2048, 4096, 8192)
MARGIN = 0.05              # another split must be forecast this much better to replace the current
BUDGET_MARGIN = 0.01       # ... another budget on the same split: a change that costs nothing, so the margin
                           # need only keep forecasts' noise from flapping it (MARGIN would keep a budget that
                           # another beats by less: long prompts at light load, 512 against 8192)
SWITCH_MS = 2.25           # a split change drains the steps in flight: every request present waits this
MIN_DWELL_S = 0.5          # a split taken is kept this long (a budget change costs nothing)
MAX_LOAD = 0.9             # a split whose prefill lane prefills the arrivals' prompt tokens at less than
                           # 1 / this of their rate falls behind for as long as they last: not weighed
RECENT_S = 1.0             # the arrivals the rate and mean prompt length are measured over
RECENT_ENDS = 64           # finished requests the output lengths are measured over
UNTRIED_ERROR = 0.3        # a place's step model error before it has run steps there (the profile
                           # measured a split's lanes beside its own prompts, not the load's)
ERROR_PRIOR_STEPS = 16     # ... weighed as this many steps' errors, against those it has run
ERROR_STEPS = 100          # the errors are running means over about this many steps


@dataclass(frozen=True)
class Config:
    sm_split: tuple[int, int] | None
    token_budget: int          # tokens per step, decodes and prompt chunks together


# ----------------------------------------------------------------------------- what the worker sees


@dataclass
class Recent:
    """What a worker saw lately: arrivals (when, prompt tokens, max_tokens) over RECENT_S, and
    the output lengths of the last RECENT_ENDS requests that ended before their max_tokens
    (a stop or EOS): what an output is expected to come to."""
    arrivals: collections.deque = field(default_factory=collections.deque)
    early_ends: collections.deque = field(default_factory=lambda: collections.deque(maxlen=RECENT_ENDS))

    def arrived(self, now: float, prompt_len: int, max_tokens: int) -> None:
        self.arrivals.append((now, prompt_len, max_tokens))

    def ended(self, output_len: int, max_tokens: int) -> None:
        if output_len < max_tokens:
            self.early_ends.append(output_len)

    def remaining(self, max_tokens: int, generated: int) -> int:
        """Output tokens a request is expected still to make: max_tokens less those made,
        capped, once requests have ended early, by their mean length (past it, half of it)."""
        left = max_tokens - generated
        if self.early_ends:
            cap = sum(self.early_ends) / len(self.early_ends)
            left = min(left, round(max(cap - generated, cap / 2)))
        return max(1, left)

    def rates(self, now: float) -> tuple[float, float, float]:
        """(arrivals per ms, their mean prompt tokens, their mean expected output) over RECENT_S."""
        while self.arrivals and now - self.arrivals[0][0] > RECENT_S:
            self.arrivals.popleft()
        if not self.arrivals:
            return 0.0, 0.0, 1.0
        n = len(self.arrivals)
        return (n / (RECENT_S * 1e3), sum(a[1] for a in self.arrivals) / n,
                sum(self.remaining(a[2], 0) for a in self.arrivals) / n)


# ----------------------------------------------------------------------------- the forecast


@dataclass
class Prompt:
    """A prompt on the engine: tokens still to prefill, ms it has waited since it arrived,
    the output tokens it is expected to make, whether it holds a seat (a chunk is done)."""
    tokens_left: int
    waited_ms: float
    output: int
    admitted: bool = False
    length: int = 0            # its prompt's tokens, the context it decodes with (0: tokens_left)


@dataclass
class Decode:
    """A running decode: output tokens it is expected still to make, its context tokens."""
    remaining: int
    context: int


@dataclass
class Snapshot:
    """What a worker's engine holds now, and what arrives at it lately."""
    time_s: float
    prompts: list[Prompt]
    decodes: list[Decode]
    seats: int                 # max_num_seqs
    max_num_batched_tokens: int   # the engine's: decodes and prompt tokens of one step together, at most
    rate: float = 0.0          # arrivals per ms
    mean_prompt: float = 0.0
    mean_output: float = 1.0


def snapshot(scheduler, recent: Recent, now: float) -> Snapshot:
    """A scheduler's state (scheduler.py) as the controller forecasts from it, at time now (s,
    the clock of its requests' arrival times): each sequence still to prefill (waiting, or
    running with prompt tokens left) and each running decode, with the output it is expected
    still to make (Recent.remaining)."""
    prompts, decodes = [], []
    for seq in [*scheduler.waiting, *scheduler.running]:
        req = seq.request
        max_tokens = 1 if req.prefill_only else req.params.max_tokens
        left = recent.remaining(max_tokens, seq.num_outputs)
        if seq.status != Status.RUNNING or seq.num_pending > 1:
            prompts.append(Prompt(seq.num_pending, (now - req.metrics.arrival_time) * 1e3, left,
                                  seq.status == Status.RUNNING, len(seq.token_ids)))
        elif seq.num_outputs < max_tokens:
            decodes.append(Decode(left, seq.num_computed))
    rate, mean_prompt, mean_output = recent.rates(now)
    return Snapshot(now, prompts, decodes, scheduler.max_num_seqs, scheduler.max_num_batched_tokens, rate,
                    mean_prompt, mean_output)


@dataclass
class Forecast:
    config: Config
    latency_ms: float          # the sum over the requests present and arriving (see the module's docstring)
    met: float | None = None   # under an SLO, the share predicted to meet both targets

    def key(self) -> tuple[float, float]:
        """The SLO share (under an SLO), then the latency."""
        return (0.0 if self.met is None else -self.met, self.latency_ms)


class Sim:
    """One forecast's state: the clock (ms), the prompt queue (first come first served), the
    decodes (a heap of the decode step each ends at, with a step counter: no per-request
    loop per step), and what the requests accumulate. Arrivals come evenly at snap.rate, each
    of the mean lengths, from time 0 to the horizon."""

    def __init__(self, snap: Snapshot, slo: tuple[float, float] | None):
        self.snap, self.slo = snap, slo
        self.now, self.area, self.met, self.count = 0.0, 0.0, 0, len(snap.prompts) + len(snap.decodes)
        # per prompt: [tokens left, arrival ms (negative: before now), output, admitted, prompt length]
        self.queue = collections.deque([p.tokens_left, -p.waited_ms, p.output, p.admitted,
                                        p.length or p.tokens_left] for p in snap.prompts)
        self.admitted = sum(p.admitted for p in snap.prompts)
        self.counter, self.sums = 0, [0.0]   # decode steps done, and their ms summed (sums[k]: the first k)
        self.ctx = sum(d.context for d in snap.decodes)
        # per decode: (last step, its context then, its first step)
        self.heap = [(d.remaining, d.context + d.remaining, 1) for d in snap.decodes]
        heapq.heapify(self.heap)
        self.arrived = 0   # arrivals joined so far
        self.prefilled = 0   # prompts whose last chunk is in flight: out of the queue, not yet decoding
        self.gap = 1.0 / snap.rate if snap.rate > 0 else math.inf

    def next_arrival(self) -> float:
        t = (self.arrived + 1) * self.gap
        return t if t < HORIZON_MS else math.inf

    def advance(self, to: float) -> None:
        """Move the clock to `to`: everyone present spends the time in the system; arrivals
        meanwhile join the queue, present from their arrival."""
        self.area += (len(self.heap) + len(self.queue) + self.prefilled) * (to - self.now)
        while (a := self.next_arrival()) <= to:
            self.arrived += 1
            self.count += 1
            self.area += to - a
            n = max(1, round(self.snap.mean_prompt))
            self.queue.append([n, a, max(1, round(self.snap.mean_output)), False, n])
        self.now = to

    def decode_steps(self, ms_of: Callable[[int, float, int], float], stop_at: float) -> None:
        """Decode steps alone, back to back from now, while the batch stays the same: each
        ms_of(decodes, context, 0) long, starting before the horizon, ending before stop_at
        (an arrival, a chunk's end) and not at a decode's last step. Per step what advance
        and decode_step do, with nothing arriving and nobody leaving: the forecast's hot
        loop, most of its steps at light load."""
        if not self.heap:
            return
        d, present, steps = len(self.heap), len(self.heap) + len(self.queue) + self.prefilled, 0
        now, ctx, sums = self.now, self.ctx, self.sums
        for _ in range(self.heap[0][0] - self.counter - 1):
            ms = ms_of(d, ctx, 0)
            if now >= HORIZON_MS or now + ms >= stop_at:
                break
            now, ctx, steps = now + ms, ctx + d, steps + 1
            sums.append(sums[-1] + ms)
        self.area += present * (now - self.now)
        self.now, self.ctx, self.counter = now, ctx, self.counter + steps

    def take(self, token_budget: int, decodes: int) -> tuple[int, list[list]]:
        """A chunk of the step's token budget less its decodes (capped by
        max_num_batched_tokens), first come first served, admitting prompts while seats are
        free; (its tokens, the prompts it completes)."""
        room, tokens, done = min(token_budget, self.snap.max_num_batched_tokens) - decodes, 0, []
        for p in self.queue:
            if room <= 0:
                break
            if not p[3]:
                if len(self.heap) + self.admitted >= self.snap.seats:
                    break
                p[3] = True
                self.admitted += 1
            n = min(p[0], room)
            p[0] -= n
            room -= n
            tokens += n
            if p[0] == 0:
                done.append(p)
        for _ in done:
            self.queue.popleft()
        self.admitted -= len(done)
        self.prefilled += len(done)
        return tokens, done

    def first_tokens(self, done: list[list], in_flight: bool) -> None:
        """Prompts whose last chunk ended now: their first token, and they decode from the
        next decode step (the one after a decode step in flight, in_flight)."""
        first = self.counter + 1 + in_flight
        self.prefilled -= len(done)
        for p in done:
            ttft_ok = self.slo is None or self.now - p[1] <= self.slo[0] * 1e3
            if p[2] <= 1:
                self.met += ttft_ok
                continue
            heapq.heappush(self.heap, (first + p[2] - 2, p[4] + p[2] - 1, first if ttft_ok else -first))
            self.ctx += p[4]

    def decode_step(self, ms: float, decodes: int) -> None:
        """A decode step of `decodes` sequences, ms long, has ended: each made a token; those
        whose last it was leave (meeting the SLO if their TTFT did and their mean step did)."""
        self.counter += 1
        self.sums.append(self.sums[-1] + ms)
        self.ctx += decodes
        while self.heap and self.heap[0][0] <= self.counter:
            last, ctx, first = heapq.heappop(self.heap)
            self.ctx -= ctx
            if self.slo is not None and first > 0:
                self.met += (self.sums[last] - self.sums[first - 1]) / (last - first + 1) <= self.slo[1] * 1e3


def forecast(model: StepModel, config: Config, snap: Snapshot,
             slo: tuple[float, float] | None = None) -> Forecast:
    """The configuration's latency (and SLO share) over the next HORIZON_MS of steps, then
    what the requests left still need (finish)."""
    sim = Sim(snap, slo)
    if config.sm_split is None:
        result = finish(sim, config, *run_whole(model, config, sim), [])
    else:
        result = finish(sim, config, *run_split(model, config, sim))
    return result


def lane_load(model: StepModel, config: Config, snap: Snapshot) -> float:
    """A split's prefill lane: the recent arrivals' prompt tokens per ms over those its
    chunks of its token budget prefill per ms. A split's lane has the SMs it has; at 1 or more
    its queue grows for as long as the arrivals last, past any horizon (the whole GPU's
    room for prompts grows instead as its decodes end)."""
    chunk = max(1, min(config.token_budget, snap.max_num_batched_tokens))
    ms = model.timer(("prefill", split_key(config.sm_split)))(0, 0, chunk)
    return snap.rate * snap.mean_prompt * ms / chunk


def run_whole(model: StepModel, config: Config, sim: Sim) -> tuple[float, float]:
    """Steps on the whole GPU, each taking every decode and a chunk of the queue; (a decode
    step's ms at the end, and a step's with a chunk of what is still queued)."""
    ms_of = model.timer(WHOLE)
    while sim.now < HORIZON_MS:
        tokens, done = sim.take(config.token_budget, len(sim.heap))
        if not tokens:   # decodes alone until an arrival or a decode's end changes the step
            sim.decode_steps(ms_of, sim.next_arrival())
            if sim.now >= HORIZON_MS:
                break
        decodes, ctx = len(sim.heap), sim.ctx
        if decodes == 0 and tokens == 0:   # nothing to run until the next arrival
            if sim.next_arrival() == math.inf:
                break
            sim.advance(sim.next_arrival())
            continue
        ms = ms_of(decodes, ctx, tokens)
        sim.advance(sim.now + ms)
        if decodes:
            sim.decode_step(ms, decodes)
        sim.first_tokens(done, in_flight=False)
    room = min(config.token_budget, sim.snap.max_num_batched_tokens) - len(sim.heap)
    queued = min(sum(p[0] for p in sim.queue), room)
    decodes = len(sim.heap)
    return ms_of(decodes, sim.ctx, 0), ms_of(decodes, sim.ctx, queued)


def run_split(model: StepModel, config: Config, sim: Sim) -> tuple[float, float, list[tuple[list, float]]]:
    """Two lanes at once: prompt chunks on the prefill lane (on the whole GPU while nothing
    decodes), decode steps on the decode lane while a chunk is in flight beside them (else on
    the whole GPU, as lanes.py runs them). Events in time order, the prefill lane's first on
    a tie. (A decode step's ms at the end, a chunk's of what is queued, the prompts a chunk in
    flight at the end completes with when it ends.)"""
    key = split_key(config.sm_split)
    whole, lane_d, lane_p = (model.timer(p) for p in (WHOLE, ("decode", key), ("prefill", key)))
    t_p, t_d, chunk, step = 0.0, math.inf, None, None   # chunk: the prompts it completes; step: (ms, d)
    while min(t_p, t_d) < HORIZON_MS:
        if t_p <= t_d:   # the prefill lane is free: the chunk in flight ends, the next starts
            sim.advance(t_p)
            if chunk is not None:
                sim.first_tokens(chunk, in_flight=step is not None)
            tokens, chunk = sim.take(config.token_budget, 0)
            if tokens:
                t_p = sim.now + (lane_p if sim.heap or step else whole)(0, 0, tokens)
            else:   # nothing to prefill until a prompt arrives or a decode step frees a seat
                chunk, t_p = None, sim.next_arrival()
            if step is None and sim.heap:
                t_d = sim.now
            continue
        sim.advance(t_d)   # the decode lane's step ends, the next starts
        if step is not None:
            sim.decode_step(*step)
        if chunk is None and not sim.queue:   # nothing to prefill before an arrival: decodes alone
            sim.decode_steps(whole, min(sim.next_arrival(), HORIZON_MS))
        step, t_d = None, math.inf
        if sim.heap:
            ms = (lane_d if chunk is not None else whole)(len(sim.heap), sim.ctx, 0)
            step, t_d = (ms, len(sim.heap)), sim.now + ms
        if chunk is None:
            t_p = sim.now
    queued = min(config.token_budget, sum(p[0] for p in sim.queue))
    lane = lane_d if queued or chunk is not None else whole
    return (lane(len(sim.heap), sim.ctx, 0), lane_p(0, 0, queued) if queued else 0.0,
            [(p, t_p) for p in chunk or []])


def finish(sim: Sim, config: Config, decode_ms: float, chunk_ms: float,
           pending: list[tuple[list, float]]) -> Forecast:
    """The forecast: the time the requests spent in the system over the horizon, and for
    those left at its end what they still need: a queued prompt waits ceil(Q / c) chunks
    (Q: the tokens queued up to and with its own, c: a step's prompt tokens, the budget
    less the decodes beside it on the whole GPU), then decodes its output at decode_ms a
    step; a decode's remaining steps take decode_ms each. On the whole GPU a step beside a
    chunk takes a chunk's ms (chunk_ms): the first ceil(Q / c) of a decode's steps (Q: all
    the tokens queued), and of a queued prompt's those beside the chunks of the prompts
    queued behind it (left out, a backlog of long prompts was forecast short, and a larger
    budget, whose chunks stretch every decode step while a long queue lasts, looked better
    than it was). Under an SLO a request meets
    it if its first token came (or is forecast) within ttft_s and its steps average at most
    tpot_s."""
    slo, tail, met, q = sim.slo, 0.0, sim.met, 0
    beside = len(sim.heap) if config.sm_split is None else 0   # on the whole GPU decodes share a step
    room = max(1, min(config.token_budget, sim.snap.max_num_batched_tokens) - beside)
    ttft, tpot = (slo[0] * 1e3, slo[1] * 1e3) if slo else (math.inf, math.inf)
    for p, done_at in pending:   # a chunk in flight completes them
        tail += done_at - sim.now + (p[2] - 1) * decode_ms
        met += done_at - p[1] <= ttft and decode_ms <= tpot
    extra = max(0.0, chunk_ms - decode_ms) if config.sm_split is None else 0.0
    queued = sum(p[0] for p in sim.queue)
    for p in sim.queue:
        q += p[0]
        wait = math.ceil(q / room) * chunk_ms
        behind = math.ceil((queued - q) / room)   # the chunks of those behind it, beside its steps
        tail += wait + (p[2] - 1) * decode_ms + min(p[2] - 1, behind) * extra
        met += sim.now + wait - p[1] <= ttft and decode_ms <= tpot
    chunks = math.ceil(q / room)
    for last, _, first in sim.heap:
        left = last - max(sim.counter, abs(first) - 1)   # one that joined beside a step in flight: not in it
        tail += left * decode_ms + min(left, chunks) * extra
        if first > 0:
            done = sim.sums[sim.counter] - sim.sums[min(first - 1, sim.counter)]
            met += (done + left * decode_ms) / (last - first + 1) <= tpot
    return Forecast(config, sim.area + tail, met / max(1, sim.count) if slo else None)


# ----------------------------------------------------------------------------- choosing


def full_step_ms(model: StepModel, config: Config, snap: Snapshot) -> float:
    """The decodes' step now under config with the chunk the queue fills beside them: on the
    whole GPU, the decodes and the prompt tokens queued up to the budget's room; on a
    split, the decode lane's step."""
    decodes, context = len(snap.decodes), sum(d.context for d in snap.decodes)
    if config.sm_split is None:
        queued = sum(p.tokens_left for p in snap.prompts)
        prompt = max(0, min(queued, min(config.token_budget, snap.max_num_batched_tokens) - decodes))
        return model.predict(WHOLE, decodes, context, prompt)
    return model.predict(("decode", split_key(config.sm_split)), decodes, context, 0)


def places(config: Config) -> set[Place]:
    """The step models a configuration's forecast reads: a split's lanes, and the whole GPU
    (where a split's decodes step while no prompt is in flight)."""
    if config.sm_split is None:
        return {WHOLE}
    key = split_key(config.sm_split)
    return {WHOLE, ("decode", key), ("prefill", key)}


def menu(max_num_batched_tokens: int, seats: int, splits: list[tuple[int, int]]) -> list[Config]:
    """The whole GPU at every token budget of BUDGETS from twice the seats (capped at
    max_num_batched_tokens, which is one too), and each split at max_num_batched_tokens."""
    budgets = sorted({min(b, max_num_batched_tokens) for b in BUDGETS if b >= 2 * seats}
                     | {max_num_batched_tokens})
    return [Config(None, b) for b in budgets] + [Config(s, max_num_batched_tokens) for s in splits]


class Controller:
    """Chooses a worker's configuration (choose) from its engine's state, by forecast, with
    hysteresis: another configuration must be forecast better by a margin (an SLO share higher
    by it, or as high and a latency lower by it) to replace the current one, MARGIN for another
    split, BUDGET_MARGIN for another budget on the same one; a split change also pays
    SWITCH_MS for each request present, and a split is kept MIN_DWELL_S.
    A configuration is weighed as the model is sure of it: its forecast is made worse by the
    uncertainty of the step models it reads that the current one does not (uncertainty: a
    split's lanes before they have run, or once they have run badly), so a
    budget change on the same place needs only its margin, and a move to a split lane the
    model knows little of needs a gain larger than the model's error there.
    Under an SLO, only configurations whose full step (full_step_ms) stays within the TPOT
    target are weighed, while any does. splits: the engine's split menu that the profile
    measured (a split's lanes are forecast from their models)."""

    def __init__(self, params: HardwareParams, max_num_batched_tokens: int,
                 splits: list[tuple[int, int]] = (), slo: tuple[float, float] | None = None,
                 margin: float = MARGIN, budget_margin: float = BUDGET_MARGIN):
        self.model = StepModel(params)   # the router's: it learns the steps, this controller reads them
        self.error, self.observed = 0.0, 0   # the model's running mean relative error, over the steps timed
        self.errors: dict[Place, tuple[float, int]] = {}   # ... per place: (mean error, steps)
        self.slo, self.margin, self.budget_margin = slo, margin, budget_margin
        self.splits = [tuple(s) for s in splits]
        self.max_num_batched_tokens = max_num_batched_tokens
        self.default = Config(None, min(max(BUDGETS), max_num_batched_tokens))
        self.current, self.split_since = self.default, -math.inf

    def configure(self, params: HardwareParams, slo: tuple[float, float] | None) -> None:
        """The router's step model as it refitted it now (its parameters), and the SLO."""
        self.model.seed(params)
        self.slo = slo

    def timed(self, decodes: int, context: int, prompt: int, ms: float,
              sm_split: tuple[int, int] | None = None) -> None:
        """Score the step model on a step this worker timed (workers.py:Worker._timed): the
        running mean of |predicted - measured| / measured, over all and per place. The
        router learns the step (router.py:Router.observe_step); here it is only scored."""
        place = place_of(decodes, sm_split)
        if not self.model.knows(place) or ms <= 0:
            return
        miss = abs(self.model.predict(place, decodes, context, prompt) - ms) / ms
        self.observed += 1
        self.error += (miss - self.error) / min(self.observed, ERROR_STEPS)
        mean, n = self.errors.get(place, (0.0, 0))
        self.errors[place] = (mean + (miss - mean) / min(n + 1, ERROR_STEPS), n + 1)

    def uncertainty(self, place: Place) -> float:
        """How far off a step predicted there may be, relative: the place's mean error,
        shrunk toward UNTRIED_ERROR while it has run few steps (ERROR_PRIOR_STEPS' worth)."""
        mean, n = self.errors.get(place, (0.0, 0))
        n = min(n, ERROR_STEPS)
        return (n * mean + ERROR_PRIOR_STEPS * UNTRIED_ERROR) / (n + ERROR_PRIOR_STEPS)

    def options(self, snap: Snapshot) -> list[Config]:
        """The menu (the splits the profile measured, less those whose prefill lane falls
        behind the arrivals: lane_load), within the TPOT target where any is, and the current
        split alone while it is younger than MIN_DWELL_S."""
        splits = [s for s in self.splits if split_key(s) in self.model.p.splits]
        options = [c for c in menu(self.max_num_batched_tokens, snap.seats, splits)
                   if c.sm_split is None or lane_load(self.model, c, snap) < MAX_LOAD]
        if snap.time_s - self.split_since < MIN_DWELL_S:
            options = [c for c in options if c.sm_split == self.current.sm_split] or options
        if self.slo is not None:
            within = [c for c in options if full_step_ms(self.model, c, snap) <= self.slo[1] * 1e3]
            options = within or options
        return options

    def choose(self, snap: Snapshot) -> Config:
        """The configuration to run from now on (the current one unless another is clearly better)."""
        present = len(snap.prompts) + len(snap.decodes)
        forecasts = []
        for config in self.options(snap):
            f = forecast(self.model, config, snap, self.slo)
            if config.sm_split != self.current.sm_split:
                f.latency_ms += SWITCH_MS * present
            new = places(config) - places(self.current)
            doubt = max((self.uncertainty(p) for p in new), default=0.0)
            f.latency_ms *= 1 + doubt
            f.met = None if f.met is None else f.met * (1 - doubt)
            forecasts.append(f)
        best = min(forecasts, key=Forecast.key)
        current = next((f for f in forecasts if f.config == self.current), None)
        if current is None or self.clearly_better(best, current):
            if best.config.sm_split != self.current.sm_split:
                self.split_since = snap.time_s
            self.current = best.config
        return self.current

    def clearly_better(self, new: Forecast, old: Forecast) -> bool:
        margin = self.margin if new.config.sm_split != old.config.sm_split else self.budget_margin
        if self.slo is not None and abs(new.met - old.met) > margin:
            return new.met > old.met
        return new.latency_ms < old.latency_ms * (1 - margin)
