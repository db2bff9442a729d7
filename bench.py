"""nanoPD's serving benchmark: the three policies on the same devices, under the same
generated workload, compared by latency, throughput and goodput.

  python bench.py --policy adaptive                  Poisson arrivals at one rate
  python bench.py --policy all --mode sweep          every policy over a list of rates
  python bench.py --policy collocated --mode static  one batch, all requests at once
  python bench.py --workload short long ...          several workloads, one start-up per policy
  python bench.py kernels | engine | profile | transfer    the micro-benchmarks (microbench.py)

With GPUs it serves the qwen3-8b preset (random weights) on every visible GPU; without, the
tiny preset on two CPU worker processes (about two minutes). Requests ignore EOS, so a
random-weight model generates each request's intended length. Writes, under --out: a
results table (printed too), results.json with every request's timings, and PNG plots.
"""

import argparse
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

# ----------------------------------------------------------------------------- workloads


def lognormal_int(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return int(min(high, max(low, round(rng.lognormvariate(math.log(median), sigma)))))


# prompt and output lengths of one request; CPU runs divide them by 8 (the tiny model)
WORKLOADS = {
    "short": lambda rng: (rng.randint(64, 256), rng.randint(32, 256)),
    "long": lambda rng: (rng.randint(1024, 2048), rng.randint(32, 256)),
    "mixed": lambda rng: WORKLOADS["short" if rng.random() < 0.5 else "long"](rng),
    # ShareGPT-like: log-normal prompt (median 256) and output (median 192) lengths.
    "sharegpt": lambda rng: (lognormal_int(rng, 256, 1.0, 8, 2048), lognormal_int(rng, 192, 0.8, 8, 1024)),
    # 128 in, 128 out: the shape of vLLM's and the engine benchmark's throughput figure.
    "fixed": lambda rng: (128, 128),
    "phased": None,   # PHASES in turn, PHASE_S each (make_requests)
}
# The phased workload: long prompts at the given rate, then ShareGPT-like requests at three
# times it (shorter, so the same GPUs serve more of them), and so on; the mix moves under
# the policies, as a day's traffic does.
PHASES = (("long", 1.0), ("sharegpt", 3.0))
PHASE_S = 10.0


@dataclass
class Spec:
    """One request of a run: when it arrives (s after the start), its lengths, and the mix
    that drew it (the workload, or the phase of the phased one)."""
    arrival: float
    prompt_ids: list[int]
    max_tokens: int
    phase: str = ""


def make_requests(workload: str, rate: float, duration: float, count: int, seed: int, vocab: int,
                  scale: float) -> list[Spec]:
    """Poisson arrivals at rate per second for duration seconds (rate 0: `count` at once).
    The phased workload draws from PHASES in turn, PHASE_S seconds each, at its rates."""
    rng, t, specs = random.Random(seed), 0.0, []
    while (rate > 0 and t < duration) or (rate <= 0 and len(specs) < count):
        mix, factor = PHASES[int(t // PHASE_S) % len(PHASES)] if workload == "phased" else (workload, 1.0)
        prompt_len, out_len = WORKLOADS[mix](rng)
        prompt_len, out_len = max(4, int(prompt_len * scale)), max(2, int(out_len * scale))
        specs.append(Spec(t if rate > 0 else 0.0, [rng.randrange(vocab) for _ in range(prompt_len)], out_len, mix))
        t += rng.expovariate(rate * factor) if rate > 0 else 0.0
    return specs


# ----------------------------------------------------------------------------- one run


@dataclass
class Result:
    """One request's timings (s) and path."""
    policy: str
    workload: str
    rate: float
    prompt_len: int
    output_len: int
    ttft: float
    tpot: float
    e2e: float
    path: list[int]
    error: str | None = None
    routed: dict = field(default_factory=dict)   # adaptive: the load it was routed under
    phase: str = ""                              # the mix that drew it (phased: the phase)
    arrival: float = 0.0                         # s after the run's start
    lag: float = 0.0                             # s from its arrival to its submit: the client fell behind


def serve(llm, policy: str, workload: str, rate: float, specs: list[Spec], desc: str) -> tuple[list[Result], float]:
    """Submit specs at their arrival times, wait for all; the results and the run's length.
    Latencies count from a request's arrival time, not from when this loop got to submit
    it: a user's request waits from when it is sent, and a loop that falls behind (its
    polls take longer than the gaps between arrivals) must not hide that wait. Each
    request's lag says how far behind the loop was."""
    from nanopd import SamplingParams
    cluster, pending, results = llm.cluster, {}, []
    start, i = time.perf_counter(), 0
    with tqdm(total=len(specs), desc=desc, leave=False, disable=None) as bar:   # only on a terminal
        while i < len(specs) or pending:
            now = time.perf_counter() - start
            while i < len(specs) and specs[i].arrival <= now:
                rid = cluster.submit(specs[i].prompt_ids, SamplingParams(max_tokens=specs[i].max_tokens,
                                                                         ignore_eos=True))
                pending[rid] = specs[i]
                i += 1
            for rid in cluster.poll(0.002):
                spec, out = pending.pop(rid), cluster.output(rid)
                m, n = out.metrics, len(out.outputs[0].token_ids) if out.outputs else 0
                sent = start + spec.arrival   # perf_counter's clock, as the metrics' times
                routed = {}
                if m.routed is not None:
                    predicted_ms, load, _ = m.routed
                    routed = {"predicted_ms": predicted_ms, "decode_batch": load.decode_batch,
                              "queued_prefill": load.queued_prefill_tokens}
                results.append(Result(
                    policy, workload, rate, len(spec.prompt_ids), n,
                    ttft=(m.first_token_time or m.finish_time) - sent,
                    tpot=(m.finish_time - m.first_token_time) / max(1, n - 1) if m.first_token_time else 0.0,
                    e2e=m.finish_time - sent, path=list(m.path),
                    error=None if out.error is None else str(out.error), routed=routed, phase=spec.phase,
                    arrival=spec.arrival, lag=max(0.0, m.arrival_time - sent)))
                bar.update()
    return results, time.perf_counter() - start


def six_digits(x):
    """x (nested dicts and lists) with every float rounded to six significant digits."""
    if isinstance(x, float):
        return float(f"{x:.6g}")
    if isinstance(x, dict):
        return {k: six_digits(v) for k, v in x.items()}
    if isinstance(x, list):
        return [six_digits(v) for v in x]
    return x


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] if xs else float("nan")


def summarize(results: list[Result], seconds: float, ttft_slo: float, tpot_slo: float) -> dict:
    ok = [r for r in results if r.error is None]
    row = {"requests": len(results), "failed": len(results) - len(ok),
           "output_tok_s": sum(r.output_len for r in ok) / seconds,
           "slo_attainment": sum(r.ttft <= ttft_slo and r.tpot <= tpot_slo for r in ok) / max(1, len(results)),
           "disaggregated_share": sum(len(r.path) == 2 for r in ok) / max(1, len(ok))}
    for name in ("ttft", "tpot", "e2e"):
        for q in (50, 90, 99):
            row[f"{name}_p{q}"] = percentile([getattr(r, name) for r in ok], q)
    row["lag_max"] = max((r.lag for r in results), default=0.0)
    return row


# ----------------------------------------------------------------------------- report


def label(policy: str, workload: str, rows: list[dict]) -> str:
    """A series' name in the plots: the policy, and the workload when a run has several."""
    several = len({r["workload"] for r in rows}) > 1
    return f"{policy} {workload}" if several else policy


def print_table(rows: list[dict]) -> None:
    print("\n| policy | workload | rate (req/s) | requests | output tok/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) "
          "| E2E p50 / p99 (s) | SLO met | disaggregated |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        rate = "static" if r["rate"] <= 0 else f"{r['rate']:g}"
        print(f"| {r['policy']} | {r['workload']} | {rate} | {r['requests']} | {r['output_tok_s']:.0f} "
              f"| {r['ttft_p50']:.3f} / {r['ttft_p99']:.3f} | {r['tpot_p50'] * 1e3:.1f} / {r['tpot_p99'] * 1e3:.1f} "
              f"| {r['e2e_p50']:.2f} / {r['e2e_p99']:.2f} | {r['slo_attainment']:.0%} "
              f"| {r['disaggregated_share']:.0%} |")


def plot(rows: list[dict], results: list[Result], goodput: dict, timelines: list[dict], out: Path) -> list[str]:
    """The PNGs a reader would rather look at than read; their file names."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figures = {}
    if len({r["rate"] for r in rows}) > 1:
        figures["latency_throughput_vs_rate.png"] = plot_vs_rate(plt, rows)
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.bar(list(goodput), [goodput[p] for p in goodput])
        ax.set(ylabel="goodput (requests/s)", title="highest rate with >= 90% inside the SLO")
        figures["goodput.png"] = fig
    figures["latency_cdf.png"] = plot_cdf(plt, rows, results)
    routed = [r for r in results if r.routed]
    if routed:
        fig, ax = plt.subplots(figsize=(6, 4))
        for two, path in ((False, "collocated"), (True, "disaggregated")):
            pts = [r for r in routed if (len(r.path) == 2) == two]
            ax.scatter([r.routed["decode_batch"] for r in pts], [r.prompt_len for r in pts], s=10, label=path)
        ax.set(xlabel="sequences decoding on the prefill worker when routed", ylabel="prompt tokens",
               title="the adaptive router's choices over load")
        ax.legend()
        figures["router_choices.png"] = fig
    if timelines:
        figures["roles_over_time.png"] = plot_roles(plt, timelines)
    for name, fig in figures.items():
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
    return list(figures)


def plot_vs_rate(plt, rows: list[dict]):
    """E2E p50 and p99, and output throughput, against the arrival rate, per series."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, p in enumerate(sorted({r["label"] for r in rows})):   # one colour per series in every panel
        mine = sorted((r for r in rows if r["label"] == p), key=lambda r: r["rate"])
        for key, style in (("e2e_p50", "-o"), ("e2e_p99", "--o")):
            axes[0].plot([r["rate"] for r in mine], [r[key] for r in mine], style, color=f"C{i}",
                         label=f"{p} {key[4:]}")
        axes[1].plot([r["rate"] for r in mine], [r["output_tok_s"] for r in mine], "-o", color=f"C{i}", label=p)
    axes[0].set(xlabel="arrival rate (requests/s)", ylabel="end-to-end latency (s)", yscale="log",
                title="latency percentiles vs rate")
    axes[1].set(xlabel="arrival rate (requests/s)", ylabel="output tokens/s", title="throughput vs rate")
    for ax in axes:
        ax.legend(fontsize=8)
    return fig


def plot_roles(plt, timelines: list[dict]):
    """Each worker's role in the adaptive policy's regime over each run (one panel a run);
    the phased workload's phases shaded behind."""
    colors = {"both": "C0", "prefill": "C1", "decode": "C2"}
    fig, axes = plt.subplots(len(timelines), 1, figsize=(9, 1.2 + 1.1 * len(timelines)), squeeze=False)
    for ax, tl in zip(axes[:, 0], timelines):
        if tl["workload"] == "phased":
            for k in range(int(tl["seconds"] // PHASE_S) + 1):
                if k % 2:
                    ax.axvspan(k * PHASE_S, (k + 1) * PHASE_S, color="0.92")
                ax.text((k + 0.5) * PHASE_S, 1.02, PHASES[k % len(PHASES)][0], transform=ax.get_xaxis_transform(),
                        ha="center", fontsize=7)
        ends = [c["time"] for c in tl["changes"][1:]] + [tl["seconds"]]
        for change, end in zip(tl["changes"], ends):
            for w, role in change["roles"].items():
                ax.barh(int(w), end - change["time"], left=change["time"], color=colors[role], height=0.6)
        ax.set(xlim=(0, tl["seconds"]), ylabel="worker", title=f"{tl['workload']} @ {tl['rate']:g} req/s")
        ax.set_yticks(sorted({int(w) for c in tl["changes"] for w in c["roles"]}))
    axes[-1, 0].set(xlabel="seconds into the run")
    axes[0, 0].legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c, label=r) for r, c in colors.items()],
                      fontsize=8, loc="upper right")
    return fig


def plot_cdf(plt, rows: list[dict], results: list[Result]):
    """The E2E latency CDF of every series at the highest rate: colour the policy, line
    style the workload."""
    import matplotlib.ticker
    fig, ax = plt.subplots(figsize=(6, 4))
    top = max(r["rate"] for r in rows)
    names = list(dict.fromkeys(r["policy"] for r in rows))
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    for r in rows:
        if r["rate"] != top:
            continue
        e2e = sorted(x.e2e for x in results if (x.policy, x.workload, x.rate) == (r["policy"], r["workload"], top)
                     and x.error is None)
        ax.plot(e2e, [(i + 1) / len(e2e) for i in range(len(e2e))], label=r["label"],
                color=f"C{names.index(r['policy'])}", linestyle=["-", "--", ":", "-."][workloads.index(r["workload"]) % 4])
    ax.set(xlabel="end-to-end latency (s)", ylabel="fraction of requests", xscale="log",
           title=f"latency CDF at {'static' if top <= 0 else f'{top:g} req/s'}")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.legend(fontsize=8)
    return fig


# ----------------------------------------------------------------------------- main


@dataclass
class Run:
    """What one invocation measures, with the defaults filled in for GPUs or CPUs."""
    mode: str                   # static, poisson or sweep
    policies: list[str]
    workloads: list[str]
    rates: list[float]          # 0: static (all requests at once)
    duration: float
    count: int
    model: str
    devices: list[str]
    scale: float                # lengths are multiplied by it (CPU runs: 1/8, the tiny model)
    ttft_slo: float
    tpot_slo: float
    engine: dict                # engine settings, the same for every policy
    seed: int
    out: Path
    slo: tuple[float, float] | None = None   # given explicitly: the adaptive router routes for it
    join: str | None = None     # HOST:PORT for workers on other hosts (hosts.py), instead of devices
    transport: str = "p2p"      # how KV moves (transport.py); distributed with join


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default="adaptive", choices=["collocated", "disaggregated", "adaptive", "all"])
    p.add_argument("--mode", default="poisson", choices=["static", "poisson", "sweep"])
    p.add_argument("--workload", nargs="+", default=["sharegpt"], choices=list(WORKLOADS))
    p.add_argument("--rate", type=float, default=None, help="requests/s (poisson); default 8 on GPUs, 4 on CPUs")
    p.add_argument("--rates", type=float, nargs="+", default=None, help="the sweep's rates")
    p.add_argument("--duration", type=float, default=None, help="seconds of arrivals; default 60 on GPUs, 15 on CPUs")
    p.add_argument("--num-requests", type=int, default=None, help="static mode; default 512 on GPUs, 64 on CPUs")
    p.add_argument("--model", default=None, help="default: qwen3-8b on GPUs, tiny on CPUs")
    p.add_argument("--devices", nargs="+", default=None, help="default: every GPU, or two CPU workers")
    p.add_argument("--join", default=None, help="HOST:PORT to listen at for workers torchrun starts on other "
                   "hosts (hosts.py), instead of --devices")
    p.add_argument("--transport", default=None, choices=["p2p", "relay", "distributed"],
                   help="how KV moves between workers; default p2p, or distributed with --join")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft-slo", type=float, default=None, help="seconds; default 2.0 on GPUs, 0.5 on CPUs. "
                   "Given (or --tpot-slo), the adaptive policy routes for goodput under it")
    p.add_argument("--tpot-slo", type=float, default=None, help="seconds; default 0.1 on GPUs, 0.05 on CPUs")
    p.add_argument("--max-num-seqs", type=int, default=256, help="seats per worker (every policy)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per step; "
                   "default 8192 on GPUs, 256 on CPUs")
    p.add_argument("--out", default="runs/bench", help="folder for results.json and the plots (runs/ is not "
                   "tracked; results/ holds the measurements the docs quote)")
    return p.parse_args(argv)


def make_run(args: argparse.Namespace) -> Run:
    """The run the flags ask for; SystemExit with one line if they ask for none."""
    from cluster import default_devices
    devices = None if args.join else args.devices or default_devices()
    gpu = devices[0].startswith("cuda") if devices else torch.cuda.is_available()   # --join: as here
    if args.mode == "sweep":
        rates = args.rates or ([2, 4, 8, 16, 32] if gpu else [2, 4, 8])
    elif args.mode == "static":
        rates = [0.0]
    else:
        rates = [default(args.rate, 8.0 if gpu else 4.0)]
    run = Run(mode=args.mode, policies=["collocated", "disaggregated", "adaptive"] if args.policy == "all" else [args.policy],
              workloads=args.workload, rates=rates,
              duration=default(args.duration, 60.0 if gpu else 15.0), count=default(args.num_requests, 512 if gpu else 64),
              model=args.model or ("qwen3-8b" if gpu else "tiny"), devices=devices, scale=1.0 if gpu else 1 / 8,
              ttft_slo=default(args.ttft_slo, 2.0 if gpu else 0.5), tpot_slo=default(args.tpot_slo, 0.1 if gpu else 0.05),
              engine={"max_num_seqs": args.max_num_seqs, "max_model_len": 4096,
                      "max_num_batched_tokens": default(args.max_num_batched_tokens, 8192 if gpu else 256)},
              seed=args.seed, out=Path(args.out), join=args.join,
              transport=args.transport or ("distributed" if args.join else "p2p"),
              slo=None if args.ttft_slo is None and args.tpot_slo is None else
              (default(args.ttft_slo, 2.0 if gpu else 0.5), default(args.tpot_slo, 0.1 if gpu else 0.05)))
    check_run(run)
    return run


def default(value, fallback):
    """A flag's value, or its default when it was not given (0 is a value, not a default)."""
    return fallback if value is None else value


MAX_REQUESTS = 1_000_000   # per workload and rate: past it a run would take hours and its memory


def check_run(run: Run) -> None:
    """SystemExit with one line naming the flag, for a run that could not run or never end."""
    for flag, values in (("--rate/--rates", run.rates if run.mode != "static" else []), ("--duration", [run.duration]),
                         ("--ttft-slo", [run.ttft_slo]), ("--tpot-slo", [run.tpot_slo])):
        bad = [v for v in values if not (math.isfinite(v) and v > 0)]
        if bad:
            raise SystemExit(f"error: {flag} must be above 0 and finite, got {bad[0]:g}")
    if run.count < 1:
        raise SystemExit(f"error: --num-requests must be at least 1, got {run.count}")
    if max(run.rates) * run.duration > MAX_REQUESTS or run.count > MAX_REQUESTS:
        raise SystemExit(f"error: --rate x --duration (or --num-requests) asks for more than {MAX_REQUESTS:,} requests")
    try:   # the results must have somewhere to go before any time is spent serving
        run.out.mkdir(parents=True, exist_ok=True)
        (run.out / ".writable").touch()
        (run.out / ".writable").unlink()
    except OSError as e:
        raise SystemExit(f"error: --out {run.out}: {e.strerror or e}") from None


def run_policy(run: Run, policy: str) -> tuple[list[dict], list[Result], dict, list[dict]]:
    """Every workload at every rate under one policy, one start-up: the summary rows (the
    phased workload's also per phase), every request's result, the router's calibration
    and the regimes it went through (adaptive)."""
    from nanopd import LLM
    try:
        llm = LLM(run.model, policy=policy, devices=run.devices, slo=run.slo if policy == "adaptive" else None,
                  join=run.join, transport=run.transport, **run.engine)
    except ValueError as e:   # bad --model, --devices for the policy, ...: say so, no traceback
        raise SystemExit(f"error: {e}") from None
    rows, results, timelines = [], [], []
    with llm:
        vocab = llm.cluster.vocab_size
        # Not counted: a few of the workload's requests and one of the longest prompt any
        # workload draws (2048 tokens), whose steps run kernels shorter ones do not.
        warm = make_requests(run.workloads[0], 0, 0, 8, run.seed + 999, vocab, run.scale)
        rng = random.Random(run.seed + 998)
        warm.append(Spec(0.0, [rng.randrange(vocab) for _ in range(int(2048 * run.scale))], 8))
        serve(llm, policy, "warm-up", 0.0, warm, f"{policy} warm-up")
        for workload in run.workloads:
            for rate in run.rates:
                specs = make_requests(workload, rate, run.duration, run.count, run.seed, vocab, run.scale)
                start = time.perf_counter()
                got, seconds = serve(llm, policy, workload, rate, specs,
                                     f"{policy} {workload} @ {'static' if rate <= 0 else rate}")
                results += got
                rows.append({"policy": policy, "workload": workload, "rate": rate,
                             **summarize(got, seconds, run.ttft_slo, run.tpot_slo)})
                if workload == "phased":   # each phase apart, over its share of the run
                    rows += [{"policy": policy, "workload": f"phased:{name}", "rate": rate,
                              **summarize([r for r in got if r.phase == name], seconds / len(PHASES),
                                          run.ttft_slo, run.tpot_slo)} for name, _ in PHASES]
                if llm.cluster.planner is not None:
                    timelines.append({"policy": policy, "workload": workload, "rate": rate,
                                      **regime_timeline(llm.cluster.planner, start, seconds)})
        return rows, results, calibration(llm.cluster.router), timelines


def regime_timeline(planner, start: float, seconds: float) -> dict:
    """The regime and each worker's role over a run (times in s after its start), and the
    forecasts behind each change."""
    before = [e for e in planner.log if e.time < start]
    changes = [{"time": 0.0, "regime": str(before[-1].regime) if before else f"{len(planner.roles)} both",
                "roles": before[-1].roles if before else dict.fromkeys(planner.roles, "both")}]
    changes += [{"time": e.time - start, "regime": str(e.regime), "roles": e.roles,
                 "forecasts": [{"regime": str(f.regime), "e2e_ms": f.e2e_ms, "load": f.load,
                                "slo_attainment": f.slo_attainment} for f in e.forecasts]}
                for e in planner.log if start <= e.time <= start + seconds]
    return {"seconds": seconds, "changes": changes}


def calibration(router) -> dict:
    """The router's median |predicted - measured| / measured latency, overall and by tenth of the run."""
    if router is None:
        return {}
    errs = router.errors
    return {"median_rel_error": statistics.median(errs) if errs else float("nan"),
            "by_decile": [statistics.median(errs[i * len(errs) // 10:(i + 1) * len(errs) // 10] or [float("nan")])
                          for i in range(10)]}


def report(run: Run, rows: list[dict], results: list[Result], calib: dict, timelines: list[dict]) -> None:
    """The table and goodput on stdout; results.json and the plots under run.out."""
    for r in rows:
        r["label"] = label(r["policy"], r["workload"], rows)
    labels = list(dict.fromkeys(r["label"] for r in rows))
    goodput = {lb: max([r["rate"] for r in rows if r["label"] == lb and r["slo_attainment"] >= 0.9], default=0.0)
               for lb in labels}
    print_table(rows)
    behind = max(r["lag_max"] for r in rows)
    if behind > 0.05:
        print(f"note: the client fell behind its arrivals by up to {behind:.2f} s (latencies count from the arrivals)")
    if len(run.rates) > 1:
        print(f"goodput (req/s, >= 90% within TTFT <= {run.ttft_slo:g} s and TPOT <= {run.tpot_slo * 1e3:g} ms): "
              + ", ".join(f"{p} {g:g}" for p, g in goodput.items()))
    if calib:
        print(f"adaptive router: median |predicted - measured| / measured latency "
              f"{calib['median_rel_error']:.1%} (by decile of the run: "
              f"{', '.join(f'{e:.0%}' for e in calib['by_decile'])})")
    run.out.mkdir(parents=True, exist_ok=True)
    files = plot(rows, results, goodput, timelines, run.out)
    gpu = run.devices[0].startswith("cuda") if run.devices else torch.cuda.is_available()
    meta = {"model": run.model, "devices": run.devices or [f"joined at {run.join}"], "workloads": run.workloads,
            "transport": run.transport, "mode": run.mode, "seed": run.seed, "ttft_slo": run.ttft_slo, "tpot_slo": run.tpot_slo, "length_scale": run.scale,
            "device_name": torch.cuda.get_device_name() if gpu else "cpu"}
    # One line, six significant digits: a sweep holds some 15,000 requests' timings.
    (run.out / "results.json").write_text(json.dumps(six_digits(
        {"meta": meta, "summary": rows, "goodput": goodput, "router_calibration": calib, "regimes": timelines,
         "requests": [r.__dict__ for r in results]}), separators=(",", ":")))
    print(f"wrote {run.out / 'results.json'} and {', '.join(files)}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("kernels", "engine", "profile", "transfer"):
        import microbench
        return microbench.main()
    run = make_run(parse_args())
    rows, results, calib, timelines = [], [], {}, []
    for policy in run.policies:
        got_rows, got, c, t = run_policy(run, policy)
        rows, results, calib, timelines = rows + got_rows, results + got, c or calib, timelines + t
    report(run, rows, results, calib, timelines)


if __name__ == "__main__":
    main()
