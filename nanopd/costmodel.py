"""The cost model: the predicted latency of one request on a path, prefill and decode on
one worker (collocated) or on two (disaggregated), from the hardware's fitted parameters and
the workers' current load. The router (router.py) picks each request's path by it and
refits its parameters, the planner (planner.py) forecasts a regime's steady state with it,
the profiler (profiler.py) measures its parameters and telemetry.py its workers' load.
Every prediction of a step's time in nanoPD is made here, and every fit of a coefficient.

  HardwareParams   what the profiler measures, times in ms: prefill, a decode step, the
                   interference of prompts with decodes, the KV transfer (per link), and
                   a split worker's lanes (SplitParams)
  step_time        a step's ms from its shape (decodes, their context, prompt tokens beside
                   them), and prefill_time a prefill's: the one formula of each
  LeastSquares     the one fitter: nonnegative least squares, batch (the profiler's
                   timings) or online (with forgetting, a prior and a clip on outliers)
  StepModel        a step's ms where it ran (the whole GPU, a split's lanes): the profile's
                   model times a level learned from the steps timed there
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

import copy
import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch


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


# ----------------------------------------------------------------------------- a step's time


def step_time(theta: Sequence[float], thresh: float, decodes: float, context: float, prompt: float) -> float:
    """A step's ms: decodes holding context tokens in all, prompt tokens beside them, by
    theta = (beta, mixed_beta, slope, kv, gamma): beta (mixed_beta for a step that carries
    prompt tokens: it runs other code, piece by piece, where a decode step replays one CUDA
    graph), slope per decode past thresh (the knee), kv per token of context (its KV is
    read), gamma per prompt token. theta . step_features, written out: a forecast calls it
    at every step it simulates."""
    beta, mixed_beta, slope, kv, gamma = theta
    base = mixed_beta if prompt else beta
    return base + slope * max(0.0, decodes - thresh) + kv * context + gamma * prompt


def step_features(decodes: float, context: float, prompt: float, thresh: float) -> list[float]:
    """The terms step_time weighs by theta: what a fit of theta regresses a step's ms on."""
    return [float(not prompt), float(bool(prompt)), max(0.0, decodes - thresh), float(context), float(prompt)]


def prefill_features(tokens: float) -> list[float]:
    """The terms prefill_time weighs by theta."""
    return [1.0, float(tokens), float(tokens) * tokens]


def prefill_time(theta: Sequence[float], tokens: float) -> float:
    """A prefill of tokens, by theta = (alpha0, alpha, alpha2): its step's fixed cost (it reads
    every weight, however few tokens it has), then per token, then per token squared (attention)."""
    alpha0, alpha, alpha2 = theta
    return alpha0 + (alpha * tokens + alpha2 * tokens * tokens)


# ----------------------------------------------------------------------------- the fitter


OUTLIER_CLIP = 4.0        # an online fit moves by at most this many typical residuals per observation
SCALE_WEIGHT = 0.05       # ... the typical residual: an average of the last ~20
PRIOR_SCALE = 0.1         # ... before any is seen: this share of what the prior predicts


@dataclass
class LeastSquares:
    """y ~ theta . x with every coefficient >= 0 (a cost or a rate is never negative: a
    negative one would make a busy worker look fast): theta minimises

        sum_k forget^age_k (x_k . theta - y_k)^2 + sum_i w_i (theta_i - theta0_i)^2,

    w_i = prior_weight / (|theta0_i| + floor_i)^2, so a coefficient off its prior by its own
    size (floor_i, for one that is 0) costs prior_weight. Batch (fit: the profiler's timings,
    a run's steps; no forgetting, no prior) or online (observe: the router's refits, which
    track drift with forget < 1 and start from the profile). Online, a residual far larger
    than the typical one (a step the host stalled, which no term of the model explains)
    counts only as far as `clip` typical residuals (Huber's robust regression, in its
    recursive form); the first one too, against PRIOR_SCALE of the prior's prediction (the
    first step on a split just taken is often a stall).
    The weighted rows [x, y] are kept as the triangular factor of their QR decomposition,
    so a solve is as exact as least squares on the rows themselves (the normal equations
    would square the condition of columns as far apart as 1 and L^2). Nonnegative exactly:
    the unconstrained fit if it is, else the best of the fits on each subset of the
    coefficients (the rest 0) that come out nonnegative, which at the optimum the positive
    coefficients are (exact for the few coefficients a fit here has)."""
    theta0: list[float]
    floor: list[float] | None = None   # None: all 0
    forget: float = 1.0
    prior_weight: float = 0.0
    clip: float = math.inf
    theta: list[float] = field(init=False)
    scale: float | None = field(init=False, default=None)   # the typical |residual| lately (None: none)
    r: torch.Tensor = field(init=False, repr=False)   # [R | z]: the QR factor of the weighted [x, y] rows

    def __post_init__(self):
        k = len(self.theta0)
        self.theta = list(self.theta0)
        self.r = torch.zeros(k + 1, k + 1, dtype=torch.float64)

    @classmethod
    def fit(cls, rows: list[list[float]], ys: list[float]) -> list[float]:
        """The nonnegative least squares of ys on rows, no prior."""
        f = cls([0.0] * len(rows[0]))
        f.add(rows, ys)
        return f.theta

    def predict(self, x: Sequence[float]) -> float:
        return sum(t * v for t, v in zip(self.theta, x))

    def observe(self, x: list[float], y: float) -> None:
        """Learn one observation online (its residual clipped), and refit."""
        if self.clip < math.inf:
            predicted = self.predict(x)
            if self.scale is None and predicted:   # before any residual: a share of the prediction
                self.scale = PRIOR_SCALE * abs(predicted)
            residual = y - predicted
            if self.scale is not None:
                bound = self.clip * self.scale
                residual = min(max(residual, -bound), bound)
            self.scale = abs(residual) if self.scale is None \
                else (1 - SCALE_WEIGHT) * self.scale + SCALE_WEIGHT * abs(residual)
            y = predicted + residual
        self.add([x], [y])

    def add(self, rows: list[list[float]], ys: list[float]) -> None:
        """Take rows (the older ones weighed down by forget once), and refit."""
        new = torch.tensor([[*x, y] for x, y in zip(rows, ys)], dtype=torch.float64)
        self.r = torch.linalg.qr(torch.cat([self.r * math.sqrt(self.forget), new]), mode="r").R[:len(self.r)]
        self.theta = self.solve()

    def solve(self) -> list[float]:
        k = len(self.theta0)
        a, b = self.r[:, :k], self.r[:, k]
        if self.prior_weight > 0:   # the prior as k more rows: sqrt(w_i) (theta_i - theta0_i)
            theta0 = torch.tensor(self.theta0, dtype=torch.float64)
            floor = torch.tensor(self.floor or [0.0] * k, dtype=torch.float64)
            w = math.sqrt(self.prior_weight) / (theta0.abs() + floor)
            a, b = torch.cat([a, torch.diag(w)]), torch.cat([b, w * theta0])
        return nonnegative_lstsq(a, b)


def nonnegative_lstsq(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    """The c >= 0 minimising |a c - b|^2 (LeastSquares says how). By singular values (gelsd):
    the default driver's rank-revealing QR gets a column of zeros wrong."""
    coef = torch.linalg.lstsq(a, b[:, None], driver="gelsd").solution[:, 0]
    if bool((coef >= 0).all()):   # the unconstrained optimum is feasible: it is the optimum
        return coef.tolist()
    k = a.shape[1]
    best, best_err = [0.0] * k, float(b @ b)
    for subset in itertools.chain.from_iterable(itertools.combinations(range(k), n) for n in range(1, k)):
        coef = torch.linalg.lstsq(a[:, subset], b[:, None], driver="gelsd").solution[:, 0]
        err = float(((a[:, subset] @ coef - b) ** 2).sum())
        if bool((coef >= 0).all()) and err < best_err:
            best, best_err = [0.0] * k, err
            for i, c in zip(subset, coef.tolist()):
                best[i] = c
    return best


# ----------------------------------------------------------------------------- the step model


FORGET = 0.995            # a level's weight on the steps before the last (~200 steps: it tracks drift)
Place = tuple[str, str | None]   # ("whole", None), or ("decode" or "prefill", a split's key)
WHOLE: Place = ("whole", None)


def place_of(decodes: int, sm_split: tuple[int, int] | None) -> Place:
    """Where a timed step ran: on the whole GPU, or on a lane of sm_split (decodes 0: its
    prefill lane's chunk)."""
    if sm_split is None:
        return WHOLE
    return ("prefill" if decodes == 0 else "decode", split_key(sm_split))


class StepModel:
    """A step's ms at each place it runs: the whole GPU (decodes d holding c tokens of
    context, prompt tokens p beside them: step_time), a split's decode lane (its decodes
    alone) and a split's prefill lane (a chunk of p prompt tokens: prefill_time). Each is
    the profile's model of the place (p: its HardwareParams) times a level, refitted by
    LeastSquares on the steps timed there (observe). One factor, not the terms one by one:
    live traffic holds the batch and the context near where the load keeps them, where
    the terms cannot be told apart, and a fit of each drove them apart (docs/router.md);
    what live traffic changes is the level (the host's pace, how hard the other lane
    presses on the memory bandwidth), the shape in batch and context is what the profiler
    measured. The router learns it, from every step every worker timed (docs/router.md);
    a worker's controller reads it as the router sends it (docs/controller.md)."""

    def __init__(self, params: HardwareParams):
        self.levels: dict[Place, LeastSquares] = {}
        self.seed(params)

    def seed(self, params: HardwareParams) -> None:
        """Take params as the profile the levels scale."""
        self.p = copy.deepcopy(params)

    def knows(self, place: Place) -> bool:
        return place[1] is None or place[1] in self.p.splits

    def level(self, place: Place) -> float:
        fit = self.levels.get(place)
        return 1.0 if fit is None else fit.theta[0]

    def coefficients(self, place: Place, level: float = 1.0) -> tuple[list[float], float]:
        """(theta, knee) of place times level: step_time's, or a prefill lane's prefill_time's
        (its knee 0)."""
        lane, key = place
        if lane == "whole":
            p = self.p
            theta, thresh = [p.beta, p.beta, p.slope, p.kv, p.gamma], p.batch_thresh
        elif lane == "decode":
            s = self.p.splits[key]
            theta, thresh = [s.beta, s.beta, s.slope, s.kv, 0.0], s.batch_thresh
        else:
            s = self.p.splits[key]
            theta, thresh = [s.alpha0, s.alpha, s.alpha2], 0.0
        return [level * t for t in theta], thresh

    def timer(self, place: Place, level: float | None = None) -> Callable[[int, float, int], float]:
        """A step's ms at place as a function of (decodes, context, prompt), its coefficients
        read out once: a forecast calls it at every step it simulates. At least 1 µs (time
        moves on)."""
        theta, thresh = self.coefficients(place, self.level(place) if level is None else level)
        if place[0] == "prefill":
            return lambda d, c, p: max(1e-3, prefill_time(theta, p))
        return lambda d, c, p: max(1e-3, step_time(theta, thresh, d, c, p))

    def predict(self, place: Place, decodes: int, context: int, prompt: int) -> float:
        return self.timer(place)(decodes, context, prompt)

    def observe(self, decodes: int, context: int, prompt: int, ms: float,
                sm_split: tuple[int, int] | None = None) -> None:
        """Learn a step a worker timed: its place's level, against the profile's prediction of
        it. Nothing from a split the profile did not measure, nor from a whole-GPU step with
        no decodes (its prefill rate is learned from requests, router.py)."""
        place = place_of(decodes, sm_split)
        if not self.knows(place) or ms <= 0 or (place == WHOLE and not decodes) or not (decodes or prompt):
            return
        if place not in self.levels:   # the profile's level, 1, as the prior (a standard deviation of 1)
            self.levels[place] = LeastSquares([1.0], [0.0], FORGET, 1.0, OUTLIER_CLIP)
        self.levels[place].observe([self.timer(place, 1.0)(decodes, context, prompt)], ms)

    def apply(self, params: HardwareParams) -> None:
        """Write the levelled step terms into params: the whole GPU's (beta, slope, kv, gamma)
        and each split's lanes (the prefill lane's alpha0, alpha, alpha2; the decode lane's
        beta, slope, kv). The prefill rates of the whole GPU are not a step's: left as they are."""
        def levelled(place: Place) -> list[float]:
            return self.coefficients(place, self.level(place))[0]
        params.beta, _, params.slope, params.kv, params.gamma = levelled(WHOLE)
        for key, s in params.splits.items():
            if key in self.p.splits:
                s.beta, _, s.slope, s.kv, _ = levelled(("decode", key))
                s.alpha0, s.alpha, s.alpha2 = levelled(("prefill", key))


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
        return prefill_time((self.p.alpha0, self.p.alpha, self.p.alpha2), tokens)

    def prefill_work_ms(self, tokens: float) -> float:
        """A prompt's own share of a prefill step: prefill_ms less the step's fixed cost alpha0."""
        return prefill_time((0.0, self.p.alpha, self.p.alpha2), tokens)

    def decode_step_ms(self, batch: float, context: float = 0.0) -> float:
        """A decode step of batch sequences holding context tokens in all."""
        return self.step_ms(batch, context, 0)

    def step_ms(self, decodes: float, context: float, prompt: float) -> float:
        """A whole-GPU step of decodes holding context tokens, with prompt tokens beside them."""
        p = self.p
        return step_time((p.beta, p.beta, p.slope, p.kv, p.gamma), p.batch_thresh, decodes, context, prompt)

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
