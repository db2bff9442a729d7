"""The cost model: the predicted latency of one request on a path, prefill and decode on
one worker (collocated) or on two (disaggregated), from the hardware's fitted parameters and
the workers' current load. The router (router.py) picks each request's path by it and
refits its parameters, the planner (planner.py) forecasts a regime's steady state with it,
the profiler (profiler.py) measures its parameters and telemetry.py its workers' load.

  HardwareParams   what the profiler measures, times in ms: prefill, a decode step, the
                   interference of prompts with decodes, the KV transfer (per link), and
                   a split worker's lanes (SplitParams)
  WorkerLoad       one worker's load: its queue, its decode batch, its seats and rates
  CostModel        a request's predicted latency on a path, from the two

The rule underneath (docs/router.md): disaggregation adds transfer_rate x L (the prompt's KV
crossing the link); collocation adds gamma x L x load / batch_thresh (the prompt's
prefill slowing the load decodes sharing its steps, which cost more once the batch is
past the knee). Disaggregation wins when gamma / transfer_rate > batch_thresh / load.

In the adaptive policy every worker also decodes, so a prefill slows the decodes of
whichever worker runs it, on either path: the router charges that interference to both
paths (it is a cost to the other requests, not part of this one's latency). Moving a
request then pays only when it takes the decode to a worker with a smaller batch or free
seats, or the prefill away from a longer queue. The same interference, from the prompts that keep
arriving while a request decodes, is part of that request's latency: a worker prefilling
r prompt tokens per ms spends gamma x r of its time on them, beside its decodes.
"""

import dataclasses
import math
from dataclasses import dataclass, field


@dataclass
class HardwareParams:
    """What profiler.py measures; times in ms."""
    alpha: float              # prefill, ms per prompt token
    beta: float               # decode step at batch 1
    batch_thresh: float       # decode batch where the step starts to grow (the knee)
    slope: float              # step growth per sequence past the knee
    gamma: float              # extra decode-step time per prefill token sharing the step
    transfer_rate: float      # ms per prompt token to move its KV between workers
    alpha2: float = 0.0       # prefill's quadratic (attention) term, ms per token^2
    alpha0: float = 0.0       # a prefill's fixed cost, ms: its step reads every weight, however short
    kv: float = 0.0           # decode-step time per token of context in the batch (its KV is read)
    # transfer_rate of each pair of workers measured apart, by "p>d": a link within a host
    # is faster than one between hosts. Pairs not in it move at transfer_rate.
    links: dict[str, float] = field(default_factory=dict)
    # A split worker's lanes (smsplit.py), by "prefill_sms/decode_sms": each measured while
    # the other lane is busy, since the lanes share the memory bandwidth.
    splits: dict[str, "SplitParams"] = field(default_factory=dict)

    def __post_init__(self):   # from JSON (profiler.py's cache), a split's parameters come as a dict
        self.splits = {k: v if isinstance(v, SplitParams) else SplitParams(**v)
                       for k, v in self.splits.items()}

    def link(self, p: int, d: int) -> float:
        """ms per prompt token to move a request's KV from worker p to worker d."""
        return self.links.get(f"{p}>{d}", self.transfer_rate)


@dataclass
class SplitParams:
    """One split's lanes: prefill on the prefill lane (alpha0 + alpha L + alpha2 L^2 ms)
    beside decodes, decode steps on the decode lane (beta, then slope per sequence past
    batch_thresh) beside a prefill; times in ms."""
    alpha0: float
    alpha: float
    alpha2: float
    beta: float
    batch_thresh: float
    slope: float
    kv: float = 0.0           # decode-step time per token of context in the batch


def split_key(split: tuple[int, int]) -> str:
    """HardwareParams.splits' key of a (prefill SMs, decode SMs) split."""
    return f"{split[0]}/{split[1]}"


HISTORY = 100_000   # entries each log kept for the models holds (steps, requests, changes): its last ones
MAX_PREFILL_SHARE = 0.9   # of a worker's time on prefills beside its decodes: past it, none would finish
GROWTH_SEGMENTS = 16      # pieces a decode under a moving batch is integrated in


@dataclass
class WorkerLoad:
    """One worker's load, as the central scheduler sees it (telemetry.py): what the cost model weighs."""
    queued_prefill_tokens: int = 0   # prompt tokens waiting to be prefilled there
    decode_batch: int = 0            # sequences decoding there
    context_tokens: int = 0          # ... and the tokens of context they hold
    free_blocks: int = 1 << 30       # KV blocks it can still hand out
    # Prompt tokens per ms it will prefill beside its decodes: what the workers' steps
    # prefilled lately, but no more than arrived lately (the backlog ahead of a request is
    # prefilled before it decodes: only the prompts that come after it share its steps),
    # per worker. Prefilled, not sent: past the seats, prompts wait and share no step. Per
    # worker, not its own: where the next prompts go is the router's choice, and a worker
    # that prefilled many would look slow to decode on, get only prompts and look slower
    # still (a lock-in of roles that, at overload, left one worker prefilling and the other
    # out of seats).
    prefill_rate: float = 0.0
    seats: int = 1 << 30             # sequences it runs at once (max_num_seqs); the rest wait
    queued_prefills: int = 0         # prompts those queued tokens belong to
    # Sequences per ms its decode batch grows by: decodes started there lately less those
    # that ended. Past saturation it is positive, and a request decoding there will share
    # its steps with more sequences than it sees now; while queues drain, negative.
    batch_growth: float = 0.0
    token_budget: int | None = None   # tokens per step, decodes and chunks (its controller's), None: any
    # Prompt tokens of the requests here for their prefill and output tokens still to decode
    # here: where no router picks, a request goes to the worker with the fewest.
    work_tokens: int = 0
    sm_split: tuple[int, int] | None = None   # a split worker's split (its costs: CostModel.on_split)


# ----------------------------------------------------------------------------- cost model


class CostModel:
    """Predicted end-to-end latency (ms) of one request on a path."""

    def __init__(self, params: HardwareParams):
        self.p = params

    def on_split(self, split: tuple[int, int]) -> "CostModel":
        """The cost model of a split worker's lanes: its prefills and its decode steps as the
        split measured them, no prompt tokens in a decode step (gamma 0) and no KV to move
        (the lanes share the cache)."""
        s = self.p.splits[split_key(split)]
        return CostModel(dataclasses.replace(
            self.p, alpha0=s.alpha0, alpha=s.alpha, alpha2=s.alpha2, beta=s.beta, batch_thresh=s.batch_thresh,
            slope=s.slope, kv=s.kv, gamma=0.0, transfer_rate=0.0, links={}, splits={}))

    def prefill_ms(self, tokens: float) -> float:
        return self.p.alpha0 + self.p.alpha * tokens + self.p.alpha2 * tokens ** 2

    def decode_step_ms(self, batch: float, context: float = 0.0) -> float:
        """A decode step of batch sequences holding context tokens in all."""
        return self.p.beta + self.p.slope * max(0.0, batch - self.p.batch_thresh) + self.p.kv * context

    def step_ms(self, decodes: float, context: float, prompt: float) -> float:
        """A whole-GPU step of decodes holding context tokens, with prompt tokens beside them."""
        return self.decode_step_ms(decodes, context) + self.p.gamma * prompt

    def steps_ms(self, prompt_len: int, out_len: float, w: WorkerLoad, waited: int = 0) -> float:
        """out_len steps on w, after `waited` steps of w, whose batch gains this request (its
        context L to L + out_len), beside the prompts w keeps prefilling meanwhile: over a
        decode of T ms, w prefills rate * T prompt tokens, each adding gamma to a step, so
        T = out_len * step + gamma * rate * T (stretch). Meanwhile the batch moves by
        batch_growth per ms, so each step is longer (or shorter) than the one before:
        dt / dstep = step(batch + growth t), integrated over GROWTH_SEGMENTS pieces. At most
        `seats` sequences share a step. The batch it starts in is batch_ahead's.
        The growth counts only past saturation, while sequences wait for w's seats: below it,
        starts and ends balance, and a trend over the last seconds is the batch's random swing,
        which does not go on (taken as a trend, it made every prediction too long)."""
        stretch = self.stretch(w)
        ahead = self.batch_ahead(out_len, w, waited)
        per_seq = (w.context_tokens + w.queued_prefill_tokens) / max(1, w.decode_batch + w.queued_prefills)
        growth = w.batch_growth if self.excess_share(w) > 0 else 0.0

        def step_at(t: float) -> float:   # a step t ms into the decode, stretched
            running = min(max(1.0, ahead + 1 + growth * t), w.seats)
            return self.decode_step_ms(running, per_seq * (running - 1) + prompt_len + out_len / 2) / stretch
        if not growth:
            return out_len * step_at(0.0)
        t, k = 0.0, out_len / GROWTH_SEGMENTS   # dt/dstep = step_at(t), by the midpoint rule
        for _ in range(GROWTH_SEGMENTS):
            t += k * step_at(t + k * step_at(t) / 2)
        return t

    def stretch(self, w: WorkerLoad) -> float:
        """The share of w's time left to its decodes beside the prompts it prefills."""
        return 1.0 - min(self.p.gamma * w.prefill_rate, MAX_PREFILL_SHARE)

    def batch_ahead(self, out_len: float, w: WorkerLoad, waited: int) -> float:
        """The sequences decoding beside a request when it starts, after `waited` steps of w:
        those of w's decodes still running then, and those of the prompts queued ahead of it
        that have started and not ended. Every length is taken as exponential with this
        request's mean (m = out_len steps): after s steps a decode runs on with chance
        e^(-s/m), and a queued prompt, started at an even time within them, with chance
        (m/s)(1 - e^(-s/m)). With no wait, all of them: a burst of prompts decodes together
        (left out, a request queued behind one was predicted too short); behind a long
        backlog, the decodes running now have ended (counted, a request behind one was
        predicted far too long). Past saturation the batch stays at the seats: those in line
        take the seats that free."""
        if waited <= 0 or self.excess_share(w) > 0:
            return w.decode_batch + w.queued_prefills
        s, m = waited, max(1.0, out_len)
        kept = math.exp(-s / m)
        return w.decode_batch * kept + w.queued_prefills * (m / s) * (1.0 - kept)

    def seat_wait_ms(self, prompt_len: int, out_len: float, w: WorkerLoad) -> float:
        """The wait for a seat on w, which a prompt needs to be prefilled there and a
        sequence to decode there. This request, w's decodes and the prompts queued there
        (each holds a seat from its first chunk on) want one; past the seats, the excess
        waits while seats free, one running decode's length (taken as this request's)
        per `seats` of them. Equivalently, each of the in_line sequences gets a step in
        every in_line / seats, as if they took the seats in turn."""
        return self.steps_ms(prompt_len, out_len, w) * self.excess_share(w)

    @staticmethod
    def excess_share(w: WorkerLoad) -> float:
        """Sequences past w's seats (this request counted), per seat."""
        return max(0, w.decode_batch + w.queued_prefills + 1 - w.seats) / w.seats

    def decode_ms(self, prompt_len: int, out_len: float, w: WorkerLoad) -> float:
        """The wait for a seat on w, then the steps."""
        return self.steps_ms(prompt_len, out_len, w) * (1.0 + self.excess_share(w))

    def interference_ms(self, prompt_len: int, load: int) -> float:
        """What the prompt's prefill costs the load decodes sharing its steps (docs/router.md's
        interference term): a cost to the others, weighed in the choice of path, not in this latency."""
        return self.p.gamma * prompt_len * load / self.p.batch_thresh

    def prefill_on(self, w: WorkerLoad, prompt_len: int) -> float:
        """Prefilling w's queued prompts and then this one: in one go (w's next step takes
        every prompt waiting; alpha0 once, alpha per token, and alpha2 per prompt, since
        attention is within a prompt: the queued ones taken as equally long), or, under a
        token budget of b tokens per step, in ceil(tokens / c) of w's decode steps, each
        carrying c = b less its decodes of them (or all, if fewer)."""
        tokens = w.queued_prefill_tokens + prompt_len
        if w.token_budget is None:
            return self.p.alpha0 + self.p.alpha * tokens + self.p.alpha2 * self.squares(w, prompt_len)
        chunk = min(self.room(w), tokens)
        step = self.step_ms(w.decode_batch, w.context_tokens, chunk)
        return self.prefill_steps(w, prompt_len) * step

    @staticmethod
    def room(w: WorkerLoad) -> int:
        """Prompt tokens a step of w carries under its token budget: the budget less its decodes."""
        return max(1, w.token_budget - w.decode_batch)

    @staticmethod
    def prefill_steps(w: WorkerLoad, prompt_len: int) -> int:
        """The steps of w that prefill its queue and then this prompt (prefill_on)."""
        if w.token_budget is None:
            return 1
        return math.ceil((w.queued_prefill_tokens + prompt_len) / CostModel.room(w))

    @staticmethod
    def squares(w: WorkerLoad, prompt_len: int) -> float:
        """The sum of the squared prompt lengths of w's queue and this prompt, the queued
        prompts taken as equally long: what attention's cost grows with."""
        queued = w.queued_prefill_tokens ** 2 / w.queued_prefills if w.queued_prefills else 0.0
        return queued + prompt_len ** 2

    def path_ms(self, prompt_len: int, out_len: float, prefill: WorkerLoad, decode: WorkerLoad | None,
                link: float | None = None) -> tuple[float, float]:
        """(time to the first token, time from it to the last) on a path: decode None is the
        collocated one. A seat on each worker in turn: one to be prefilled, one to decode;
        between them the KV moves at link ms per prompt token (default transfer_rate).
        Collocated, it decodes beside what is left after the steps before its last chunk
        (batch_ahead; none with no token budget: w's next step prefills every prompt waiting);
        on a decode worker, beside what is there now: the handoffs that reach it first are
        not in its load."""
        ttft = self.seat_wait_ms(prompt_len, out_len, prefill) + self.prefill_on(prefill, prompt_len)
        if decode is None:
            waited = self.prefill_steps(prefill, prompt_len) - 1
            return ttft, self.steps_ms(prompt_len, out_len, prefill, waited)
        link = self.p.transfer_rate if link is None else link
        return ttft, link * prompt_len + self.decode_ms(prompt_len, out_len, decode)

    def collocated_ms(self, prompt_len: int, out_len: float, w: WorkerLoad) -> float:
        return sum(self.path_ms(prompt_len, out_len, w, None))

    def disaggregated_ms(self, prompt_len: int, out_len: float, prefill: WorkerLoad, decode: WorkerLoad,
                         link: float | None = None) -> float:
        return sum(self.path_ms(prompt_len, out_len, prefill, decode, link))
