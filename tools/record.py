"""What a run of bench.py says and keeps beside its table (run: bench.py's Run): the caption
heading the table and the plots, what the run served; the notes under the table, what it
does not say; and results.json, what replot, calibrate and simulate read again.
"""

import json
from pathlib import Path

import torch

from tools.calibrate import print_calibration
from tools.frontier import print_frontier, run_config
from tools.timelines import print_timelines


def caption(run) -> str:
    """What a run served, to head its table and plots, in two lines: policies, workloads
    and arrivals; the model (a preset's weights are random) and the devices."""
    from nanopd.model import PRESETS
    model = f"{run.model} (random weights)" if run.model in PRESETS else Path(run.model).name
    if run.url:
        devices = f"served at {run.url}"
    elif run.join:
        devices = f"workers joined at {run.join}"
    else:
        gpu = run.devices[0].startswith("cuda")
        devices = f"{len(run.devices)} workers on {', '.join(run.devices)}" + (
            f" ({run.device_name or torch.cuda.get_device_name(run.devices[0])})" if gpu else "")
    rates = ", ".join(f"{r:g}" for r in run.rates)
    arrivals = {"static": f"{run.count} requests at once",
                "poisson": f"Poisson arrivals at {rates} req/s for {run.duration:g} s",
                "sweep": f"Poisson arrivals at {rates} req/s, {run.duration:g} s each"}[run.mode]
    if run.concurrency:
        arrivals += f", at most {run.concurrency} in flight"
    return (f"{'policy' if len(run.policies) == 1 else 'policies'} {', '.join(run.policies)} | "
            f"{'workload' if len(run.workloads) == 1 else 'workloads'} {', '.join(run.workloads)}, "
            f"{arrivals}\n"
            f"model {model} | {devices}")


def print_notes(run, rows: list[dict], goodput: dict, calib: dict, timelines: list[dict],
                configs: list[dict], front: list[dict]) -> None:
    """What the table does not say, under it: the fixed split's SMs, adaptive beside the
    best fixed configuration, the client's lag, goodput, the router's calibration, and the
    regimes and configurations adaptive went through."""
    for name, split in dict.fromkeys((r["policy"], tuple(r["sm_split"])) for r in rows if r.get("sm_split")):
        print(f"{name}: one split worker, {split[0]} SMs prefill / {split[1]} decode")
    print_frontier(front)
    started = {r["policy"]: r for r in rows if "start_s" in r}
    if started:
        print("start-up (LLM(): workers, CUDA graphs, adaptive's profile unless cached; then the warm-up): "
              + ", ".join(f"{r['policy']} {r['start_s']:.1f}"
                          + (f" (the profile {r['profile_s']:.1f})" if r.get("profile_s") else "")
                          + f" + {r['warm_up_s']:.1f} s" for r in started.values()))
    behind = max(r["lag_max"] for r in rows)
    if behind > 0.05:
        print(f"note: the client fell behind its arrivals by up to {behind:.2f} s (latencies count from "
              "the arrivals)")
    if len(run.rates) > 1:
        fixed = [g for lb, g in goodput.items() if lb in run.policies and run_config(lb)[0] != "adaptive"]
        ratio = (f"; adaptive / the best fixed {goodput['adaptive'] / max(fixed):.2f}x"
                 if "adaptive" in goodput and fixed and max(fixed) > 0 else "")
        print(f"goodput (req/s, >= 90% within TTFT <= {run.ttft_slo:g} s and TPOT <= "
              f"{run.tpot_slo * 1e3:g} ms): " + ", ".join(f"{p} {g:g}" for p, g in goodput.items()) + ratio)
    print_calibration(calib)
    print_timelines(timelines, configs)


def write_results(run, rows: list[dict], results: list, goodput: dict, front: list[dict], calib: dict,
                  timelines: list[dict], configs: list[dict], steps: list[dict]) -> None:
    """results.json under run.out: the run's settings (meta), its summary rows, goodput, the
    frontier, the router's calibration, the regimes, configurations and steps, and every
    request's result (bench.py's Result). One line, six significant digits: a sweep holds
    some 15,000 requests' timings."""
    gpu = run.devices[0].startswith("cuda") if run.devices else torch.cuda.is_available()
    where = f"served at {run.url}" if run.url else f"joined at {run.join}"
    meta = {"model": run.model, "devices": run.devices or [where],
            "workloads": run.workloads, "transport": run.transport, "mode": run.mode, "seed": run.seed,
            "ttft_slo": run.ttft_slo, "tpot_slo": run.tpot_slo, "slo_given": run.slo is not None,
            "length_scale": run.scale, "duration": run.duration, "num_requests": run.count,
            "max_concurrency": run.concurrency,
            "phases": run.phases, "phase_s": run.phase_s,
            "device_name": torch.cuda.get_device_name() if gpu else "cpu"}
    (run.out / "results.json").write_text(json.dumps(six_digits(
        {"meta": meta, "summary": rows, "goodput": goodput, "frontier": front, "router_calibration": calib,
         "regimes": timelines, "configs": list(configs), "steps": list(steps),
         "requests": [r.__dict__ for r in results]}),
        separators=(",", ":")))


def six_digits(x):
    """x (nested dicts and lists) with every float rounded to six significant digits."""
    if isinstance(x, float):
        return float(f"{x:.6g}")
    if isinstance(x, dict):
        return {k: six_digits(v) for k, v in x.items()}
    if isinstance(x, list):
        return [six_digits(v) for v in x]
    return x
