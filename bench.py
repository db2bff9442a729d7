"""nanoPD's serving benchmark: the three policies on the same devices, under the same
generated workload, compared by latency, throughput and goodput.

  python bench.py --policy adaptive                  Poisson arrivals at one rate
  python bench.py --policy all --mode sweep          every policy over a list of rates
  python bench.py --policy collocated --mode static  one batch, all requests at once
  python bench.py --workload short long ...          several workloads, one start-up per policy
  python bench.py kernels | engine | profile | transfer    the micro-benchmarks (tools/microbench.py)
  python bench.py split     one GPU's SMs split between prefill and decode (tools/splitbench.py)
  python bench.py speculative   speculative decoding against plain decoding (tools/specbench.py)
  python bench.py figures   the docs' figures (tools/figures.py)

With GPUs it serves the qwen3-8b preset on every visible GPU; without, the tiny preset on
two CPU worker processes, where `python bench.py --policy adaptive` takes about 30 s on a
2-core machine with no GPU (docs/benchmark.md). A preset is the model's architecture with
seeded random weights: nothing is downloaded. Requests
decode greedily (temperature 0: the most likely token at every step) and ignore EOS, which
a random-weight model would emit at random, so each generates the length its workload
drew. Writes, under --out: the results table (printed too, headed by the policy,
workload, model and devices), results.json with every request's timings, and PNG plots
(docs/benchmark.md lists them). `bench.py <micro-benchmark> --small` checks one in seconds.
"""

import argparse
import asyncio
import inspect
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from tools import calibrate, client, figures, microbench, plots, record, simulate, specbench, splitbench
from tools.frontier import frontier, phase_switch, print_frontier, run_config, run_names
from tools.timelines import config_timeline, regime_timeline, timed_steps

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
    # Short prompts, long outputs: the GPU mostly decodes (a split has little to gain).
    "decode-heavy": lambda rng: (rng.randint(64, 256), rng.randint(256, 512)),
    # 128 in, 128 out: the shape of vLLM's and the engine benchmark's throughput figure.
    "fixed": lambda rng: (128, 128),
    # Long prompts, short outputs: the GPU mostly prefills (issue 42's long phase).
    "prefill-heavy": lambda rng: (rng.randint(1200, 2400), rng.randint(48, 192)),
    "phased": None,   # its phases in turn (make_requests; --phases, --phase-s)
}


# The phased workload: long prompts at the given rate, then ShareGPT-like requests at three
# times it (shorter, so the same GPUs serve more of them), and so on; the mix moves under
# the policies, as a day's traffic does. Each phase: (its workload, its rate over --rate).
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
                  scale: float, phases: tuple[tuple[str, float], ...] = PHASES,
                  phase_s: float = PHASE_S) -> list[Spec]:
    """Poisson arrivals at rate per second for duration seconds (rate 0: `count` at once).
    The phased workload draws from phases in turn, phase_s seconds each, each at its factor
    times rate. The token ids come from a generator of their own, so that the lengths and
    arrivals a seed draws are the same whatever the vocabulary (bench.py --url's is smaller)."""
    rng, ids, t, specs = random.Random(seed), random.Random(seed + 1), 0.0, []
    while (rate > 0 and t < duration) or (rate <= 0 and len(specs) < count):
        mix, factor = phases[int(t // phase_s) % len(phases)] if workload == "phased" else (workload, 1.0)
        prompt_len, out_len = WORKLOADS[mix](rng)
        prompt_len, out_len = max(4, int(prompt_len * scale)), max(2, int(out_len * scale))
        specs.append(Spec(t if rate > 0 else 0.0, [ids.randrange(vocab) for _ in range(prompt_len)], out_len,
                          mix))
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
    # speculative decoding: drafts checked, kept, in how many steps
    spec: tuple[int, int, int] = (0, 0, 0)

    @classmethod
    def timed(cls, policy: str, workload: str, rate: float, drawn: "Spec", output_len: int, arrived: float,
              first: float | None, end: float, **fields) -> "Result":
        """The result of the request drawn as `drawn` from when it arrived, its first token came
        (None: never) and it ended, on one clock: every latency counts from its arrival."""
        tpot = (end - first) / max(1, output_len - 1) if first else 0.0
        return cls(policy, workload, rate, len(drawn.prompt_ids), output_len, ttft=(first or end) - arrived,
                   tpot=tpot, e2e=end - arrived, phase=drawn.phase, arrival=drawn.arrival, **fields)


def serve(llm, policy: str, workload: str, rate: float, specs: list[Spec], desc: str,
          concurrency: int | None = None) -> tuple[list[Result], float]:
    """Submit specs at their arrival times, at most `concurrency` in flight (None: no cap),
    wait for all; the results and the run's length. Latencies count from a request's
    arrival time, not from when this loop got to submit it: a user's request waits from
    when it is sent, and a loop that falls behind (its polls take longer than the gaps
    between arrivals) must not hide that wait. Each request's lag says how far behind the
    loop was. Under a cap, a request is sent when a seat frees, and counts from then (as
    vLLM's benchmark with --max-concurrency). The LLM's driver runs it (llm.py:Driver: the
    one that runs LLM.generate and the server)."""
    from nanopd import SamplingParams
    driver, pending, results, seats = llm.driver, {}, [], concurrency or len(specs)
    start, i = time.perf_counter(), 0
    with tqdm(total=len(specs), desc=desc, leave=False, disable=None) as bar:   # only on a terminal
        while i < len(specs) or pending:
            now = time.perf_counter() - start
            while i < len(specs) and specs[i].arrival <= now and len(pending) < seats:
                # perf_counter's clock, as the metrics' times
                sent = start + specs[i].arrival if concurrency is None else time.perf_counter()
                rid = driver.submit(specs[i].prompt_ids, SamplingParams(
                    temperature=0.0, max_tokens=specs[i].max_tokens, ignore_eos=True))
                pending[rid] = specs[i], sent
                i += 1
            for update in driver.poll(0.002):   # none watched: each is a request's end
                (spec, sent), out = pending.pop(update.request_id), update.output
                m, n = out.metrics, len(out.outputs[0].token_ids) if out.outputs else 0
                routed = {}
                if m.routed is not None:
                    predicted_ms, load, _ = m.routed
                    # the whole load it was routed under
                    routed = {"predicted_ms": predicted_ms, **asdict(load)}
                results.append(Result.timed(
                    policy, workload, rate, spec, n, sent, m.first_token_time, m.finish_time,
                    path=list(m.path), error=None if out.error is None else str(out.error), routed=routed,
                    lag=max(0.0, m.arrival_time - sent),
                    spec=(m.spec_draft_tokens, m.spec_accepted_tokens, m.spec_steps)))
                bar.update()
    return results, time.perf_counter() - start


HTTP_VOCAB = 256   # over HTTP the prompts are token ids below it: every tokenizer has them


def warm_up(run: "Run", vocab: int) -> list[Spec]:
    """What every run serves first, not counted: a few of the workload's requests and one of
    the longest prompt any workload draws (2048 tokens), whose steps run kernels shorter ones
    do not (a server measured without it compiles them in its first long step)."""
    warm = make_requests(run.workloads[0], 0, 0, 8, run.seed + 999, vocab, run.scale)
    rng = random.Random(run.seed + 998)
    return warm + [Spec(0.0, [rng.randrange(vocab) for _ in range(int(2048 * run.scale))], 8)]


async def serve_over_http(run: "Run", workload: str, rate: float, specs: list[Spec],
                          desc: str) -> tuple[list[Result], float]:
    """serve's twin against an OpenAI-compatible server at run.url, as its client
    (tools/client.py:send): each spec POSTed to /completions at its arrival time as a stream
    (token ids, greedy, ignore_eos, its usage asked for), timed from the client's side. A
    request the server refuses or fails keeps its error. Under run.concurrency, that many
    clients each send the next request when their last one ended, over the connection they
    keep, and each request counts from when it was sent (as serve's); else each request has
    a client and a connection of its own."""
    start, results = time.perf_counter(), []
    with tqdm(total=len(specs), desc=desc, leave=False, disable=None) as bar:
        got = await client.send(run.url, run.api_key, run.model, specs,
                                min(run.concurrency or len(specs), len(specs)), start, bar.update)
    for s in got:
        arrived = start + s.spec.arrival if run.concurrency is None else s.sent
        results.append(Result.timed("server", workload, rate, s.spec, s.tokens, arrived, s.first, s.end,
                                    path=[], error=s.error, lag=max(0.0, s.sent - arrived)))
    return sorted(results, key=lambda r: r.arrival), time.perf_counter() - start


# ----------------------------------------------------------------------------- summaries and the table


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] if xs else float("nan")


def summarize(results: list[Result], seconds: float, ttft_slo: float, tpot_slo: float) -> dict:
    ok = [r for r in results if r.error is None]
    row = {"requests": len(results), "failed": len(results) - len(ok),
           "output_tok_s": sum(r.output_len for r in ok) / seconds,
           "slo_attainment": sum(r.ttft <= ttft_slo and r.tpot <= tpot_slo for r in ok)
                             / max(1, len(results)),
           "disaggregated_share": sum(len(r.path) == 2 for r in ok) / max(1, len(ok))}
    for name in ("ttft", "tpot", "e2e"):
        for q in (50, 90, 99):
            row[f"{name}_p{q}"] = percentile([getattr(r, name) for r in ok], q)
    row["lag_max"] = max((r.lag for r in results), default=0.0)
    drafted, kept, steps = (sum(r.spec[i] for r in ok) for i in range(3))
    if drafted:   # speculative decoding: vLLM's acceptance rate and mean acceptance length
        row["spec_acceptance"], row["spec_mean_kept_per_step"] = kept / drafted, 1 + kept / steps
    return row


def summary_rows(run: "Run", name: str, workload: str, rate: float, got: list[Result], seconds: float,
                 held: dict) -> list[dict]:
    """A run's summary row (held: what it ran under), and the phased workload's per phase,
    each over its share of the run."""
    rows = [{"policy": name, "workload": workload, "rate": rate, **held,
             **summarize(got, seconds, run.ttft_slo, run.tpot_slo)}]
    if workload == "phased":
        held = {k: v for k, v in held.items() if k not in ("start_s", "profile_s", "warm_up_s")}
        rows += [{"policy": name, "workload": f"phased:{mix}", "rate": rate, **held,
                  **summarize([r for r in got if r.phase == mix],
                              seconds * sum(m == mix for m, _ in run.phases) / len(run.phases),
                              run.ttft_slo, run.tpot_slo)} for mix in dict.fromkeys(m for m, _ in run.phases)]
    return rows


def label(policy: str, workload: str, rows: list[dict]) -> str:
    """A series' name in the plots: the policy, and the workload when a run has several."""
    several = len({r["workload"] for r in rows}) > 1
    return f"{policy} {workload}" if several else policy


def print_table(rows: list[dict], title: str, front: list[dict] = ()) -> None:
    """The summary rows as a Markdown table, each workload and rate's best fixed
    configuration (frontier) marked."""
    best = {(f["best_fixed"], f["workload"], f["rate"]) for f in front}
    print(f"\n{title}")
    print("| policy | workload | rate (req/s) | requests | output tok/s | TTFT p50 / p99 (s) "
          "| TPOT p50 / p99 (ms) | E2E p50 / p99 (s) | SLO met | disaggregated |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        rate = "static" if r["rate"] <= 0 else f"{r['rate']:g}"
        name = r["policy"] + (" (best fixed)" if (r["policy"], r["workload"], r["rate"]) in best else "")
        print(f"| {name} | {r['workload']} | {rate} | {r['requests']} | {r['output_tok_s']:.0f} "
              f"| {r['ttft_p50']:.3f} / {r['ttft_p99']:.3f} "
              f"| {r['tpot_p50'] * 1e3:.1f} / {r['tpot_p99'] * 1e3:.1f} "
              f"| {r['e2e_p50']:.2f} / {r['e2e_p99']:.2f} | {r['slo_attainment']:.0%} "
              f"| {r['disaggregated_share']:.0%} |")
    for r in rows:
        if "spec_acceptance" in r:
            print(f"{r['policy']} {r['workload']}: drafts kept {r['spec_acceptance']:.0%}, "
                  f"{r['spec_mean_kept_per_step']:.2f} tokens per drafting step")


def report(run: "Run", rows: list[dict], results: list[Result], calib: dict, timelines: list[dict],
           configs: list[dict] = (), steps: list[dict] = ()) -> None:
    """The table and goodput on stdout; results.json and the plots under run.out."""
    for r in rows:
        r["label"] = label(r["policy"], r["workload"], rows)
    labels = list(dict.fromkeys(r["label"] for r in rows))
    goodput = {lb: max([r["rate"] for r in rows if r["label"] == lb and r["slo_attainment"] >= 0.9],
                       default=0.0)
               for lb in labels}
    front = frontier(rows, run.slo is not None)
    phase_switch(front, results)
    print_table(rows, record.caption(run), front)
    record.print_notes(run, rows, goodput, calib, timelines, configs, front)
    run.out.mkdir(parents=True, exist_ok=True)
    files = plots.plot(run.out, record.caption(run), rows, results, goodput, timelines, configs, run.rates,
                       (run.ttft_slo, run.tpot_slo))
    record.write_results(run, rows, results, goodput, front, calib, timelines, configs, steps)
    print(f"wrote {run.out / 'results.json'} and {', '.join(files)}")


def replot(args: argparse.Namespace) -> None:
    """A run's PNGs drawn again, beside its results.json, and its frontier lines printed
    again, from what that file holds: nothing is measured. The run's caption is rebuilt from
    the file's meta and summary. The file may be gzipped (results.json.gz)."""
    data = calibrate.read_results(args.results)
    meta, rows = data["meta"], data["summary"]
    duration = default(args.duration, meta.get("duration"))
    if duration is None:
        raise SystemExit(f"{args.results} does not hold the run's duration: give --duration")
    first = meta["devices"][0]
    joined, served = first.startswith("joined at "), first.startswith("served at ")
    run = Run(mode=meta["mode"], policies=list(dict.fromkeys(r["policy"] for r in rows)),
              workloads=meta["workloads"], rates=sorted({r["rate"] for r in rows}), duration=duration,
              count=meta.get("num_requests", len(data["requests"])), model=meta["model"],
              devices=None if joined or served else meta["devices"], scale=meta["length_scale"],
              ttft_slo=meta["ttft_slo"], tpot_slo=meta["tpot_slo"], engine={}, seed=meta["seed"],
              out=args.results.parent, join=first.removeprefix("joined at ") if joined else None,
              transport=meta.get("transport", "p2p"), device_name=meta["device_name"],
              phases=tuple(tuple(p) for p in meta.get("phases", PHASES)),
              phase_s=meta.get("phase_s", PHASE_S), url=first.removeprefix("served at ") if served else None,
              concurrency=meta.get("max_concurrency"))
    results = [Result(**r) for r in data["requests"]]
    front = frontier(rows, meta.get("slo_given", False))
    phase_switch(front, results)
    print_frontier(front)
    # regimes recorded before results.json kept their phases: the default ones
    timelines = [{"phases": PHASES, "phase_s": PHASE_S, **tl} for tl in data.get("regimes") or []]
    files = plots.plot(run.out, record.caption(run), rows, results, data["goodput"], timelines,
                       data.get("configs") or [], run.rates, (run.ttft_slo, run.tpot_slo))
    print(f"wrote {', '.join(str(run.out / f) for f in files)}")


# ----------------------------------------------------------------------------- the command line


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
    device_name: str | None = None   # the GPUs' name (default: asked of CUDA; replot: results.json's)
    phases: tuple[tuple[str, float], ...] = PHASES   # the phased workload's (workload, rate factor)
    phase_s: float = PHASE_S    # and how long each lasts
    url: str | None = None      # an OpenAI-compatible server's base URL: measure it, as a client
    api_key: str | None = None  # ... and its key
    concurrency: int | None = None   # at most this many requests in flight (None: no cap)


def parser() -> argparse.ArgumentParser:
    """bench.py's one command line: the serving benchmark's flags, each with its help and its
    default (those that depend on GPUs or CPUs say both; make_run fills them in), and the
    tools as sub-commands (add_tool_commands)."""
    from nanopd.model import PRESETS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default="adaptive", choices=["collocated", "disaggregated", "adaptive", "all"],
                   help="collocated: every worker prefills and decodes; disaggregated: one prefills, the "
                   "others decode; adaptive: the router picks each request's path and the planner the "
                   "roles; all: the three in turn on the same requests (default: %(default)s)")
    p.add_argument("--mode", default="poisson", choices=["static", "poisson", "sweep"],
                   help="static: --num-requests at once; poisson: arrivals at --rate for --duration; "
                   "sweep: the poisson run at each of --rates (default: %(default)s)")
    p.add_argument("--workload", nargs="+", default=["sharegpt"], choices=list(WORKLOADS), metavar="NAME",
                   help=f"the prompt and output lengths drawn, one or more of {', '.join(WORKLOADS)} "
                   "(docs/benchmark.md); several: each in turn (default: sharegpt)")
    p.add_argument("--rate", type=float, default=None,
                   help="requests/s (poisson; default: 8 on GPUs, 4 on CPUs)")
    p.add_argument("--rates", type=float, nargs="+", default=None,
                   help="requests/s of each sweep run (default: 2 4 8 16 32 on GPUs, 2 4 8 on CPUs)")
    p.add_argument("--duration", type=float, default=None,
                   help="seconds of arrivals per run (default: 60 on GPUs, 15 on CPUs)")
    p.add_argument("--num-requests", type=int, default=None,
                   help="static mode (default: 512 on GPUs, 64 on CPUs)")
    p.add_argument("--model", default=None, help=f"a preset ({', '.join(PRESETS)}: the architecture with "
                   "seeded random weights, no download) or a Hugging Face checkpoint folder (default: "
                   "qwen3-8b on GPUs, tiny on CPUs)")
    p.add_argument("--devices", nargs="+", default=None,
                   help="one worker per entry (default: every visible GPU, or cpu cpu without one)")
    p.add_argument("--join", default=None, help="HOST:PORT to listen at for workers torchrun starts on other "
                   "hosts (hosts.py), instead of --devices (default: none)")
    p.add_argument("--url", default=None, help="an OpenAI-compatible server's base URL "
                   "(http://HOST:PORT/v1): measure it over HTTP as its client, streaming, --model its "
                   "model's name, instead of starting workers (policy 'server'; default: none)")
    p.add_argument("--api-key", default=None, help="the --url server's key (default: none)")
    p.add_argument("--transport", default=None, choices=["p2p", "relay", "distributed"],
                   help="how KV moves between workers (default: p2p, or distributed with --join)")
    p.add_argument("--seed", type=int, default=0, help="draws the workload: the same seed, the same requests "
                   "for every policy (default: %(default)s)")
    p.add_argument("--ttft-slo", type=float, default=None, help="seconds to the first token (default: 2.0 "
                   "on GPUs, 0.5 on CPUs). Given (or --tpot-slo), the adaptive policy routes for goodput "
                   "under it")
    p.add_argument("--tpot-slo", type=float, default=None,
                   help="seconds per output token after the first (default: 0.1 on GPUs, 0.05 on CPUs)")
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="seats per worker, every policy (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="the most tokens a step carries, decodes and prompt chunks together (default: "
                   "8192 on GPUs, 256 on CPUs)")
    p.add_argument("--speculative", type=int, default=0, metavar="K",
                   help="speculative decoding, K ngram drafts a step (docs/speculative.md); 0: none "
                   "(default)")
    p.add_argument("--out", default="runs/bench", help="folder for results.json and the plots (runs/ is not "
                   "tracked; results/ holds the measurements the docs quote) (default: %(default)s)")
    add_arrival_flags(p)
    add_tool_commands(p)
    return p


def add_arrival_flags(p: argparse.ArgumentParser) -> None:
    """How requests come beyond --mode and --rate: the phased workload's phases, and a cap
    on those in flight."""
    p.add_argument("--phases", nargs="+", default=None, metavar="WORKLOAD:FACTOR",
                   help="the phased workload's phases, in turn, each a workload arriving at FACTOR times "
                   "--rate (default: " + " ".join(f"{w}:{f:g}" for w, f in PHASES) + ")")
    p.add_argument("--phase-s", type=float, default=PHASE_S,
                   help="seconds each phase of the phased workload lasts (default: %(default)g)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight, as that many clients that each send "
                   "their next request when their last ended; each counts from when it was sent, as "
                   "vLLM's benchmark (default: no cap)")


def measuring(model: bool = True, plot: bool = False, more: Callable | None = None) -> Callable:
    """What adds a measuring tool's flags: --small and --out (JSON, and a plot beside it if it
    draws one), --model unless it times no model, and its own (more)."""
    def add(c: argparse.ArgumentParser) -> None:
        c.add_argument("--small", action="store_true", help="every measurement at toy sizes (the tiny model, "
                       "small batches, few requests): seconds, to check that it runs; its numbers mean "
                       "nothing")
        c.add_argument("--out", default=None, help="write the results as JSON here" + (
            ", and a plot beside it (.png)" if plot else "") + " (default: print only)")
        if model:
            c.add_argument("--model", default=None, help="preset (random weights) or checkpoint folder "
                           "(default: qwen3-8b, or tiny with --small)")
        if more is not None:
            more(c)
    return add


def replot_flags(c: argparse.ArgumentParser) -> None:
    """replot's argument and flag."""
    c.add_argument("results", type=Path, help="a results.json that bench.py wrote")
    c.add_argument("--duration", type=float, default=None, help="the run's --duration, for a "
                   "results.json too old to hold it (results/README.md gives each run's command)")


def simulate_flags(c: argparse.ArgumentParser) -> None:
    """simulate's flags, and its requests: this file's (make_requests), handed to the tool."""
    simulate.add_flags(c, list(WORKLOADS))
    c.set_defaults(make_requests=lambda workload, rate, a: make_requests(
        workload, rate, a.duration, 0, a.seed, HTTP_VOCAB, 1.0, parse_phases(a.phases), a.phase_s),
        phases_of=lambda a: parse_phases(a.phases))


# `bench.py COMMAND`: its name, its line in bench.py --help, what runs it (a tool's module: its
# main, its docstring the help page as written; or a function here: itself, its docstring
# rewrapped) and what adds its flags
TOOLS = (
    ("kernels", "the kernels, each beside a same-run reference", microbench, measuring(model=False)),
    ("engine", "the single-GPU engine beside the hardware's ceilings", microbench, measuring()),
    ("profile", "a decode step's GPU time, kernel by kernel", microbench,
     measuring(more=microbench.add_profile_flags)),
    ("transfer", "the KV handoff between two GPUs", microbench,
     measuring(more=microbench.add_transfer_flags)),
    ("split", "one GPU's SMs split between prefill and decode", splitbench, measuring(plot=True)),
    ("speculative", "speculative decoding against plain decoding", specbench, measuring(plot=True)),
    ("replot", "a run's PNGs drawn again from its results.json", replot, replot_flags),
    ("calibrate", "the cost model replayed on a run's adaptive requests", calibrate, calibrate.add_flags),
    ("simulate", ("one whole-GPU worker simulated on a run's step times, at fixed budgets and under the "
                  "controller"), simulate, simulate_flags),
    ("figures", "draw the docs' figures", figures, figures.add_flags),
)


def add_tool_commands(p: argparse.ArgumentParser) -> None:
    """`bench.py COMMAND [...]`: a sub-command per entry of TOOLS; without a command, bench.py
    runs the serving benchmark."""
    sub = p.add_subparsers(dest="command", title="commands", description="the tools; without one, the "
                           "serving benchmark runs (bench.py COMMAND --help for each)")
    for name, summary, runs, add_flags in TOOLS:
        tool = inspect.ismodule(runs)
        c = sub.add_parser(name, help=summary, description=runs.__doc__, prog=f"bench.py {name}",
                           **({"formatter_class": argparse.RawDescriptionHelpFormatter} if tool else {}))
        c.set_defaults(main=runs.main if tool else runs)
        add_flags(c)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parser().parse_args(argv)


def make_run(args: argparse.Namespace) -> Run:
    """The run the flags ask for; SystemExit with one line if they ask for none."""
    from nanopd.cluster import default_devices
    devices = None if args.join or args.url else args.devices or default_devices()
    gpu = devices[0].startswith("cuda") if devices else torch.cuda.is_available()   # --join: as here
    if args.mode == "sweep":
        rates = args.rates or ([2, 4, 8, 16, 32] if gpu else [2, 4, 8])
    elif args.mode == "static":
        rates = [0.0]
    else:
        rates = [default(args.rate, 8.0 if gpu else 4.0)]
    max_num_batched_tokens = default(args.max_num_batched_tokens, 8192 if gpu else 256)
    names = ["server"] if args.url else run_names(args.policy, devices, max_num_batched_tokens)
    run = Run(mode=args.mode, policies=names,
              workloads=args.workload, rates=rates,
              duration=default(args.duration, 60.0 if gpu else 15.0),
              count=default(args.num_requests, 512 if gpu else 64),
              model=args.model or ("qwen3-8b" if gpu else "tiny"), devices=devices,
              scale=1.0 if gpu else 1 / 8,
              ttft_slo=default(args.ttft_slo, 2.0 if gpu else 0.5),
              tpot_slo=default(args.tpot_slo, 0.1 if gpu else 0.05),
              engine={"max_num_seqs": args.max_num_seqs, "max_model_len": 4096,
                      "max_num_batched_tokens": max_num_batched_tokens,
                      **({"speculative_config": {"method": "ngram",
                                                 "num_speculative_tokens": args.speculative}}
                         if args.speculative != 0 else {})},
              seed=args.seed, out=Path(args.out), join=args.join,
              transport=args.transport or ("distributed" if args.join else "p2p"),
              slo=None if args.ttft_slo is None and args.tpot_slo is None else
              (default(args.ttft_slo, 2.0 if gpu else 0.5), default(args.tpot_slo, 0.1 if gpu else 0.05)),
              phases=parse_phases(args.phases), phase_s=args.phase_s, url=args.url, api_key=args.api_key,
              concurrency=args.max_concurrency)
    check_run(run)
    return run


def parse_phases(values: list[str] | None) -> tuple[tuple[str, float], ...]:
    """--phases WORKLOAD:FACTOR ... as (workload, factor) pairs; SystemExit with one line
    naming the flag for an entry that is not one."""
    if values is None:
        return PHASES
    phases = []
    for value in values:
        mix, _, factor = value.partition(":")
        try:
            rate = float(factor)
        except ValueError:
            rate = math.nan
        if mix not in WORKLOADS or mix == "phased" or not (math.isfinite(rate) and rate > 0):
            raise SystemExit(f"error: --phases takes WORKLOAD:FACTOR, a workload of "
                             f"{', '.join(w for w in WORKLOADS if w != 'phased')} and a factor above 0, "
                             f"got {value!r}")
        phases.append((mix, rate))
    return tuple(phases)


def default(value, fallback):
    """A flag's value, or its default when it was not given (0 is a value, not a default)."""
    return fallback if value is None else value


MAX_REQUESTS = 1_000_000   # per workload and rate: past it a run would take hours and its memory


def check_run(run: Run) -> None:
    """SystemExit with one line naming the flag, for a run that could not run or never end."""
    for flag, values in (("--rate/--rates", run.rates if run.mode != "static" else []),
                         ("--duration", [run.duration]), ("--phase-s", [run.phase_s]),
                         ("--ttft-slo", [run.ttft_slo]), ("--tpot-slo", [run.tpot_slo])):
        bad = [v for v in values if not (math.isfinite(v) and v > 0)]
        if bad:
            raise SystemExit(f"error: {flag} must be above 0 and finite, got {bad[0]:g}")
    if run.count < 1:
        raise SystemExit(f"error: --num-requests must be at least 1, got {run.count}")
    if run.concurrency is not None and run.concurrency < 1:
        raise SystemExit(f"error: --max-concurrency must be at least 1, got {run.concurrency}")
    spec = run.engine.get("speculative_config")
    if spec is not None and spec["num_speculative_tokens"] < 0:
        raise SystemExit(f"error: --speculative must be at least 0, got {spec['num_speculative_tokens']}")
    if max(run.rates) * run.duration > MAX_REQUESTS or run.count > MAX_REQUESTS:
        raise SystemExit(f"error: --rate x --duration (or --num-requests) asks for more than "
                         f"{MAX_REQUESTS:,} requests")
    try:   # the results must have somewhere to go before any time is spent serving
        run.out.mkdir(parents=True, exist_ok=True)
        (run.out / ".writable").touch()
        (run.out / ".writable").unlink()
    except OSError as e:
        raise SystemExit(f"error: --out {run.out}: {e.strerror or e}") from None


# ----------------------------------------------------------------------------- main


def run_policy(run: Run, name: str) -> tuple[list[dict], list[Result], dict, list[dict], list[dict],
                                             list[dict]]:
    """Every workload at every rate under one run's configuration (run_names), one
    start-up: the summary rows (the phased workload's also per phase), every request's
    result, the router's calibration, the regimes it went through, the configurations
    its workers held (adaptive) and the steps they timed."""
    from nanopd import LLM
    policy, tokens = run_config(name)   # tokens: the run's max_num_batched_tokens, None: run.engine's
    engine = {**run.engine, **({"max_num_batched_tokens": tokens} if tokens else {})}
    begun = time.perf_counter()
    try:
        llm = LLM(run.model, policy=policy, devices=run.devices,
                  slo=run.slo if policy == "adaptive" else None,
                  join=run.join, transport=run.transport, time_steps=True, **engine)
    except ValueError as e:   # bad --model, --devices for the policy, ...: say so, no traceback
        raise SystemExit(f"error: {e}") from None
    rows, results, timelines, configs, steps = [], [], [], [], []
    with llm:
        held = {"token_budget": llm.cluster.cfg.max_num_batched_tokens, "sm_split": llm.cluster.cfg.sm_split}
        vocab = llm.cluster.vocab_size
        router = llm.cluster.router
        profiled = asdict(router.cost.p) if router is not None else None   # before the refits
        warm = warm_up(run, vocab)
        started = time.perf_counter()
        serve(llm, name, "warm-up", 0.0, warm, f"{name} warm-up")
        # LLM(): the workers, their CUDA graphs and, for adaptive, its profile unless one is cached
        startup = {"start_s": started - begun, "profile_s": llm.profile_s,
                   "warm_up_s": time.perf_counter() - started}
        for workload in run.workloads:
            for rate in run.rates:
                specs = make_requests(workload, rate, run.duration, run.count, run.seed, vocab, run.scale,
                                      run.phases, run.phase_s)
                start = time.perf_counter()
                desc = f"{name} {workload} @ {'static' if rate <= 0 else rate}"
                got, seconds = serve(llm, name, workload, rate, specs, desc, run.concurrency)
                results += got
                rows += summary_rows(run, name, workload, rate, got, seconds, {**held, **startup})
                run_id = {"policy": name, "workload": workload, "rate": rate,
                          **({"phases": run.phases, "phase_s": run.phase_s} if workload == "phased" else {})}
                if llm.cluster.planner is not None:
                    timelines.append({**run_id, **regime_timeline(llm.cluster.planner, start, seconds)})
                if policy == "adaptive":   # its workers' controllers choose their configurations
                    configs.append({**run_id, **config_timeline(llm.cluster, llm.cluster.config_log, held,
                                                                start, seconds)})
                steps.append({**run_id, "steps": timed_steps(llm.cluster, start, seconds)})
        return rows, results, calibrate.calibration(router, profiled), timelines, configs, steps


def run_server(run: Run, name: str) -> tuple[list[dict], list[Result], dict, list, list, list]:
    """run_policy's twin against the server at run.url, as its client (serve_over_http):
    the same warm-up, then every workload at every rate; nothing of the server's inside
    (no calibration, regimes, configurations or steps)."""
    rows, results, held = [], [], {"token_budget": None, "sm_split": None}
    client.check_server(run.url, run.api_key, run.model)
    asyncio.run(serve_over_http(run, "warm-up", 0.0, warm_up(run, HTTP_VOCAB), "server warm-up"))
    for workload in run.workloads:
        for rate in run.rates:
            specs = make_requests(workload, rate, run.duration, run.count, run.seed, HTTP_VOCAB, run.scale,
                                  run.phases, run.phase_s)
            desc = f"server {workload} @ {'static' if rate <= 0 else rate}"
            got, seconds = asyncio.run(serve_over_http(run, workload, rate, specs, desc))
            results += got
            rows += summary_rows(run, name, workload, rate, got, seconds, held)
    return rows, results, {}, [], [], []


def main() -> None:
    args = parse_args()
    if args.command is not None:   # a tool (add_tool_commands)
        return args.main(args)
    run = make_run(args)
    rows, results, calib, timelines, configs, steps = [], [], {}, [], [], []
    for name in run.policies:
        got_rows, got, c, t, held, timed = (run_server if run.url else run_policy)(run, name)
        rows, results, calib = rows + got_rows, results + got, c or calib
        timelines, configs, steps = timelines + t, configs + held, steps + timed
    report(run, rows, results, calib, timelines, configs, steps)


if __name__ == "__main__":
    main()
