"""One device's frontier: the runs `python bench.py --policy all` makes, each named
policy@budget (on one device, adaptive beside the fixed configurations its controller
chooses between), and adaptive against the best fixed one at each workload and rate: the
lines under the table and results.json's "frontier" (docs/benchmark.md).
"""

import math
import statistics


def rate_text(rate: float) -> str:
    """A run's rate as the lines and plots name it."""
    return "static (all at once)" if rate <= 0 else f"{rate:g} req/s"


# `--policy all` on one device: beside adaptive, the fixed configurations its controller
# chooses between: the whole GPU at three step budgets, the controller's menu's 512 and
# 2048 tokens and --max-num-batched-tokens (None), and the fixed SM split
# (disaggregated on one device is a split worker, cluster.py:POLICIES) at the latter. Each
# is named policy@budget. On several devices `all` is the three policies at the one budget.
ONE_DEVICE_ALL = (("collocated", 512), ("collocated", 2048), ("collocated", None),
                  ("disaggregated", None), ("adaptive", None))
FIXED_ORDER = ("collocated", "disaggregated")   # the table's order of the fixed configurations


def run_names(policy: str, devices: list[str] | None, max_num_batched_tokens: int) -> list[str]:
    """The runs --policy asks for, by name (run_config reads a name back): the fixed
    configurations by policy then max_num_batched_tokens (the default one's), adaptive last."""
    if policy != "all":
        return [policy]
    if devices is None or len(devices) > 1:   # several workers (or joined ones): the three policies
        return ["collocated", "disaggregated", "adaptive"]
    configs = {(p, b or max_num_batched_tokens) for p, b in ONE_DEVICE_ALL}
    fixed = sorted((c for c in configs if c[0] in FIXED_ORDER), key=lambda c: (FIXED_ORDER.index(c[0]), c[1]))
    return [f"{p}@{b}" for p, b in fixed] + ["adaptive"]


def run_config(name: str) -> tuple[str, int | None]:
    """A run's policy and its max_num_batched_tokens (None: --max-num-batched-tokens's) from
    its name."""
    policy, _, tokens = name.partition("@")
    return policy, int(tokens) if tokens else None


def frontier(rows: list[dict], slo: bool) -> list[dict]:
    """For each workload and rate served by more than one run: the best fixed configuration
    (every run but adaptive), the one of lowest E2E p50, and adaptive's E2E p50 over its;
    with an SLO given (slo), also the fixed one meeting it most and adaptive's share met
    over its (the same requests at the same times, so the ratio of their goodputs)."""
    def e2e(r: dict) -> float:
        return r["e2e_p50"] if math.isfinite(r["e2e_p50"]) else math.inf   # nothing served: last
    out = []
    for workload, rate in dict.fromkeys((r["workload"], r["rate"]) for r in rows):
        group = [r for r in rows if (r["workload"], r["rate"]) == (workload, rate)]
        fixed = [r for r in group if run_config(r["policy"])[0] != "adaptive"]
        adaptive = next((r for r in group if r["policy"] == "adaptive"), None)
        if not fixed or len(group) < 2:
            continue
        best = min(fixed, key=e2e)
        entry = {"workload": workload, "rate": rate, "best_fixed": best["policy"],
                 "best_fixed_e2e_p50": best["e2e_p50"]}
        if adaptive is not None:
            entry.update(adaptive_e2e_p50=adaptive["e2e_p50"],
                         e2e_p50_ratio=adaptive["e2e_p50"] / best["e2e_p50"])
        if slo:
            met = max(fixed, key=lambda r: r["slo_attainment"])
            entry.update(best_fixed_slo=met["policy"], best_fixed_slo_attainment=met["slo_attainment"])
            if adaptive is not None:
                entry.update(adaptive_slo_attainment=adaptive["slo_attainment"],
                             slo_attainment_ratio=adaptive["slo_attainment"]
                             / max(met["slo_attainment"], 1e-9))
        out.append(entry)
    return out


def phase_switch(front: list[dict], results: list) -> None:
    """To each phased run's frontier entry, what a configuration chosen per phase could do
    (results: bench.py's Result of every request): each phase's requests taken from the
    fixed configuration best for that phase (its own frontier entry), their E2E p50
    together over the best fixed one's. An estimate of the most a change between phases
    gains on this load: each phase's requests met the backlog its run's configuration
    left, not the one the switch would."""
    phases = {(f["workload"].removeprefix("phased:"), f["rate"]): f["best_fixed"] for f in front
              if f["workload"].startswith("phased:")}
    for f in front:
        if f["workload"] != "phased":
            continue
        best = {mix: name for (mix, rate), name in phases.items() if rate == f["rate"]}
        e2e = [r.e2e for r in results if r.error is None and r.workload == "phased" and r.rate == f["rate"]
               and best.get(r.phase) == r.policy]
        if best and e2e:
            p50 = statistics.median_high(e2e)   # the nearest rank, as bench.py:percentile's p50
            f.update(phase_best=best, phase_switch_e2e_p50=p50,
                     phase_switch_ratio=p50 / f["best_fixed_e2e_p50"])


def print_frontier(front: list[dict]) -> None:
    """adaptive beside the best fixed configuration, a line per workload and rate, and on a
    phased load the estimate of a configuration per phase (phase_switch)."""
    for f in front:
        if "phase_switch_ratio" in f:
            best = ", ".join(f"{mix} {name}" for mix, name in f["phase_best"].items())
            print(f"each phase on its best fixed ({best}), {f['workload']} at {rate_text(f['rate'])}: "
                  f"E2E p50 {f['phase_switch_e2e_p50']:.2f} s, {f['phase_switch_ratio']:.2f}x the best "
                  "fixed: about the most a change between phases gains here")
        if "e2e_p50_ratio" not in f:
            continue
        line = (f"adaptive vs the best fixed ({f['best_fixed']}), {f['workload']} at {rate_text(f['rate'])}: "
                f"E2E p50 {f['adaptive_e2e_p50']:.2f} s vs {f['best_fixed_e2e_p50']:.2f} s, "
                f"{f['e2e_p50_ratio']:.2f}x")
        if "slo_attainment_ratio" in f:
            line += (f"; SLO met {f['adaptive_slo_attainment']:.0%} vs "
                     f"{f['best_fixed_slo_attainment']:.0%} ({f['best_fixed_slo']}), goodput "
                     f"{f['slo_attainment_ratio']:.2f}x")
        print(line)

