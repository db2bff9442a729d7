"""`python bench.py calibrate RUN/results.json`: the cost model (costmodel.py) replayed on a
run's adaptive requests, nothing measured. Each request is predicted again from the load it
was routed under (as results.json keeps it), its true output length and the run's
parameters, once as profiled at its start and once as refitted by its end; the online
router refitted as it went, so neither set is the one it predicted with, and the two
bracket it. A third set is the profile refitted again by this code's router on the run's
recorded steps (router.py:Router.observe_step; the prefill and transfer rates as
profiled): a change to how steps are refitted is weighed on a recorded run too. The
load's prefill rate is capped by the prompt tokens that arrived over the
last telemetry.py:ARRIVAL_WINDOW_S, as the central scheduler does (a no-op on a run
recorded with the cap). Printed per run (policy adaptive, one workload and rate): the
median |predicted - measured| / measured latency, overall and by tenth of the run in order
of arrival, and the time to the first token and the rest of each request apart, predicted
over measured, by tenth. Then the profile's whole-GPU step model against the steps every
policy's worker timed, by decode batch and by prompt tokens (step_ratios): its shape, apart
from its level. A change to the cost model is then weighed on recorded GPU runs, on any
machine, before a GPU measures it again. A run of bench.py records what this reads,
results.json's router_calibration, at its end (calibration, here) and prints it under its
table.
"""

import argparse
import gzip
import json
import statistics
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from nanopd.costmodel import CostModel, HardwareParams, WorkerLoad, split_key
from nanopd.router import Router
from nanopd.telemetry import ARRIVAL_WINDOW_S, Window

TENTHS = 10


def calibration(router, profiled: dict | None = None) -> dict:
    """The router's median |predicted - measured| / measured latency, overall, by tenth of
    the run and apart for the requests whose worker kept its SM split and those whose split
    the planner changed while they ran (their prediction was for the split they were
    routed to); the same for the cost model alone (predicted with each request's true output
    length, where the router had to guess it); its parameters as profiled and as refitted
    by the end (what an error comes from)."""
    if router is None:
        return {}
    errs = list(router.errors)

    def median(xs: list[float]) -> float:
        return statistics.median(xs) if xs else float("nan")
    return {"median_rel_error": median(errs), "cost_model_median_rel_error": median(router.model_errors),
            **{name: {"requests": router.split_changed.count(changed),
                      "median_rel_error": median([e for e, c in zip(errs, router.split_changed)
                                                  if c == changed])}
               for name, changed in (("split_kept", False), ("split_changed", True))},
            "by_decile": by_tenth(errs),
            "profiled": profiled, "refitted": asdict(router.cost.p)}


def print_calibration(calib: dict) -> None:
    """calibration's numbers, the lines under bench.py's table (none without an adaptive run)."""
    if not calib:
        return
    print(f"adaptive router: median |predicted - measured| / measured latency "
          f"{calib['median_rel_error']:.1%} (by decile of the run: "
          f"{', '.join(f'{e:.0%}' for e in calib['by_decile'])}); with the true output lengths "
          f"{calib['cost_model_median_rel_error']:.1%}")
    kept, changed = calib["split_kept"], calib["split_changed"]
    if changed["requests"]:
        print(f"  {kept['median_rel_error']:.1%} over the {kept['requests']} requests whose worker "
              f"kept its SM split, {changed['median_rel_error']:.1%} over the {changed['requests']} "
              "whose split changed")


@dataclass
class Replayed:
    """One request predicted again: its latency over the measured one, and its parts'."""
    arrival: float
    ratio: float         # predicted / measured E2E
    ttft_ratio: float    # predicted / measured time to the first token
    rest_ratio: float    # predicted / measured time from it to the last


def read_results(path: Path) -> dict:
    """A results.json that bench.py wrote, plain or gzipped."""
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data)


def adaptive_runs(data: dict) -> dict[tuple[str, float], list[dict]]:
    """The adaptive policy's routed requests, by (workload, rate), in order of arrival."""
    runs: dict[tuple[str, float], list[dict]] = {}
    for r in data["requests"]:
        if r["policy"] == "adaptive" and r.get("routed"):
            runs.setdefault((r["workload"], r["rate"]), []).append(r)
    return {k: sorted(v, key=lambda r: r["arrival"]) for k, v in runs.items()}


def loads_as_routed(requests: list[dict]) -> list[WorkerLoad]:
    """Each request's load as recorded, its prefill rate capped by the arrivals' (every
    request of the run counts, as every one reached the central scheduler)."""
    keep = {f.name for f in fields(WorkerLoad)}
    arrivals, submitted, loads = Window(ARRIVAL_WINDOW_S, 0.0), 0, []
    for r in requests:
        submitted += r["prompt_len"]
        arrivals.read(r["arrival"], submitted)
        w = WorkerLoad(**{k: v for k, v in r["routed"].items() if k in keep})
        w.sm_split = None if w.sm_split is None else tuple(w.sm_split)
        w.prefill_rate = min(w.prefill_rate, arrivals.rate(r["arrival"], submitted))
        loads.append(w)
    return loads


def replay(requests: list[dict], params: dict) -> list[Replayed]:
    """Every one of a run's requests predicted again on the path it took (collocated: one
    worker; a split worker's on its lanes, where the profile measured them)."""
    whole, out = CostModel(HardwareParams(**params)), []
    for r, w in zip(requests, loads_as_routed(requests)):
        split = w.sm_split is not None and split_key(w.sm_split) in whole.p.splits
        cost = whole.on_split(w.sm_split) if split else whole
        ttft, rest = cost.path_ms(r["prompt_len"], r["output_len"], w, None)
        out.append(Replayed(r["arrival"], (ttft + rest) / 1e3 / r["e2e"], ttft / 1e3 / max(r["ttft"], 1e-6),
                            rest / 1e3 / max(r["e2e"] - r["ttft"], 1e-6)))
    return out


def refit_on_steps(data: dict, profiled: dict) -> dict | None:
    """The profile refitted by the router on the adaptive policy's recorded steps, in their
    order (None if the run kept none): what this code learns from the steps that run timed."""
    steps = [s for run in data.get("steps") or [] if run.get("policy") == "adaptive" for s in run["steps"]]
    if not steps:
        return None
    router = Router(HardwareParams(**profiled))
    for _, _, decodes, context, prompt, ms, split in steps:
        router.observe_step(decodes, context, prompt, ms, None if split is None else tuple(split))
    return asdict(router.cost.p)


DECODE_BINS = (16, 32, 64, 128, 1 << 30)   # decodes in a step, up to each (the decode graphs' sizes)
PROMPT_BINS = (255, 1023, 1 << 30)          # prompt tokens beside the decodes, up to each


def binned(pairs: list[tuple[int, float]], bins: tuple[int, ...]) -> dict[int, tuple[float, int]]:
    """The median of each bin's ratios and its count, by the bin's upper end (empty bins left out)."""
    out = {}
    for top in bins:
        low = max((b for b in bins if b < top), default=0)
        ratios = [r for x, r in pairs if low < x <= top]
        if ratios:
            out[top] = (statistics.median(ratios), len(ratios))
    return out


def step_ratios(data: dict, params: dict) -> dict[str, dict]:
    """Per recorded run of any policy ("policy workload @ rate"), the profile's whole-GPU step
    model (HardwareParams: beta, slope past batch_thresh, kv, gamma) over the whole-GPU steps
    its worker timed: the median ratio of the steps of decodes alone by decode batch
    (DECODE_BINS), and of those with prompt tokens beside them by prompt tokens (PROMPT_BINS).
    Where the ratio moves from bin to bin the model's shape is off, which the router's one
    level factor cannot take back."""
    model = CostModel(HardwareParams(**params))
    out = {}
    for run in data.get("steps") or []:
        decode, mixed = [], []
        for _, _, decodes, context, prompt, ms, split in run["steps"]:
            if split is not None or decodes == 0 or ms <= 0:
                continue
            ratio = model.step_ms(decodes, context, prompt) / ms
            (mixed if prompt else decode).append((prompt or decodes, ratio))
        name = f"{run['policy']} {run['workload']} @ {run.get('rate', 0):g}"
        out[name] = {"decode_by_batch": binned(decode, DECODE_BINS),
                     "mixed_by_prompt": binned(mixed, PROMPT_BINS)}
    return out


def by_tenth(values: list[float]) -> list[float]:
    n = len(values)
    return [statistics.median(values[i * n // TENTHS:(i + 1) * n // TENTHS] or [float("nan")])
            for i in range(TENTHS)]


def summary(replayed: list[Replayed]) -> dict:
    errors = [abs(r.ratio - 1) for r in replayed]
    return {"median_rel_error": statistics.median(errors), "by_tenth": by_tenth(errors),
            "ttft_ratio_by_tenth": by_tenth([r.ttft_ratio for r in replayed]),
            "rest_ratio_by_tenth": by_tenth([r.rest_ratio for r in replayed])}


def calibrate(data: dict) -> dict[str, dict]:
    """Per run ("workload @ rate"): the online router's own median error (its predicted
    lengths, its parameters of the moment), and the replay's summary under each parameter set."""
    calib = data["router_calibration"]
    sets = {name: calib[name] for name in ("profiled", "refitted") if calib.get(name)}
    if "profiled" in sets and (again := refit_on_steps(data, sets["profiled"])) is not None:
        sets["refitted on the steps"] = again
    out = {}
    for (workload, rate), requests in adaptive_runs(data).items():
        online = [abs(r["routed"]["predicted_ms"] / 1e3 / r["e2e"] - 1) for r in requests]
        out[f"{workload} @ {rate:g}"] = {"requests": len(requests), "online_median_rel_error":
                                         statistics.median(online), "online_by_end": by_end(requests, online),
                                         **{name: summary(replay(requests, params))
                                            for name, params in sets.items()}}
    return out


def by_end(requests: list[dict], errors: list[float]) -> dict[str, tuple[float, int]]:
    """The median error (and count) of the requests that ended while requests still arrived
    and of those that ended after the run's last arrival, while its backlog drained: the
    load every prediction is made from goes on as it is, and after the last arrival it does
    not (no more prompts come to share the steps, the batch only shrinks)."""
    last = max(r["arrival"] for r in requests)
    groups: dict[str, list[float]] = {"while arriving": [], "after the last arrival": []}
    for r, e in zip(requests, errors):
        groups["after the last arrival" if r["arrival"] + r["e2e"] > last else "while arriving"].append(e)
    return {name: (statistics.median(v), len(v)) for name, v in groups.items() if v}


def add_flags(p: argparse.ArgumentParser) -> None:
    """`bench.py calibrate`'s argument."""
    p.add_argument("results", type=Path, help="a results.json (or .json.gz) that bench.py wrote")


def main(args: argparse.Namespace) -> None:
    try:
        data = read_results(args.results)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {args.results}: {e}") from None
    if not adaptive_runs(data) or "refitted" not in data.get("router_calibration", {}):
        raise SystemExit(f"error: {args.results} holds no adaptive run with the loads its requests were "
                         "routed under and the router's parameters")
    for run, c in calibrate(data).items():
        print(f"adaptive, {run} req/s, {c['requests']} requests: the online router's median error "
              f"{c['online_median_rel_error']:.1%}; of those that ended "
              + ", ".join(f"{name} {e:.1%} ({n})" for name, (e, n) in c["online_by_end"].items()))
        for name in ("profiled", "refitted", "refitted on the steps"):
            if name in c:
                s = c[name]
                print(f"  replayed, parameters {name}: median error {s['median_rel_error']:.1%}; "
                      f"by tenth of the run {tenths(s['by_tenth'])}")
                print(f"    predicted / measured: TTFT {tenths(s['ttft_ratio_by_tenth'])}; "
                      f"the rest {tenths(s['rest_ratio_by_tenth'])}")
    print_step_ratios(data)


def print_step_ratios(data: dict) -> None:
    profiled = data["router_calibration"].get("profiled")
    if not profiled or not data.get("steps"):
        return
    print("the profile's whole-GPU step model / the steps each run timed, median by decodes in the step "
          "(decodes alone) and by prompt tokens beside them:")
    def show(bins: dict) -> str:
        shown = (f"<={k if k < 1 << 30 else 'more'} {v:.2f} ({n})" for k, (v, n) in bins.items())
        return " ".join(shown) or "none"
    for name, r in step_ratios(data, profiled).items():
        print(f"  {name}: decodes {show(r['decode_by_batch'])}; "
              f"with prompt tokens {show(r['mixed_by_prompt'])}")


def tenths(values: list[float]) -> str:
    return " ".join(f"{x:.2f}" for x in values)
