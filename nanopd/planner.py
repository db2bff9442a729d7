"""The adaptive policy's regime: which workers take prompts and which take decodes, chosen
for the arrivals seen lately by what the fitted cost model predicts in steady state. What
a worker's steps carry (its prompt budget) and the SM split it runs on are its own
controller's (controller.py), chosen from its engine's state as the load moves.

The router (router.py) picks each request's path from the load it sees. What makes
disaggregation pay is a property of the whole cluster: a GPU that never prefills, whose
decode steps prompts never stretch. No single request's choice brings that about, so the
planner decides it. Every few seconds it forecasts every regime open to the n workers for
the recent arrivals, and switches, with hysteresis, when another is clearly better; inside
the regime the router still routes each request. A regime gives each worker a role:

    both     takes prompts and decodes: the prompts' tokens share its decode steps
    prefill  takes prompts only; their KV moves to a decoding worker
    decode   takes decodes only, of requests prefilled elsewhere

One worker has one regime (both), so the cluster plans only for two or more (regimes).

The steady state of a regime (forecast), for requests arriving at rate lam with prompt
lengths L and predicted output lengths O:
  - prompts spread evenly over the workers that take them, decodes over those that decode;
    a both-worker decodes what it prefilled, as far as its share of the decodes goes;
  - a decoding worker holds N sequences, by Little's law N = lam_d O step(N) / (1 - u),
    where u = gamma x (prompt tokens per ms it prefills) stretches every step; its TPOT is
    step(N) / (1 - u);
  - a prompt waits in an M/G/1 queue, W = lam_p E[S^2] / (2 (1 - rho)), its service S the
    prefill alone (a prefill worker) or its tokens inside decode steps (a both-worker);
    a prefill worker batches: its next step takes every prompt waiting, and pays the
    step's fixed cost alpha0 once for all of them (prefill_queue);
  - a request that moves pays transfer_rate x L between its first and second token.
A worker asked for more than it can serve (rho, u, or its decodes at full seats, >= 1)
makes the regime overloaded: its queues grow as long as the arrivals last. Among
overloaded regimes the best is the one that serves the most, the highest arrival rate of
the same mix it could keep up with (its capacity): its queues grow slowest.
"""

import collections
import itertools
import math
from dataclasses import dataclass, field

from nanopd.costmodel import HISTORY, MAX_PREFILL_SHARE, CostModel, WorkerLoad
from nanopd.kv_cache import cdiv

HYSTERESIS = 0.05        # a regime must be predicted this much better to replace the current one
PLAN_INTERVAL_S = 2.0    # how often the cluster asks the planner
MIX_WINDOW_S = 10.0      # the arrivals a plan is for: those of the last this many seconds
MIN_ARRIVALS = 8         # fewer say too little to plan on
MIX_SAMPLE = 400         # the lengths a forecast weighs: an even sample of the window (planning blocks)
MIX_CHANGE = 0.5         # a rate or mean prompt length this far (50%) off the window's is a new mix
MIN_DWELL_S = 6.0        # a regime the planner chose is kept at least this long (Planner.plan)


@dataclass(frozen=True)
class Regime:
    both: int = 0                # workers that take prompts and decodes
    prefill: int = 0             # workers that only prefill
    decode: int = 0              # workers that only decode

    def roles(self) -> list[str]:
        """One role per worker, both-workers first."""
        return ["both"] * self.both + ["prefill"] * self.prefill + ["decode"] * self.decode

    def __str__(self) -> str:
        return " + ".join(f"{n} {role}" for role, n in (("both", self.both), ("prefill", self.prefill),
                                                         ("decode", self.decode)) if n)


def regimes(n: int) -> list[Regime]:
    """Every regime of n workers in which someone prefills and someone decodes."""
    return [Regime(both, prefill, n - both - prefill)
            for both, prefill in itertools.product(range(n + 1), repeat=2)
            if both + prefill <= n and both + prefill > 0 and n - prefill > 0]


@dataclass
class Mix:
    """The arrivals a regime is planned for."""
    rate: float                  # requests per ms
    prompt_lens: list[int]       # (a sample of) their lengths
    output_lens: list[float]     # predicted
    count: int = 0               # the arrivals the rate is measured from (0: as many as the lengths)


@dataclass
class RoleState:
    """A role's predicted steady state, per worker in it."""
    decodes: float = 0.0         # N, sequences decoding
    step_ms: float = 0.0         # a decode step without prompt tokens
    context: float = 0.0         # a decoding sequence's mean tokens of context
    tpot_ms: float = 0.0         # the mean time between a request's tokens there
    wait_ms: float = 0.0         # a prompt's mean wait before its prefill starts
    busy: float = 0.0            # the prompt server's utilization (rho, or u)
    load: float = 0.0            # demand / capacity, its busiest part


@dataclass
class Forecast:
    regime: Regime
    e2e_ms: float                # mean end-to-end latency over the mix
    load: float                  # the busiest worker's demand / capacity (>= 1: overloaded)
    slo_attainment: float | None = None
    roles: dict[str, RoleState] = field(default_factory=dict)
    capacity: float = math.inf   # overloaded: the highest rate (requests per ms) of the mix it keeps up with

    def key(self) -> tuple:
        """What the planner minimises: feasible before overloaded; then the SLO attainment
        (higher is better) or the mean latency; overloaded ones by their capacity."""
        if self.load >= 1:
            return (1, -self.capacity, 0.0)
        if self.slo_attainment is None:
            return (0, self.e2e_ms, 0.0)
        return (0, -round(self.slo_attainment, 2), self.e2e_ms)   # attainments within 1% tie


# ----------------------------------------------------------------------------- the steady state


def decode_state(cost: CostModel, rate: float, out: float, context: float, u: float,
                 seats: int) -> tuple[float, float]:
    """(N, load) of a worker that starts decodes at `rate` per ms, each `out` tokens long,
    its steps stretched by 1 / (1 - u): the smallest N = rate out step(N) / (1 - u) (Little's
    law), found by iterating from the empty batch; load = that right side at N = seats,
    over seats (>= 1: more decodes than its seats can serve)."""
    def demand(n: float) -> float:
        return rate * out * cost.decode_step_ms(n, n * context) / (1.0 - u)
    load = demand(seats) / seats
    if load >= 1:
        return float(seats), load
    n = 0.0
    for _ in range(200):   # increasing and bounded by seats: it converges
        n_next = demand(n)
        if abs(n_next - n) < 1e-6 * (1 + n):
            break
        n = n_next
    return n, load


def mg1_wait(rate: float, s_mean: float, s_sq: float) -> tuple[float, float]:
    """(mean wait, utilization) of an M/G/1 queue: Pollaczek-Khinchine."""
    rho = rate * s_mean
    return (rate * s_sq / (2 * (1 - rho)) if rho < 1 else math.inf), rho


def prefill_queue(cost: CostModel, rate: float, prompt_lens: list[int]) -> tuple[float, float]:
    """(mean wait, utilization) of a worker that only prefills, its next step taking every
    prompt waiting. A prompt's own work is w = alpha L + alpha2 L^2; the step's fixed cost
    alpha0 is paid once per step, so a prompt that finds the worker busy (probability
    rho = rate E[w]) shares it with the others waiting: the queue sees service w + alpha0
    (1 - rho), and the worker keeps up as long as rho < 1 (one prompt per step would need
    rate (E[w] + alpha0) < 1). The prompts that arrive while one waits join its step and
    lengthen it, by rho / 2 of its wait on average. Against a simulated batching server
    this is within 20% from 10% to 80% load (test_nanopd.py); past that it errs high for
    prompts all of one length, whose steps vary least."""
    p = cost.p
    work = [cost.prefill_work_ms(n) for n in prompt_lens]
    rho = rate * sum(work) / len(work)
    if rho >= 1:
        return math.inf, rho
    s = [w + p.alpha0 * (1 - rho) for w in work]
    wait, _ = mg1_wait(rate, sum(s) / len(s), sum(x * x for x in s) / len(s))
    return wait * (1 + rho / 2), rho


def wait_within(t: float, wait: float, rho: float) -> float:
    """P(a prompt waits at most t): the tail rho exp(-rho t / W) (exact for M/M/1)."""
    if t < 0:
        return 0.0
    return 1.0 if wait <= 0 else 1.0 - rho * math.exp(-rho * t / wait)


def forecast(cost: CostModel, regime: Regime, mix: Mix, seats: int, slo: tuple[float, float] | None = None,
             with_capacity: bool = True) -> Forecast:
    """The regime's steady state for the mix (see the module's docstring)."""
    lam = mix.rate
    n_take = regime.both + regime.prefill   # workers that take prompts
    n_dec = regime.both + regime.decode     # workers that decode
    lam_p, lam_d = lam / n_take, lam / n_dec   # per worker
    mean_l = sum(mix.prompt_lens) / len(mix.prompt_lens)
    mean_o = sum(mix.output_lens) / len(mix.output_lens)
    context = mean_l + mean_o / 2
    roles = {}
    if regime.prefill:   # prefill alone: its steps carry no decodes
        wait, rho = prefill_queue(cost, lam_p, mix.prompt_lens)
        roles["prefill"] = RoleState(wait_ms=wait, busy=rho, load=rho)
    if regime.decode:
        n, load = decode_state(cost, lam_d, mean_o, context, 0.0, seats)
        step = cost.decode_step_ms(n, n * context)
        roles["decode"] = RoleState(decodes=n, step_ms=step, tpot_ms=step, load=load)
    if regime.both:
        roles["both"] = both_state(cost, lam_p, lam_d, mix, mean_l, mean_o, seats)
    load = max(r.load for r in roles.values())
    e2e, met = request_outcomes(cost, regime, mix, roles, lam_p, lam_d, slo) if load < 1 else (math.inf, 0.0)
    result = Forecast(regime, e2e, load, met if slo is not None else None, roles)
    if load >= 1 and with_capacity:
        result.capacity = capacity(cost, regime, mix, seats)
    return result


def capacity(cost: CostModel, regime: Regime, mix: Mix, seats: int) -> float:
    """The highest arrival rate (per ms) of the mix's lengths the regime keeps up with:
    the rate where its busiest worker's load reaches 1, by bisection."""
    def load(rate: float) -> float:
        return forecast(cost, regime, Mix(rate, mix.prompt_lens, mix.output_lens), seats,
                        with_capacity=False).load
    lo, hi = 0.0, mix.rate
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if load(mid) < 1 else (lo, mid)
    return lo


def both_state(cost: CostModel, lam_p: float, lam_d: float, mix: Mix, mean_l: float, mean_o: float,
               seats: int) -> RoleState:
    """A worker that prefills lam_p prompts per ms inside its decode steps and decodes lam_d
    requests per ms."""
    p = cost.p
    u = p.gamma * lam_p * mean_l   # share of its time on prompt tokens
    n, load = decode_state(cost, lam_d, mean_o, mean_l + mean_o / 2, min(u, MAX_PREFILL_SHARE), seats)
    step = cost.decode_step_ms(n, n * (mean_l + mean_o / 2))
    s_mean, s_sq = p.gamma * mean_l, p.gamma ** 2 * sum(x * x for x in mix.prompt_lens) / len(mix.prompt_lens)
    return RoleState(decodes=n, step_ms=step, context=mean_l + mean_o / 2,
                     tpot_ms=step / (1 - u) if u < 1 else math.inf,
                     wait_ms=mg1_wait(lam_p, s_mean, s_sq)[0] if u < 1 else math.inf, busy=u,
                     load=max(load, u / MAX_PREFILL_SHARE))


def request_outcomes(cost: CostModel, regime: Regime, mix: Mix, roles: dict[str, RoleState], lam_p: float,
                     lam_d: float, slo: tuple[float, float] | None) -> tuple[float, float | None]:
    """(mean E2E ms, SLO attainment) over the mix. A request prefills on a both-worker or a
    prefill worker, in proportion to their numbers; a both-worker keeps min(lam_p, lam_d) of
    its prompts to decode itself; the rest move to the decoding workers' spare decode shares."""
    lam = mix.rate
    both, pre = roles.get("both"), roles.get("prefill")
    local = regime.both * min(lam_p, lam_d) / lam   # the share of all requests the both-workers keep
    moved_from_both = regime.both * lam_p / lam - local
    moved_from_pre = regime.prefill * lam_p / lam
    # Where moved requests decode: the decode workers, and the both-workers' spare decode shares.
    into = [(roles["decode"].tpot_ms, regime.decode * lam_d)] if regime.decode else []
    if both and lam_d > lam_p:
        into.append((both.tpot_ms, regime.both * (lam_d - lam_p)))
    moved_tpot = sum(t * r for t, r in into) / sum(r for _, r in into) if into else 0.0
    e2e = met = 0.0
    for n, out in zip(mix.prompt_lens, mix.output_lens):
        classes = []
        if both:
            ttft = both.wait_ms + cost.step_ms(both.decodes, both.decodes * both.context, n)
            classes += [(local, ttft, 0.0, both.tpot_ms, both),
                        (moved_from_both, ttft, 1.0, moved_tpot, both)]
        if pre:
            classes.append((moved_from_pre, pre.wait_ms + cost.prefill_ms(n), 1.0, moved_tpot, pre))
        # classes of no share are left out: inf x 0 is NaN
        for share, ttft, moved, tpot, server in [c for c in classes if c[0] > 0]:
            e2e += share * (ttft + (cost.p.transfer_rate * n if moved else 0.0) + out * tpot)
            if slo is not None:
                own = ttft - server.wait_ms
                met += share * wait_within(slo[0] * 1e3 - own, server.wait_ms, server.busy) \
                    * (tpot <= slo[1] * 1e3)
    count = len(mix.prompt_lens)
    return e2e / count, (met / count if slo is not None else None)


# ----------------------------------------------------------------------------- choosing


def rank(cost: CostModel, mix: Mix, seats: int, n: int,
         slo: tuple[float, float] | None = None) -> list[Forecast]:
    """Every regime of n workers forecast for the mix, best first (Forecast.key)."""
    return sorted((forecast(cost, r, mix, seats, slo) for r in regimes(n)), key=Forecast.key)


@dataclass
class PlanLog:
    """A regime change: when, the roles it gave the workers, and the forecasts that chose it."""
    time: float
    regime: Regime
    roles: dict[int, str]
    forecasts: list[Forecast]


class Planner:
    """Decides the cluster's regime and each worker's role in it (roles, which the cluster
    writes into its role map, roles.py). The cluster tells it of every arrival
    (arrived) and asks it every PLAN_INTERVAL_S (plan): it forecasts every regime for the
    arrivals of the last MIX_WINDOW_S and switches when one beats the current by the
    hysteresis margin (or the current is overloaded and another less so). A regime it chose
    is kept MIN_DWELL_S, a few requests' lifetimes: a switch changes the role under every
    request running, whose predicted costs were for the one they were routed
    under, and over a few seconds the arrivals' rate swings by more than a forecast's margin
    (a burst, then a lull), so without it the regime chased them. A worker's death is not a
    choice and holds nothing. Every change is logged with its forecasts."""

    def __init__(self, workers: list[int], slo: tuple[float, float] | None = None,
                 hysteresis: float = HYSTERESIS):
        self.slo, self.hysteresis = slo, hysteresis
        self.roles = dict.fromkeys(workers, "both")   # every worker mixed until arrivals say otherwise
        self.regime = Regime(both=len(workers))
        # each arrival: (time, L, O predicted)
        self.arrivals: collections.deque[tuple[float, int, float]] = collections.deque()
        self.planned_at = -math.inf
        self.chosen_at = -math.inf   # when the planner last chose a regime (not a worker's death)
        self.log: collections.deque[PlanLog] = collections.deque(maxlen=HISTORY)   # the last regime changes

    def arrived(self, now: float, prompt_len: int, predicted_out: float) -> None:
        self.arrivals.append((now, prompt_len, predicted_out))

    def reset(self, live: list[int], now: float) -> None:
        """A worker died: every live worker both until the next plan says otherwise (the
        regime it had may have lost the only worker of a role)."""
        self.switch(Regime(both=len(live)), {w: WorkerLoad() for w in live}, now, [])

    def time_to_plan(self, now: float) -> bool:
        """Whether PLAN_INTERVAL_S has passed since the last plan."""
        return now - self.planned_at >= PLAN_INTERVAL_S

    def plan(self, cost: CostModel, loads: dict[int, WorkerLoad], seats: int, now: float) -> bool:
        """Replan for the live workers (loads' keys) if it is due; True if a role changed."""
        if not self.time_to_plan(now):
            return False
        self.planned_at, before = now, dict(self.roles)
        if not loads:   # no live worker: nothing to plan for (the cluster fails what arrives)
            return False
        if set(loads) != set(self.roles):   # a worker died: all mixed on the live ones, then plan
            self.switch(Regime(both=len(loads)), loads, now, [])
        while self.arrivals and now - self.arrivals[0][0] > MIX_WINDOW_S:
            self.arrivals.popleft()
        self.forget_a_changed_mix(now)
        if len(self.arrivals) >= MIN_ARRIVALS and now - self.chosen_at >= MIN_DWELL_S:
            span = max(now - self.arrivals[0][0], PLAN_INTERVAL_S)
            sample = list(self.arrivals)[::cdiv(len(self.arrivals), MIX_SAMPLE)]
            mix = Mix(len(self.arrivals) / (span * 1e3), [a[1] for a in sample], [a[2] for a in sample],
                      len(self.arrivals))
            forecasts = rank(cost, mix, seats, len(loads), self.slo)
            current = next((f for f in forecasts if f.regime == self.regime), None)
            if forecasts[0].regime != self.regime and (current is None or (
                    self.clearly_better(forecasts[0], current)
                    and self.better_below(cost, forecasts[0], current, mix, seats))):
                self.switch(forecasts[0].regime, loads, now, forecasts)
        return self.roles != before

    def forget_a_changed_mix(self, now: float) -> None:
        """On a clear change in the arrivals (the last PLAN_INTERVAL_S's rate or mean prompt
        length off the window's by more than MIX_CHANGE), plan for the new mix alone: drop
        the arrivals before it rather than wait MIX_WINDOW_S for them to age out."""
        recent = [a for a in self.arrivals if now - a[0] <= PLAN_INTERVAL_S]
        older = [a for a in self.arrivals if now - a[0] > PLAN_INTERVAL_S]
        if len(recent) < MIN_ARRIVALS or len(older) < MIN_ARRIVALS:
            return
        span = max(now - older[0][0] - PLAN_INTERVAL_S, PLAN_INTERVAL_S)
        rate_ratio = (len(recent) / PLAN_INTERVAL_S) / (len(older) / span)
        length_ratio = (sum(a[1] for a in recent) / len(recent)) / (sum(a[1] for a in older) / len(older))
        if max(rate_ratio, 1 / rate_ratio, length_ratio, 1 / length_ratio) > 1 + MIX_CHANGE:
            while self.arrivals and now - self.arrivals[0][0] > PLAN_INTERVAL_S:
                self.arrivals.popleft()

    def better_below(self, cost: CostModel, new: Forecast, current: Forecast, mix: Mix, seats: int) -> bool:
        """Whether new is still clearly better than current at one standard error below the
        rate's estimate: n Poisson arrivals give the rate to about 1 / sqrt(n), and near a
        worker's limit a forecast swings with the rate (a queue's wait grows as 1 / (1 -
        rho)); a win that needs the rate as high as the estimate may be a burst's, which a
        switch (and the switch back) would cost more than it lasts."""
        low = Mix(mix.rate * (1 - (mix.count or len(mix.prompt_lens)) ** -0.5), mix.prompt_lens,
                  mix.output_lens)
        return self.clearly_better(forecast(cost, new.regime, low, seats, self.slo),
                                   forecast(cost, current.regime, low, seats, self.slo))

    def switch(self, regime: Regime, loads: dict[int, WorkerLoad], now: float,
               forecasts: list[Forecast]) -> None:
        """Take the regime: chosen by its forecasts, or forced (none: a worker died), which holds nothing."""
        self.regime, self.roles = regime, assign_roles(regime, loads)
        self.chosen_at = now if forecasts else -math.inf
        self.log.append(PlanLog(now, regime, dict(self.roles), forecasts))

    def clearly_better(self, new: Forecast, old: Forecast) -> bool:
        (new_over, new_a, new_b), (old_over, old_a, old_b) = new.key(), old.key()
        if new_over != old_over:
            return new_over < old_over
        if self.slo is not None and not new_over:   # attainment higher by the margin, or as high and faster
            return -new_a > -old_a + self.hysteresis or (new_a == old_a
                                                         and new_b < old_b * (1 - self.hysteresis))
        return new_a < old_a * (1 - self.hysteresis)


def assign_roles(regime: Regime, loads: dict[int, WorkerLoad]) -> dict[int, str]:
    """Which worker takes which role: prefill roles to the workers decoding least (they have
    the least to finish), decode roles to those decoding most, both in between. A worker
    keeps its cache and running requests whatever its new role."""
    order = sorted(loads, key=lambda w: (loads[w].decode_batch, w))
    roles = ["prefill"] * regime.prefill + ["both"] * regime.both + ["decode"] * regime.decode
    return dict(zip(order, roles))
