"""`python bench.py simulate RUN/results.json`: one whole-GPU worker served in simulation, on
the step times of a recorded run, nothing measured. bench.py's requests (the same workloads,
arrivals and seed) go through the engine's own Scheduler and BlockManager (scheduler.py,
kv_cache.py) one step at a time, each step taking the ms that StepTimes, fitted by least
squares on every whole-GPU step the run's workers timed, gives its shape; under each budget
of the controller's menu held fixed, and under the controller (controller.py), which chooses
every CONTROL_INTERVAL_S from the scheduler's state as an adaptive worker's does, its step
model the run's profile, refitted on the simulated steps as the router refits it and sent
every PLAN_INTERVAL_S as the cluster sends it. Printed per load:
each configuration's E2E p50 / p99, TTFT and TPOT p50 / p99 (s, ms), and the controller's
E2E against the best fixed budget's; under an SLO (--ttft-slo, --tpot-slo) each one's share
within it and, over the rates, goodput; with --phase-oracle on the phased workload, the best
assignment of a budget to each phase (phase_oracle: what a budget chosen per phase gains
there, knowing the phases to come). A change to the controller is then weighed on a recorded run's
step times, on any machine, before a GPU measures it.

Left out: the host (a step starts when the one before ends; the engine overlaps them), the
SM splits (their lanes run beside each other), and what the fit misses of a step (its
residuals, host stalls). A fit holds for the batches its run held (printed): past them it
extrapolates.
"""

import argparse
import copy
import itertools
import math
import statistics
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from nanopd.controller import CONTROL_INTERVAL_S, Controller, Recent, menu, snapshot
from nanopd.costmodel import HardwareParams, LeastSquares, StepModel, step_features, step_time
from nanopd.engine import StepShape, step_shape
from nanopd.kv_cache import BlockManager, cdiv
from nanopd.planner import PLAN_INTERVAL_S
from nanopd.request import Request, RequestMetrics, SamplingParams, Sequence
from nanopd.scheduler import Scheduler
from tools.calibrate import read_results

BLOCK_SIZE = 16
GOODPUT_SHARE = 0.9   # a rate's requests within the SLO for it to count toward goodput (bench.py's)


@dataclass
class StepTimes:
    """A whole-GPU step's ms by its shape: costmodel.py's step_time, its theta (a decode
    step's base, a mixed step's, per decode past the knee, per context token, per prompt
    token) fitted by costmodel.py's LeastSquares on a run's steps."""
    theta: list[float]
    knee: float
    batches: tuple[int, int] = (0, 0)   # the fewest and most decodes of the steps it was fitted on

    def ms(self, shape: StepShape) -> float:
        return max(1e-3, step_time(self.theta, self.knee, shape.decodes, shape.context_tokens,
                                   shape.prefill_tokens))

    @staticmethod
    def fit(steps: list[list], knee: float) -> "StepTimes":
        """Least squares on recorded steps ([t, worker, decodes, context, prompt, ms, split]),
        those on the whole GPU with decodes in them."""
        rows = [(d, c, p, ms) for _, _, d, c, p, ms, split in steps if split is None and d and ms > 0]
        if len(rows) < 5:
            raise ValueError(f"{len(rows)} whole-GPU steps with decodes recorded: too few to fit")
        theta = LeastSquares.fit([step_features(d, c, p, knee) for d, c, p, _ in rows], [r[3] for r in rows])
        return StepTimes(theta, knee, (min(r[0] for r in rows), max(r[0] for r in rows)))


@dataclass
class Served:
    """One request served in simulation (s)."""
    arrival: float
    ttft: float
    e2e: float
    output_len: int


def make_scheduler(specs: list, seats: int, max_num_batched_tokens: int) -> Scheduler:
    """A scheduler with blocks enough for every seat to hold the longest request."""
    longest = max(len(s.prompt_ids) + s.max_tokens for s in specs)
    return Scheduler(BlockManager(seats * cdiv(longest, BLOCK_SIZE) + 64, BLOCK_SIZE), seats,
                     max_num_batched_tokens)


@dataclass
class Adaptive:
    """The controller as an adaptive worker runs it: it chooses every CONTROL_INTERVAL_S from
    the scheduler's state and scores its step model on every step, which the router learns
    (StepModel.observe, learner) and sends the controller refitted every PLAN_INTERVAL_S (the
    cluster's Control)."""
    controller: Controller
    learner: StepModel = field(init=False)
    chosen_at: float = -math.inf
    told_at: float = 0.0

    def __post_init__(self):
        self.learner = StepModel(self.controller.model.p)

    def choose(self, sched: Scheduler, recent: Recent, clock: float) -> None:
        if clock - self.chosen_at >= CONTROL_INTERVAL_S:
            self.chosen_at = clock
            sched.token_budget = self.controller.choose(snapshot(sched, recent, clock)).token_budget

    def timed(self, shape: StepShape, ms: float, clock: float) -> None:
        self.controller.timed(shape.decodes, shape.context_tokens, shape.prefill_tokens, ms)
        self.learner.observe(shape.decodes, shape.context_tokens, shape.prefill_tokens, ms)
        if clock - self.told_at >= PLAN_INTERVAL_S:
            self.told_at, refit = clock, copy.deepcopy(self.controller.model.p)
            self.learner.apply(refit)
            self.controller.configure(refit, self.controller.slo)


def serve(specs: list, times: StepTimes, seats: int, max_num_batched_tokens: int,
          token_budget: int | None = None, controller: Controller | None = None,
          schedule: Callable[[float], int] | None = None) -> tuple[list[Served], Counter]:
    """specs (bench.py's Spec: arrival s, prompt ids, max_tokens) served to their end, one
    step at a time: at the fixed token budget, at the controller's choice of the moment, or
    at schedule(clock s) set before every step (phase_oracle's); with the steps run at each
    token budget."""
    sched = make_scheduler(specs, seats, max_num_batched_tokens)
    sched.token_budget = token_budget
    arrivals, recent, served = deque(sorted(specs, key=lambda s: s.arrival)), Recent(), []
    clock, first, ids, held = 0.0, {}, itertools.count(), Counter()
    adaptive = None if controller is None else Adaptive(controller)
    while arrivals or sched.has_work():
        while arrivals and arrivals[0].arrival <= clock:
            spec = arrivals.popleft()
            params = SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True, temperature=0.0)
            req = Request(next(ids), None, spec.prompt_ids, params, RequestMetrics(spec.arrival))
            sched.add(Sequence(req, 0, list(spec.prompt_ids), len(spec.prompt_ids), arrival=req.arrival))
            recent.arrived(spec.arrival, len(spec.prompt_ids), spec.max_tokens)
        if not sched.has_work():
            clock = arrivals[0].arrival
            continue
        if adaptive is not None:
            adaptive.choose(sched, recent, clock)
        if schedule is not None:
            sched.token_budget = schedule(clock)
        batch = sched.schedule()
        held[sched.token_budget] += 1
        shape = step_shape(batch)
        ms = times.ms(shape)
        sched.computed(batch)
        clock += ms / 1e3
        if adaptive is not None:
            adaptive.timed(shape, ms, clock)
        for seq in batch.seqs:
            if seq.num_pending == 0:   # its next token is chosen
                served += token_chosen(sched, seq, clock, first, recent)
    return sorted(served, key=lambda s: s.arrival), held


def token_chosen(sched: Scheduler, seq: Sequence, clock: float, first: dict, recent: Recent) -> list[Served]:
    """seq's next token at clock: its first is its TTFT; its last ends it."""
    seq.token_ids.append(0)
    arrival = seq.request.metrics.arrival_time
    first.setdefault(seq, clock)
    if seq.num_outputs < seq.request.params.max_tokens:
        return []
    sched.finish(seq)
    recent.ended(seq.num_outputs, seq.request.params.max_tokens)
    return [Served(arrival, first.pop(seq) - arrival, clock - arrival, seq.num_outputs)]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summary(served: list[Served], slo: tuple[float, float] | None = None) -> dict[str, float]:
    """E2E, TTFT (s) and TPOT (ms) p50 and p99; under an SLO (ttft s, tpot s) also the share
    of requests within both (bench.py's SLO attainment)."""
    e2e, ttft = [s.e2e for s in served], [s.ttft for s in served]
    tpot = [(s.e2e - s.ttft) / (s.output_len - 1) * 1e3 for s in served if s.output_len > 1]
    out = {"e2e_p50": statistics.median(e2e), "e2e_p99": percentile(e2e, 0.99),
           "ttft_p50": statistics.median(ttft), "ttft_p99": percentile(ttft, 0.99),
           "tpot_p50": statistics.median(tpot), "tpot_p99": percentile(tpot, 0.99)}
    if slo is not None:
        out["slo"] = sum(s.ttft <= slo[0] and (s.e2e - s.ttft) / max(1, s.output_len - 1) <= slo[1]
                         for s in served) / len(served)
    return out


def menu_budgets(seats: int, max_num_batched_tokens: int) -> list[int]:
    """The whole GPU's token budgets of the controller's menu (controller.py:menu, no splits)."""
    return [c.token_budget for c in menu(max_num_batched_tokens, seats, [])]


def compare(specs: list, times: StepTimes, profiled: HardwareParams, seats: int, max_num_batched_tokens: int,
            slo: tuple[float, float] | None = None) -> tuple[dict[str, dict[str, float]], Counter]:
    """Every fixed budget of the controller's menu, then the controller (under the SLO, if
    one: its objective then): their summaries, and the steps the controller ran at each budget."""
    out = {f"budget {b}": summary(serve(specs, times, seats, max_num_batched_tokens, token_budget=b)[0], slo)
           for b in menu_budgets(seats, max_num_batched_tokens)}
    controller = Controller(profiled, max_num_batched_tokens, slo=slo)
    served, held = serve(specs, times, seats, max_num_batched_tokens, controller=controller)
    out["controller"] = summary(served, slo)
    return out, held


def phase_oracle(specs: list, times: StepTimes, seats: int, max_num_batched_tokens: int, phases: int,
                 phase_s: float, rows: dict[str, dict[str, float]]
                 ) -> tuple[tuple[int, ...], dict[str, float]]:
    """What a budget chosen per phase gains on a phased load, knowing the phases to come
    (which no controller does): every assignment of a budget of the menu to each phase, the
    budget changing when the clock enters the phase; the one with the lowest E2E p50 and its
    summary. An assignment of one budget to every phase is that budget held fixed: its
    summary is compare's (rows), not served again."""
    results = {}
    for budgets in itertools.product(menu_budgets(seats, max_num_batched_tokens), repeat=phases):
        if len(set(budgets)) == 1:
            results[budgets] = rows[f"budget {budgets[0]}"]
            continue

        def schedule(clock: float, budgets: tuple[int, ...] = budgets) -> int:
            return budgets[int(clock // phase_s) % phases]
        results[budgets] = summary(serve(specs, times, seats, max_num_batched_tokens, schedule=schedule)[0])
    best = min(results, key=lambda b: results[b]["e2e_p50"])
    return best, results[best]


def add_flags(p: argparse.ArgumentParser, workloads: list[str]) -> None:
    """`bench.py simulate`'s flags; workloads: bench.py's, to choose from."""
    p.add_argument("results", type=Path, help="a results.json (or .json.gz) of a run with adaptive in it")
    p.add_argument("--workload", nargs="+", default=["phased"], choices=workloads,
                   help="as bench.py's (default: phased)")
    p.add_argument("--rate", nargs="+", type=float, default=[20.0], help="req/s (default: 20)")
    p.add_argument("--duration", type=float, default=12.0, help="seconds of arrivals (default: 12)")
    p.add_argument("--phases", nargs="+", default=None, metavar="WORKLOAD:FACTOR",
                   help="the phased workload's phases, as bench.py's")
    p.add_argument("--phase-s", type=float, default=3.0, help="seconds per phase (default: 3)")
    p.add_argument("--seed", type=int, default=0, help="the requests' seed, as bench.py's (default: 0)")
    p.add_argument("--seats", type=int, default=256, help="max_num_seqs (default: 256)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="(default: 8192)")
    p.add_argument("--ttft-slo", type=float, default=None, help="s: with --tpot-slo (either), each "
                   "configuration's share within the SLO, the controller's objective, and goodput over "
                   "the rates (default: none)")
    p.add_argument("--tpot-slo", type=float, default=None, help="s a decode step (default: none)")
    p.add_argument("--phase-oracle", action="store_true",
                   help="phased: also every assignment of a budget to each phase, the best of them "
                   "(what a budget chosen per phase gains, knowing the phases to come)")


def main(args: argparse.Namespace) -> None:
    slos = [(flag, value) for flag, value in (("--ttft-slo", args.ttft_slo), ("--tpot-slo", args.tpot_slo))
            if value is not None]
    for flag, value in (("--rate", min(args.rate)), ("--duration", args.duration),
                        ("--phase-s", args.phase_s), *slos):
        if not (math.isfinite(value) and value > 0):
            raise SystemExit(f"error: {flag} must be above 0 and finite, got {value:g}")
    if args.phase_oracle and "phased" not in args.workload:
        raise SystemExit("error: --phase-oracle assigns a budget to each phase: it needs --workload phased")
    if not 1 <= args.seats <= args.max_num_batched_tokens:
        raise SystemExit(f"error: --seats must be at least 1 and at most --max-num-batched-tokens, got "
                         f"{args.seats} and {args.max_num_batched_tokens}")
    try:
        data = read_results(args.results)
        profiled = HardwareParams(**data["router_calibration"]["profiled"])
        steps = [s for run in data.get("steps") or [] for s in run["steps"]]
        times = StepTimes.fit(steps, profiled.batch_thresh)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"error: {args.results}: {e} (it needs the steps and the profile an adaptive "
                         "run keeps)") from None
    print(f"step times fitted on {args.results}'s whole-GPU steps of {times.batches[0]}-{times.batches[1]} "
          "decodes: ms = " + " + ".join(
        f"{t:.4g} {name}" for t, name in zip(times.theta, ("(no prompt)", "(prompt)", "excess decodes",
                                                            "context", "prompt tokens"))))
    slo = None if args.ttft_slo is None and args.tpot_slo is None else \
        (args.ttft_slo or math.inf, args.tpot_slo or math.inf)
    for workload in args.workload:
        met: dict[str, list[tuple[float, float]]] = {}   # configuration -> (rate, SLO share) of each run
        for rate in args.rate:
            specs = args.make_requests(workload, rate, args)
            print(f"\n{workload} @ {rate:g} req/s, {len(specs)} requests (simulated):")
            rows, held = compare(specs, times, profiled, args.seats, args.max_num_batched_tokens, slo)
            fixed = print_load(rows, held)
            for name, r in rows.items():
                met.setdefault(name, []).append((rate, r.get("slo", 0.0)))
            if args.phase_oracle and workload == "phased":
                budgets, r = phase_oracle(specs, times, args.seats, args.max_num_batched_tokens,
                                          len(args.phases_of(args)), args.phase_s, rows)
                print(f"  the phase oracle (a budget per phase, knowing the phases to come): "
                      f"{' then '.join(map(str, budgets))}, E2E p50 / p99 {r['e2e_p50']:.2f} / "
                      f"{r['e2e_p99']:.2f} s; over the best fixed budget: E2E p50 "
                      + "{:.3f}, p99 {:.3f}".format(*(r[k] / fixed[k] for k in ("e2e_p50", "e2e_p99"))))
        if slo is not None:
            print_goodput(workload, met)


def print_goodput(workload: str, met: dict[str, list[tuple[float, float]]]) -> None:
    """Each configuration's goodput over the rates run: the highest with GOODPUT_SHARE of its
    requests within the SLO (bench.py's), and the controller's over the best fixed budget's."""
    goodput = {name: max([rate for rate, share in runs if share >= GOODPUT_SHARE], default=0.0)
               for name, runs in met.items()}
    best = max(g for name, g in goodput.items() if name != "controller")
    ratio = f"; the controller over the best fixed budget: {goodput['controller'] / best:.2f}x" \
        if best else ""
    print(f"\n{workload}: goodput (the highest rate with {GOODPUT_SHARE:.0%} of its requests within the "
          "SLO): " + ", ".join(f"{name} {g:g}" for name, g in goodput.items()) + ratio)


def print_load(rows: dict[str, dict[str, float]], held: Counter) -> dict[str, float]:
    """One load's lines: each configuration (its SLO share, under an SLO), the controller over
    the best fixed budget, the controller's steps by budget. The best fixed budget's E2E p50
    and p99 (each its own best)."""
    for name, r in rows.items():
        print(f"  {name:>12}: E2E p50 / p99 {r['e2e_p50']:.2f} / {r['e2e_p99']:.2f} s, TTFT "
              f"{r['ttft_p50']:.3f} / {r['ttft_p99']:.3f} s, TPOT {r['tpot_p50']:.1f} / "
              f"{r['tpot_p99']:.1f} ms" + (f", SLO met {r['slo']:.0%}" if "slo" in r else ""))
    best = {k: min(r[k] for name, r in rows.items() if name != "controller") for k in ("e2e_p50", "e2e_p99")}
    print("  controller / the best fixed budget: E2E p50 {:.3f}, p99 {:.3f}".format(
        *(rows["controller"][k] / best[k] for k in ("e2e_p50", "e2e_p99"))))
    steps = sum(held.values())
    print("  the controller's steps by budget: " + ", ".join(
        f"{b} {n / steps:.0%}" for b, n in sorted(held.items())))
    return best
