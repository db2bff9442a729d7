"""Measures the hardware for the router's cost model (costmodel.py), on the workers that will serve.

  alpha         prefill ms per token: prefills of several lengths, least squares, with a
                fixed cost per prefill (alpha0: a step reads every weight, however few
                tokens it has) and a quadratic (attention) term when it fits clearly better
  beta          a decode step at batch 1
  batch_thresh  the knee of decode step time vs batch: flat, then linear (and its slope)
  kv            decode-step time per token of context in the batch (reading its KV): the
                same batches at two context lengths
  gamma         extra decode-step time per prefill token sharing the step:
                (t(decode batch + chunk) - t(decode batch alone)) / chunk tokens
  bandwidth     real handoffs of real requests between the workers: the transport's copy
                rate, and the handoff's added latency per prompt token (transfer_rate)

    python -m nanopd.profiler --model qwen3-8b --devices cuda:0 cuda:1

Named profiler.py, not profile.py: that would shadow the standard library's `profile`, and
then cProfile and torch.compile break. Results are cached as JSON (~/.cache/nanopd), keyed
by what they were measured on (cache_key: devices, settings, model, versions, code), so a
second start is instant and a change of any of these measures again. A cached file that
cannot be read (cut short, emptied, of another schema) is named in one line, measured
again and replaced; files are written whole or not at all (a temporary file, renamed).
The engine timings are taken on a worker (timing.measure_engine, sent as a Measure
message), at sizes fitted to its KV cache and max_model_len (fit_spec); the handoffs are
real requests through the cluster.
"""

import argparse
import dataclasses
import hashlib
import itertools
import json
import logging
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import triton

from nanopd.cluster import CentralScheduler, ClusterConfig, default_devices
from nanopd.config import EngineConfig
from nanopd.costmodel import (
    CostModel,
    HardwareParams,
    LeastSquares,
    SplitParams,
    prefill_features,
    prefill_time,
    step_time,
)
from nanopd.kv_cache import cdiv

CACHE = Path.home() / ".cache" / "nanopd"
log = logging.getLogger("nanopd")


@dataclass
class Profile:
    params: HardwareParams
    bandwidth_GBps: float
    errors: dict[str, float] = field(default_factory=dict)   # each fit's relative RMS error
    key: dict = field(default_factory=dict)                   # what it was measured on
    seconds: float = 0.0                                      # how long measuring took
    timings: dict = field(default_factory=dict)               # the raw timings fitted (timing.measure_engine)


# ----------------------------------------------------------------------------- fits


def relative_rms(pred: list[float], ys: list[float]) -> float:
    return (sum(((p - y) / y) ** 2 for p, y in zip(pred, ys)) / len(ys)) ** 0.5


def fit_prefill(lengths: list[int], ms: list[float]) -> tuple[float, float, float, float]:
    """(alpha0, alpha, alpha2, error) for ms = alpha0 + alpha * L (+ alpha2 * L^2 when that
    halves the error and adds over 5% at the longest length), all >= 0. Fitted by relative
    error: short prefills matter as much as long ones."""
    def solve(quadratic: bool) -> tuple[list[float], float]:
        terms = 3 if quadratic else 2   # of prefill_features: 1, L, L^2
        coef = LeastSquares.fit([[x / y for x in prefill_features(n)[:terms]] for n, y in zip(lengths, ms)],
                                [1.0] * len(ms))
        coef += [0.0] * (3 - len(coef))
        return coef, relative_rms([prefill_time(coef, n) for n in lengths], ms)
    (linear, err), (quadratic, err2) = solve(False), solve(True)
    longest = max(lengths)
    matters = quadratic[2] * longest ** 2 > 0.05 * ms[lengths.index(longest)]   # not just fitting noise
    return (*quadratic, err2) if matters and err2 < err / 2 else (*linear, err)


def fit_knee(batches: list[int], ms: list[float],
             tolerance: float = 0.01) -> tuple[float, float, float, float]:
    """(beta, batch_thresh, slope, error) for ms = beta + slope * max(0, batch - knee), beta
    and slope >= 0, the knee searched over the measured batch sizes (flat, then linear).
    Where the step grows gently, several knees fit about equally well and the best by a
    hair is noise: the largest knee whose error is within `tolerance` (relative RMS) of the
    best is taken, so the flat part runs as far as the data allow and the knee does not
    jump between starts."""
    fits = []
    for knee in batches:
        beta, slope = LeastSquares.fit([[1.0, max(0, b - knee)] for b in batches], ms)
        steps = [step_time((beta, beta, slope, 0.0, 0.0), knee, b, 0, 0) for b in batches]
        fits.append((beta, float(knee), slope, relative_rms(steps, ms)))
    best = min(f[3] for f in fits)
    return max((f for f in fits if f[3] <= best + tolerance), key=lambda f: f[1])


def fit_gamma(chunks: list[int], extra_ms: list[float]) -> tuple[float, float]:
    """(gamma >= 0, error): extra step time = gamma * chunk tokens."""
    (gamma,) = LeastSquares.fit([[c] for c in chunks], extra_ms)
    return gamma, relative_rms([gamma * c for c in chunks], [max(e, 1e-9) for e in extra_ms])


def fit(timings: dict, handoffs: list[tuple[int, int, float, float]]) -> Profile:
    """The parameters from timing.measure_engine's timings and real handoffs (prompt tokens,
    bytes moved, copy seconds, handoff ms). Every one is >= 0."""
    alpha0, alpha, alpha2, e_prefill = fit_prefill(timings["lengths"], timings["prefill_ms"])
    # kv: what the longer context adds, per token of context in the batch; then the knee of the rest.
    short = dict(zip(timings["batches"], timings["decode_ms"]))
    extra_context = timings["long_context"] - timings["context"]
    pairs = list(zip(timings["kv_batches"], timings["long_decode_ms"]))
    (kv,) = LeastSquares.fit([[b * extra_context] for b, _ in pairs],
                             [t - short[b] for b, t in pairs]) if pairs else (0.0,)
    beta, knee, slope, e_decode = fit_knee(timings["batches"],
                                           [t - kv * b * timings["context"]
                                            for b, t in zip(timings["batches"], timings["decode_ms"])])
    gamma, e_gamma = fit_gamma(timings["chunks"], timings["extra_ms"])
    if handoffs:
        bandwidth = statistics.median(b / s / 1e9 for _, b, s, _ in handoffs)
        rate = max(0.0, statistics.median(ms / n for n, _, _, ms in handoffs))   # a measured duration
    else:   # one device: no handoffs; the rate only matters where there are two
        bandwidth, rate = float("nan"), float("inf")
    params = HardwareParams(alpha=alpha, alpha2=alpha2, alpha0=alpha0, beta=beta, batch_thresh=max(knee, 1.0),
                            slope=slope, gamma=gamma, transfer_rate=rate, kv=kv)
    errors = {"prefill": e_prefill, "decode": e_decode, "gamma": e_gamma}
    for key, t in timings.get("splits", {}).items():
        params.splits[key], errors[f"split {key}"] = fit_split(timings, kv, t, params)
    return Profile(params, bandwidth, errors, timings=timings)


def fit_lane_factor(whole: list[float], ms: list[float]) -> tuple[float, float]:
    """(k, error): the lane's times as k x the whole GPU's at the same sizes, by relative
    error (the k minimising sum((k w / t - 1)^2))."""
    ratios = [w / max(t, 1e-9) for w, t in zip(whole, ms)]
    # a whole GPU fitted as free: so is the lane
    k = sum(ratios) / sum(r * r for r in ratios) if any(ratios) else 0.0
    return k, relative_rms([k * w for w in whole], ms)


def fit_split(timings: dict, kv: float, split: dict, whole: HardwareParams) -> tuple[SplitParams, float]:
    """A split's lanes (timing.measure_splits): the prefill lane as the whole GPU's prefill
    (whole) slowed by one factor, the decode lane fitted as the whole GPU's decode is, its
    context term the whole GPU's scaled as its batch-1 step is; the larger fit error.
    Prefill is bound by arithmetic, so on P of the GPU's SMs it keeps the whole GPU's shape
    in L and runs about P / all as fast (bench.py split measures each lane beside the whole
    GPU). Three terms of its own, fitted on lengths up to 4,096, bent the shape where one
    factor cannot: a lane's own fit came out with a large fixed cost and a quadratic term
    several times the whole GPU's, and so forecast long prompts far slower than bench.py
    split finds them."""
    k, e_prefill = fit_lane_factor([CostModel(whole).prefill_ms(n) for n in timings["lengths"]],
                                   split["prefill_ms"])
    alpha0, alpha, alpha2 = k * whole.alpha0, k * whole.alpha, k * whole.alpha2
    kv_split = kv * split["decode_ms"][0] / timings["decode_ms"][0]
    beta, knee, slope, e_decode = fit_knee(timings["batches"],
                                           [t - kv_split * b * timings["context"]
                                            for b, t in zip(timings["batches"], split["decode_ms"])])
    return SplitParams(alpha0, alpha, alpha2, beta, max(knee, 1.0), slope, kv_split), max(e_prefill, e_decode)


# ----------------------------------------------------------------------------- on the live workers


GPU_SPEC = {"lengths": [256, 512, 1024, 2048, 4096], "batches": [1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256],
            "chunks": [16, 32, 64, 128, 256, 512, 1024, 2048], "context": 512, "gamma_batch": 32,
            "long_context": 2048, "kv_batches": [16, 64]}
CPU_SPEC = {"lengths": [8, 16, 32, 64], "batches": [1, 2, 4, 8, 16], "chunks": [4, 8, 16, 32], "context": 16,
            "gamma_batch": 4, "long_context": 64, "kv_batches": [4, 8], "reps": 2}


def fit_spec(spec: dict, cfg: EngineConfig, room_blocks: int) -> dict:
    """spec's sizes that fit the engine: contexts below max_model_len, and each fake batch
    (timing.fake_batch) within room_blocks, the KV cache less its watermark. A ValueError
    naming the setting if too little is left to fit a parameter."""
    bs = cfg.block_size
    context = min(spec["context"], cfg.max_model_len - 1)
    long_context = min(spec["long_context"], cfg.max_model_len - 1)
    per_seq = cdiv(context + 1, bs)   # a decode's blocks: its context and the token it computes
    lengths = [n for n in spec["lengths"] if n <= cfg.max_model_len and cdiv(n, bs) <= room_blocks]
    batches = [b for b in spec["batches"] if b * per_seq <= room_blocks]
    kv_batches = [b for b in spec["kv_batches"]
                  if b in batches and b * cdiv(long_context + 1, bs) <= room_blocks
                  and long_context > context]
    smallest = min(spec["chunks"])
    gamma_batch = max((b for b in range(1, spec["gamma_batch"] + 1)
                       if b * per_seq + cdiv(smallest, bs) <= room_blocks), default=0)
    chunks = [c for c in spec["chunks"] if gamma_batch * per_seq + cdiv(c, bs) <= room_blocks]
    if len(lengths) < 2 or len(batches) < 2 or not gamma_batch:
        need = 2 * per_seq + cdiv(smallest, bs)
        raise ValueError(f"the adaptive policy's profiler needs at least {need} KV blocks per worker to time "
                         f"decode steps of {context} tokens of context; num_kv_blocks={cfg.num_kv_blocks} "
                         f"leaves {room_blocks}: raise num_kv_blocks, or pass "
                         "LLM(profile=HardwareParams(...))")
    return dict(spec, context=context, long_context=long_context, lengths=lengths, batches=batches,
                kv_batches=kv_batches, gamma_batch=gamma_batch, chunks=chunks)


def cache_key(cluster: CentralScheduler) -> dict:
    """Everything a profile depends on: the devices, the engine settings, the model, the
    transport, the library versions, and the code itself (a digest of nanoPD's modules), so
    a profile of other hardware, settings or code is never reused."""
    devices = [torch.cuda.get_device_name(d) if d.startswith("cuda") else "cpu" for d in cluster.devices]
    code = hashlib.sha1()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        if not path.name.startswith("test_"):
            code.update(path.read_bytes())
    settings = {k: str(v) for k, v in asdict(cluster.cfg).items() if k not in ("device", "seed")}
    return {"devices": devices, "transport": cluster.transport, **settings, "torch": torch.__version__,
            "triton": triton.__version__, "code": code.hexdigest()[:16]}


def measure_links(cluster: CentralScheduler, lengths: tuple[int, int]) -> dict[str, list[tuple]]:
    """Real handoffs on every ordered pair of workers, "p>d": (prompt tokens, bytes moved,
    copy seconds, handoff ms) of a short and a long prompt, after one of each that pays
    the pair's first-use costs. Fresh random prompts: a repeated one would hit the decode
    side's prefix cache."""
    rng, links = torch.Generator().manual_seed(0), {}
    for p, d in itertools.permutations(range(len(cluster.devices)), 2):
        handoffs = []
        for n in lengths * 2:
            m = cluster.run_on_path(torch.randint(0, cluster.vocab_size, (n,), generator=rng).tolist(),
                                    (p, d))
            handoffs.append((n, m.kv_bytes_moved, m.kv_copy_time, m.phases()["transfer"] * 1e3))
        links[f"{p}>{d}"] = handoffs[2:]
    return links


def profile_cluster(cluster: CentralScheduler, use_cache: bool = True) -> Profile:
    """Load from the cache, or measure and cache, the parameters on a running
    CentralScheduler (measure_profile)."""
    key = cache_key(cluster)
    path = CACHE / f"profile-{hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]}.json"
    profile = load_profile(path) if use_cache and path.exists() else None
    if profile is None:
        profile = measure_profile(cluster)
        profile.key = key
        save_profile(profile, path)
    return profile


def measure_profile(cluster: CentralScheduler) -> Profile:
    """The engine timings on worker 0, real handoffs between every pair of workers, fitted."""
    start = time.perf_counter()
    on_gpu = cluster.devices[0].startswith("cuda")
    spec = fit_spec(GPU_SPEC if on_gpu else CPU_SPEC, cluster.cfg, cluster.room)
    timings = cluster.measure(0, spec)
    lengths = [n for n in ((512, 2048) if on_gpu else (16, 64)) if n < cluster.cfg.max_model_len]
    links = measure_links(cluster, tuple(lengths) or (cluster.cfg.max_model_len // 2,))
    profile = fit(timings, [h for hs in links.values() for h in hs])
    if len(links) > 1:   # each pair's own rate: within a host and between hosts differ
        profile.params.links = {pair: statistics.median(ms / n for n, _, _, ms in hs)
                                for pair, hs in links.items()}
    profile.seconds = time.perf_counter() - start
    return profile


def load_profile(path: Path) -> Profile | None:
    """The profile cached at path, or None (with one line saying why) if it cannot be read
    or does not hold a profile of this version's schema: it is then measured again."""
    try:
        data = json.loads(path.read_text())
        params = HardwareParams(**data["params"])
        numbers = [getattr(params, f.name) for f in dataclasses.fields(HardwareParams)
                   if f.name not in ("links", "splits")]
        numbers += [x for s in params.splits.values() for x in dataclasses.astuple(s)]
        if not all(isinstance(x, int | float) and not math.isnan(x) for x in numbers) \
                or not all(isinstance(x, int | float) for x in params.links.values()):
            raise ValueError("a parameter is not a number")
        return Profile(params, float(data["bandwidth_GBps"]), dict(data["errors"]), dict(data["key"]),
                       float(data["seconds"]), dict(data["timings"]))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("nanoPD: the cached profile %s cannot be used (%s: %s); measuring again and replacing it",
                    path, type(e).__name__, e)
        return None


def save_profile(profile: Profile, path: Path) -> None:
    """Write the profile whole or not at all: into a temporary file, then renamed over path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(profile), indent=1))
    os.replace(tmp, path)


def print_profile(profile: Profile) -> None:
    p = profile.params
    rows = [("alpha", f"{p.alpha:.5f} ms/token + {p.alpha0:.2f} ms per prefill"
             + (f" + {p.alpha2:.3g} ms/token^2" if p.alpha2 else ""),
             profile.errors.get("prefill")),
            ("beta", f"{p.beta:.3f} ms", profile.errors.get("decode")),
            ("batch_thresh", f"{p.batch_thresh:.0f} sequences (then +{p.slope:.4f} ms per sequence)", None),
            ("kv", f"{p.kv * 1e3:.4f} ms per 1000 tokens of context in the batch", None),
            ("gamma", f"{p.gamma:.5f} ms/token", profile.errors.get("gamma")),
            ("bandwidth", f"{profile.bandwidth_GBps:.1f} GB/s (handoff {p.transfer_rate:.5f} ms/token)",
             None)]
    rows += [(f"link {pair}", f"handoff {rate:.5f} ms/token", None) for pair, rate in p.links.items()]
    rows += [(f"split {key}", (f"prefill {s.alpha:.5f} ms/token + {s.alpha0:.2f} ms; decode {s.beta:.3f} "
                               f"ms to {s.batch_thresh:.0f}, then +{s.slope:.4f} ms per sequence"),
              profile.errors.get(f"split {key}"))
             for key, s in p.splits.items()]
    print("| parameter | value | fit error (relative RMS) |\n| --- | --- | --- |")
    for name, value, err in rows:
        print(f"| {name} | {value} | {'' if err is None else f'{err:.1%}'} |")
    print(f"measured on {profile.key} in {profile.seconds:.1f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-8b" if torch.cuda.is_available() else "tiny")
    p.add_argument("--devices", nargs="+", default=None, help="default: every GPU, or two CPU workers")
    p.add_argument("--no-cache", action="store_true", help="measure again even if a cached profile exists")
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="the engine settings to measure (bench.py's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="default: 8192 on GPUs, 256 on CPUs")
    args = p.parse_args()
    max_num_batched_tokens = args.max_num_batched_tokens or (8192 if torch.cuda.is_available() else 256)
    # The adaptive policy's wiring (every worker reads every other's cache), no router yet.
    cluster = CentralScheduler(EngineConfig(model=args.model, max_num_seqs=args.max_num_seqs,
                                            max_num_batched_tokens=max_num_batched_tokens),
                               ClusterConfig("adaptive", args.devices or default_devices()))
    try:
        print_profile(profile_cluster(cluster, use_cache=not args.no_cache))
    finally:
        cluster.close()


if __name__ == "__main__":
    main()
