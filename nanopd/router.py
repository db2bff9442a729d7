"""The adaptive policy's decision: per request, prefill and decode on one worker
(collocated) or on two (disaggregated), whichever the cost model (costmodel.py) predicts
is faster.

  OutputLengthPredictor   an online Bayesian model of how many tokens a request will
                          generate, given its prompt length and max_tokens
  Router                  picks the cheapest path, then learns from what each request
                          (Observation) and each step really cost: the predictor is
                          updated, the prefill and transfer rates are refitted
                          (costmodel.py:LeastSquares) and every step's time is learned
                          (costmodel.py:StepModel)

Why one path beats the other (the rule gamma / transfer_rate > batch_thresh / load, and
the interference a prefill costs the decodes beside it) is costmodel.py's docstring and
docs/router.md.
"""

import collections
import dataclasses
import math
from dataclasses import dataclass, field
from statistics import NormalDist

import torch

from nanopd.costmodel import (
    HISTORY,
    OUTLIER_CLIP,
    CostModel,
    HardwareParams,
    LeastSquares,
    StepModel,
    WorkerLoad,
    split_key,
)

# ----------------------------------------------------------------------------- output lengths


def student_t_quantile(q: float, df: float) -> float:
    """Quantile of Student's t (Cornish-Fisher expansion around the normal's; close enough
    for df >= 3, which a prior of 3 pseudo-observations guarantees)."""
    z = NormalDist().inv_cdf(q)
    return (z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * df ** 3))


PRIOR_SHAPE = PRIOR_RATE = 1.5   # inverse-gamma prior on the variance: 3 pseudo-observations, variance ~1


@dataclass
class LogLengthPosterior:
    """Bayesian linear regression of y = log(output tokens) on x = [1, log(max_tokens / 256)]:
    y ~ N(w . x, s2), with the conjugate prior w ~ N(m, s2 V), s2 ~ InvGamma(a, b), so every
    observation updates (m, V, a, b) exactly. The max_tokens term lets the data say how much
    the cap tells about the length: nothing when outputs end long before it, everything when
    requests run to it (ignore_eos); the prior starts with no dependence."""
    m: torch.Tensor = field(default_factory=lambda: torch.tensor([math.log(128), 0.0], dtype=torch.float64))
    V: torch.Tensor = field(default_factory=lambda: torch.eye(2, dtype=torch.float64))
    a: float = PRIOR_SHAPE   # shape: 2a pseudo-observations behind the variance
    b: float = PRIOR_RATE    # rate: variance of log length ~ b / a
    n: int = 0               # observations so far

    @staticmethod
    def features(max_tokens: int) -> torch.Tensor:
        return torch.tensor([1.0, math.log(max(1, max_tokens) / 256)], dtype=torch.float64)

    def update(self, max_tokens: int, y: float) -> None:
        x = self.features(max_tokens)
        vx = self.V @ x
        s = 1.0 + x @ vx                  # predictive variance of y, in units of s2
        residual = y - x @ self.m
        self.m = self.m + vx * residual / s
        self.V = self.V - torch.outer(vx, vx) / s
        self.a, self.b, self.n = self.a + 0.5, self.b + residual.item() ** 2 / (2 * s.item()), self.n + 1

    def predictive(self, max_tokens: int) -> tuple[float, float, float]:
        """The posterior predictive of y: Student t (location, scale, degrees of freedom)."""
        x = self.features(max_tokens)
        return (x @ self.m).item(), math.sqrt(self.b / self.a * (1.0 + (x @ self.V @ x).item())), 2 * self.a

    def as_prior(self, weight: float) -> "LogLengthPosterior":
        """This posterior with its evidence scaled down to about `weight` observations."""
        scale = max(1.0, self.n / weight)
        return LogLengthPosterior(self.m.clone(), self.V * scale,
                                  PRIOR_SHAPE + (self.a - PRIOR_SHAPE) / scale,
                                  PRIOR_RATE + (self.b - PRIOR_RATE) / scale)


@dataclass
class LengthPrediction:
    mean: float     # expected output tokens
    low: float      # the interval holding `coverage` of outcomes
    high: float


@dataclass
class OutputLengthPredictor:
    """Output length given prompt length and max_tokens: a LogLengthPosterior per
    prompt-length bucket (powers of two), updated with every finished request. A bucket
    with no data of its own starts from the pooled posterior of all requests, weighted as
    a few observations. Predictions never exceed max_tokens."""
    coverage: float = 0.8
    pooled: LogLengthPosterior = field(default_factory=LogLengthPosterior)
    buckets: dict[int, LogLengthPosterior] = field(default_factory=dict)

    @staticmethod
    def bucket(prompt_len: int) -> int:
        return max(0, prompt_len - 1).bit_length()

    def update(self, prompt_len: int, output_len: int, max_tokens: int) -> None:
        y = math.log(max(1, output_len))
        k = self.bucket(prompt_len)
        if k not in self.buckets:   # a new bucket starts from what all requests said so far
            self.buckets[k] = self.pooled.as_prior(4.0)
        self.buckets[k].update(max_tokens, y)
        self.pooled.update(max_tokens, y)

    def predict(self, prompt_len: int, max_tokens: int) -> LengthPrediction:
        posterior = self.buckets.get(self.bucket(prompt_len), self.pooled)
        loc, scale, df = posterior.predictive(max_tokens)
        t = student_t_quantile(0.5 + self.coverage / 2, df)
        # The mean of exp(y) under a log-normal with the predictive's location and scale.
        mean = math.exp(loc + scale ** 2 / 2)
        return LengthPrediction(min(mean, max_tokens), min(math.exp(loc - t * scale), max_tokens),
                                min(math.exp(loc + t * scale), max_tokens))


# ----------------------------------------------------------------------------- learning the parameters


FORGET = 0.995   # the prefill and transfer fits' weight on the requests before the last (~200: tracks drift)


def online_fit(theta0: list[float], floor: list[float]) -> LeastSquares:
    """A refit of the profile's theta0 on the requests: the profile as prior, with a standard
    deviation as large as each parameter (or floor, for parameters profiled as 0): a few
    consistent observations are enough to move it; with forgetting, clipped outliers."""
    return LeastSquares(theta0, floor, FORGET, 1.0, OUTLIER_CLIP)


@dataclass
class Observation:
    """What one finished request cost, as the central scheduler measured it (ms)."""
    prompt_len: int
    output_len: int
    prefill_worker: int
    decode_worker: int
    load_prefill: WorkerLoad      # the loads when it was routed
    load_decode: WorkerLoad
    prefill_ms: float             # queued + prefilling
    transfer_ms: float            # the handoff, less any wait for a seat on the decode worker
    decode_ms: float              # ... that wait, and decoding
    predicted_ms: float | None = None   # what route() predicted (with the predicted output length)
    max_tokens: int | None = None       # the request's cap (None: taken as its output length)
    # The configurations (SM split, token budget) its worker held while it ran, each with its
    # share of the request's time; empty: the one it was routed under, throughout.
    ran_under: list[tuple[float, tuple[int, int] | None, int | None]] = field(default_factory=list)

    @property
    def split_changed(self) -> bool:
        """Its worker held another SM split (or took one) for some of the time it ran."""
        return any(split != self.load_prefill.sm_split for _, split, _ in self.ran_under)


class Router:
    """Picks each request's path by predicted cost and refits the cost model online, from
    two kinds of measurement:
      every finished request:  prefill  = alpha0 + alpha * (queued + L)
                               (plus the profiled alpha2 per prompt, CostModel.squares; not from
                               requests routed to a worker with no seat free, whose
                               wait says how soon a seat frees, not how fast prefill is)
                               transfer = transfer_rate * L    (disaggregated only)
      every step a worker ran: the step model (costmodel.py:StepModel), the profiler's own
                               model of the place it ran at, its level refitted
    both by costmodel.py:LeastSquares. A request's decode time is not fitted as a whole:
    the load it was routed under (a snapshot) only estimates the load it decodes under, so
    the router learns the steps' level from steps, whose shapes are exact. batch_thresh
    stays as profiled. A split worker's lanes learn from its steps alone: its prompt chunks
    rescale the prefill lane's model (a request's wait there is mostly the chunk ahead of
    it, not its own prefill), its decode steps on the lane the decode lane's (on the whole
    GPU, with no prompt beside, they rescale the whole GPU's). The steps are learned here,
    centrally, and nowhere else: every worker's controller reads the refit as the cluster
    sends it (messages.py:Control)."""

    def __init__(self, params: HardwareParams, predictor: OutputLengthPredictor | None = None,
                 slo: tuple[float, float] | None = None):
        self.cost = CostModel(params)
        self.slo = slo   # (TTFT s, TPOT s): route for goodput instead of latency
        self.predictor = predictor or OutputLengthPredictor()
        p = params
        self.fit_prefill = online_fit([p.alpha0, p.alpha], [1e-1, 1e-3])
        self.fit_transfer = online_fit([p.transfer_rate], [1e-4])
        self.fit_links: dict[str, LeastSquares] = {}
        self.steps = StepModel(params)   # the step model, the one learner of steps (its profile a copy)
        # the last HISTORY requests' errors (a server runs for days: a window, not every request)
        self.errors = collections.deque(maxlen=HISTORY)         # |route()'s prediction - measured| / measured
        self.model_errors = collections.deque(maxlen=HISTORY)   # the same with the true output length
        self.split_changed = collections.deque(maxlen=HISTORY)  # per error: its worker's SM split changed

    def route(self, prompt_len: int, max_tokens: int, loads: dict[int, WorkerLoad], needed_blocks: int = 0,
              prefill_workers: list[int] | None = None, decode_workers: list[int] | None = None
              ) -> tuple[int, int, float]:
        """(prefill worker, decode worker, predicted ms) of the best path: the same worker
        twice is the collocated path. The prefill worker is one of prefill_workers, the
        decode worker one of decode_workers (the regime's roles; default: any of loads);
        decode workers without needed_blocks free are passed over while another has them.
        Best is the cheapest: predicted latency plus the prefill's interference with the
        decodes on its worker. Under an SLO, the cheapest of the paths predicted to meet
        both targets; if none does, the one that costs the others least (its interference)."""
        out = self.predictor.predict(prompt_len, max_tokens).mean
        prefill_workers = prefill_workers or list(loads)
        decoders = decode_workers or list(loads)
        decoders = [d for d in decoders if loads[d].free_blocks >= needed_blocks] or decoders
        options = []   # (meets the SLO, cost, latency, p, d)
        for p in prefill_workers:
            cost = self.cost_at(loads[p])
            harm = cost.interference_ms(prompt_len, loads[p].decode_batch)   # to p's decodes, either path
            for d in decoders:
                ttft, rest = cost.path_ms(prompt_len, out, loads[p], None if p == d else loads[d],
                                          self.cost.p.link(p, d))
                meets = self.slo is None or (ttft <= self.slo[0] * 1e3
                                             and rest <= self.slo[1] * 1e3 * max(1, out - 1))
                options.append((meets, (ttft + rest + harm) if meets else harm, ttft + rest, p, d))
        meets, _, ms, p, d = min(options, key=lambda o: (not o[0], o[1]))
        return p, d, ms

    def measured_split(self, load: WorkerLoad) -> str | None:
        """The key of the split a worker in this state runs on, if the profile measured it
        (HardwareParams.splits); None: the whole GPU's model is its."""
        key = None if load.sm_split is None else split_key(load.sm_split)
        return key if key in self.cost.p.splits else None

    def cost_at(self, load: WorkerLoad) -> CostModel:
        """The cost model of a worker in this state: a split worker's lanes as measured and
        refitted (decodes taken on the decode lane, beside prompts), else the whole GPU's."""
        return self.cost if self.measured_split(load) is None else self.cost.on_split(load.sm_split)

    def predicted_ms(self, o: Observation) -> float:
        """What the cost model predicts for a finished request with its true output length:
        collocated, under each configuration its worker held while it ran, for its share of
        the time (the load otherwise as routed)."""
        if o.prefill_worker == o.decode_worker:
            held = o.ran_under or [(1.0, o.load_prefill.sm_split, o.load_prefill.token_budget)]
            loads = [(share, dataclasses.replace(o.load_prefill, sm_split=split, token_budget=token_budget))
                     for share, split, token_budget in held]
            return sum(share * self.cost_at(w).collocated_ms(o.prompt_len, o.output_len, w)
                       for share, w in loads)
        return self.cost.disaggregated_ms(o.prompt_len, o.output_len, o.load_prefill, o.load_decode,
                                          self.cost.p.link(o.prefill_worker, o.decode_worker))

    def observe(self, o: Observation) -> None:
        """Learn from a finished request: its error is recorded against the prediction
        made with its true output length, then the predictor and (unless its worker's split
        changed meanwhile) the prefill and transfer parameters move."""
        measured = max(o.prefill_ms + o.transfer_ms + o.decode_ms, 1e-9)
        self.model_errors.append(abs(self.predicted_ms(o) - measured) / measured)
        if o.predicted_ms is not None:
            self.errors.append(abs(o.predicted_ms - measured) / measured)
            self.split_changed.append(o.split_changed)
        self.predictor.update(o.prompt_len, o.output_len, o.max_tokens or o.output_len)
        if o.split_changed:   # it ran partly on another split: it says nothing of the one it was routed to
            return
        p = self.cost.p
        n = o.load_prefill.queued_prefill_tokens + o.prompt_len
        # Not from a request that waited for a seat (that says how soon one frees), nor from
        # a split worker's (its prefill lane learns from its chunks, observe_step).
        if o.load_prefill.decode_batch < o.load_prefill.seats and self.measured_split(o.load_prefill) is None:
            self.fit_prefill.observe([1.0, n], o.prefill_ms - p.alpha2 * self.cost.squares(o.load_prefill,
                                                                                         o.prompt_len))
            p.alpha0, p.alpha = self.fit_prefill.theta
        if o.prefill_worker != o.decode_worker:
            self.fit_transfer.observe([o.prompt_len], o.transfer_ms)
            self._refit_link(o)
        (p.transfer_rate,) = self.fit_transfer.theta

    def _refit_link(self, o: Observation) -> None:
        """A pair's own rate, where the profiler measured pairs apart (links): each pair has
        a fit of its own, starting from what the profiler measured on it."""
        key, p = f"{o.prefill_worker}>{o.decode_worker}", self.cost.p
        if key not in p.links:
            return
        fit = self.fit_links.setdefault(key, online_fit([p.links[key]], [1e-4]))
        fit.observe([o.prompt_len], o.transfer_ms)
        (p.links[key],) = fit.theta

    def observe_step(self, decodes: int, context_tokens: int, prefill_tokens: int, ms: float,
                     sm_split: tuple[int, int] | None = None) -> None:
        """Learn from one step a worker timed (StepModel.observe: the level of the place it ran
        at, a split's lane or the whole GPU) and take the step terms it gives into the cost
        model (StepModel.apply)."""
        self.steps.observe(decodes, context_tokens, prefill_tokens, ms, sm_split)
        self.steps.apply(self.cost.p)
