"""`python bench.py split`: one GPU's SMs split between a prefill lane and a decode lane
(smsplit.py), measured on Qwen3-8B (random weights), each beside the whole GPU in the same run:

  decode     a decode step (CUDA graph, context 1024) at batch 1, 64 and 256 against the
             decode lane's SMs: alone, and while the prefill lane runs 8192-token chunks;
             steps back to back, as the engine runs them (timing.py:paced_step_ms)
  prefill    an 8192-token chunk's tokens/s against the prefill lane's SMs: alone, and
             while the decode lane runs batch-64 steps
  switch     what changing the split costs: a serving step right after set_split, less
             a step without one
  proof      the SMs each lane's kernels ran on (a kernel that records %smid): disjoint,
             as many as the split gives, and a graph captured on the decode lane keeps to
             its SMs wherever it is replayed
  serve      long prompts arriving while others decode, on the whole GPU (chunked
             prefill) and on the fixed split (the menu's second): the time of each step
             that carries decodes while a prompt prefills, its median, p99 and maximum, and
             how many steps took over 4x the median (a decode step held up by something)

Every result is printed as a table and, with --out, written as JSON (and a plot beside
it, .png). --small runs at toy sizes, seconds, to check that it runs; its numbers mean nothing.
"""

import argparse
import dataclasses
import json
import random
import statistics
import time

import torch

from nanopd.config import EngineConfig
from nanopd.lanes import SplitEngine
from nanopd.request import SamplingParams
from nanopd.smsplit import Split, default_menu, load_kernels_at_start, num_sms, sm_ids
from nanopd.timing import (
    BusyLane,
    decode_beside_prefill_ms,
    fake_batch,
    free_batch,
    paced_step_ms,
    prefill_beside_decode_ms,
    time_step_ms,
)


@dataclasses.dataclass
class SplitSizes:
    model: str = "qwen3-8b"
    batches: tuple[int, ...] = (1, 64, 256)
    context: int = 1024
    prefill_tokens: int = 8192
    beside_batch: int = 64      # the decode steps the prefill runs beside
    reps: int = 20
    # serve: long prompts per second (1024-2048 tokens, 32-256 out, times serve_scale)
    serve_rate: float = 10.0
    serve_s: float = 20.0       # ... arriving over this many seconds
    serve_scale: float = 1.0
    # None: what fits; --small sizes its own, so it runs beside other GPU processes
    num_kv_blocks: int | None = None


SMALL_SPLIT = SplitSizes(model="tiny", batches=(1, 4), context=64, prefill_tokens=256, beside_batch=4, reps=3,
                         serve_rate=1000.0, serve_s=0.04, serve_scale=1 / 8,   # ~40 at once: more than a step
                         num_kv_blocks=2048)


def bench_menu(total: int) -> list[Split]:
    """The splits measured: decode on 1/8 to 7/8 of the SMs, in multiples of 8."""
    return sorted({Split(total - d, d) for d in (max(8, total * k // 64 // 8 * 8) for k in range(8, 57, 8))} |
                  set(default_menu(total)), key=lambda s: s.decode_sms)


def make_engine(sizes: SplitSizes) -> SplitEngine:
    total = num_sms(torch.device("cuda"))
    menu = tuple((s.prefill_sms, s.decode_sms) for s in bench_menu(total))
    return SplitEngine(EngineConfig(model=sizes.model, max_num_seqs=max(sizes.batches), split_menu=menu,
                                    max_num_batched_tokens=max(sizes.prefill_tokens, max(sizes.batches)),
                                    max_model_len=max(sizes.context + 8, sizes.prefill_tokens),
                                    num_kv_blocks=sizes.num_kv_blocks))


def split_rows(eng: SplitEngine, sizes: SplitSizes) -> list[dict]:
    """Per split (and the whole GPU): decode steps alone and beside a prefill; prefill
    alone and beside decodes."""
    rows = []
    pre = fake_batch(eng, 1, 0, sizes.prefill_tokens)
    beside = fake_batch(eng, sizes.beside_batch, sizes.context, 1)
    decs = {b: fake_batch(eng, b, sizes.context, 1) for b in sizes.batches}
    whole = {"split": "whole", "prefill_sms": num_sms(eng.model.device),
             "decode_sms": num_sms(eng.model.device)}
    for b, dec in decs.items():
        whole[f"decode_b{b}_ms"] = paced_step_ms(eng, dec, sizes.reps)
    whole["prefill_ms"] = time_step_ms(eng, pre, 3)
    rows.append(whole)
    for split, lanes in eng.runner.splits.items():
        row = {"split": str(split), "prefill_sms": split.prefill_sms, "decode_sms": split.decode_sms}
        for b, dec in decs.items():
            row[f"decode_b{b}_ms"] = paced_step_ms(eng, dec, sizes.reps, lane=lanes[1])
        with BusyLane(eng, lanes[0], pre) as busy:   # as the profile times them (timing.py:measure_splits)
            for b, dec in decs.items():
                row[f"decode_b{b}_beside_ms"] = decode_beside_prefill_ms(eng, lanes[1], dec, busy, sizes.reps)
        row["prefill_ms"] = time_step_ms(eng, pre, 3, lane=lanes[0])
        row["prefill_beside_ms"] = prefill_beside_decode_ms(eng, lanes, beside, pre)
        rows.append(row)
        print_row(row, sizes)
    for batch in [pre, beside, *decs.values()]:
        free_batch(eng, batch)
    for row in rows:
        row["prefill_tok_s"] = sizes.prefill_tokens / row["prefill_ms"] * 1e3
        if "prefill_beside_ms" in row:
            row["prefill_beside_tok_s"] = sizes.prefill_tokens / row["prefill_beside_ms"] * 1e3
    return rows


def print_row(row: dict, sizes: SplitSizes) -> None:
    decode = "  ".join(f"b{b} {row[f'decode_b{b}_ms']:.2f}/{row[f'decode_b{b}_beside_ms']:.2f} ms"
                       for b in sizes.batches)
    print(f"{row['split']:>9}  decode alone/beside prefill: {decode}  prefill {row['prefill_ms']:.1f} ms "
          f"alone, {row['prefill_beside_ms']:.1f} beside decodes", flush=True)


def switch_cost(eng: SplitEngine, sizes: SplitSizes, steps: int = 12) -> dict:
    """Serve beside_batch requests, all decoding; the median step, and the step right
    after each change of split (to the next menu entry, and to none), less the median."""
    params = SamplingParams(temperature=0.0, max_tokens=10 * steps, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    ids = [eng.submit(torch.randint(0, eng.model.config.vocab_size, (sizes.context,), generator=g).tolist(),
                      params)
           for _ in range(sizes.beside_batch)]
    menu = [None, *eng.runner.splits]
    while any(eng.requests[i].seqs[0].num_outputs == 0 for i in ids):   # all prefilled
        eng.step()
    plain, after = [], []
    for k in range(2 * len(menu)):
        for _ in range(3):
            t = time.perf_counter()
            eng.step()
            plain.append(time.perf_counter() - t)
        t = time.perf_counter()
        eng.set_split(menu[(k + 1) % len(menu)])
        eng.step()
        after.append(time.perf_counter() - t)
    eng.abort(ids)
    while eng.has_unfinished():
        eng.step()
    eng.set_split(None)
    step = statistics.median(plain) * 1e3
    return {"step_ms": step, "switch_ms": statistics.median(after) * 1e3 - step, "switches": len(after)}


def long_prompts(sizes: SplitSizes, vocab: int, max_len: int) -> list[tuple[float, list[int], int]]:
    """(arrival s, prompt, max_tokens) of serve's requests: Poisson arrivals, fixed seed;
    prompt and output within max_len tokens."""
    rng, t, specs = random.Random(0), 0.0, []
    while t < sizes.serve_s:
        n, out = (int(rng.randint(1024, 2048) * sizes.serve_scale),
                  max(2, int(rng.randint(32, 256) * sizes.serve_scale)))
        specs.append((t, [rng.randrange(vocab) for _ in range(min(n, max_len - out))], out))
        t += rng.expovariate(sizes.serve_rate)
    return specs


def serve_steps(eng: SplitEngine, sizes: SplitSizes, split: Split | None) -> dict:
    """Serve long_prompts on split (None: the whole GPU); each engine step that carries
    decodes while a prompt prefills (on a split: beside its chunk in flight; on the whole
    GPU: a mixed step), timed on the host, launch to the previous step's tokens taken."""
    eng.set_split(split)
    specs, times, i = long_prompts(sizes, eng.model.config.vocab_size, eng.cfg.max_model_len), [], 0
    start = time.perf_counter()
    while i < len(specs) or eng.has_unfinished():
        while i < len(specs) and specs[i][0] <= time.perf_counter() - start:
            eng.submit(specs[i][1], SamplingParams(temperature=0.0, max_tokens=specs[i][2], ignore_eos=True))
            i += 1
        if not eng.has_unfinished():
            time.sleep(0.001)
            continue
        step = eng.in_flight
        beside = step is not None and step.shape.decodes > 0 and (
            eng.prefill_in_flight is not None if split is not None else step.shape.prefill_tokens > 0)
        t = time.perf_counter()
        for request_id in eng.step():
            eng.output(request_id)
        if beside:
            times.append((time.perf_counter() - t) * 1e3)
    eng.set_split(None)
    times.sort()
    p50 = statistics.median(times) if times else 0.0
    return {"split": "whole" if split is None else str(split), "steps": len(times), "p50_ms": p50,
            "p99_ms": times[int(0.99 * (len(times) - 1))] if times else 0.0,
            "max_ms": times[-1] if times else 0.0,
            "over_4x_p50": sum(t > 4 * p50 for t in times), "times_ms": times}


def sm_proof(eng: SplitEngine) -> list[dict]:
    """Per split: the SMs each lane's kernels ran on, and those of a graph captured on the
    decode lane and replayed on the whole GPU's stream."""
    dev, rows = eng.model.device, []
    programs = 16 * num_sms(dev)
    for split, (prefill, decode) in eng.runner.splits.items():
        with prefill.running():
            p = sm_ids(programs, dev)
        with decode.running():
            d = sm_ids(programs, dev)
        graph = torch.cuda.CUDAGraph()
        decode.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(graph, stream=decode.stream):
            g = sm_ids(programs, dev)
        graph.replay()   # on the current stream: the whole GPU's
        torch.cuda.synchronize()
        P, D, G = set(p.tolist()), set(d.tolist()), set(g.tolist())
        rows.append({"split": str(split), "prefill_sms": split.prefill_sms, "decode_sms": split.decode_sms,
                     "prefill_ran_on": len(P), "decode_ran_on": len(D), "both_ran_on": len(P & D),
                     "graph_ran_on": len(G), "graph_outside_decode": len(G - D)})
    return rows


def run_split(out: str | None, sizes: SplitSizes) -> dict:
    """Everything above, in one run; the results (written to out as JSON, with a plot)."""
    eng = make_engine(sizes)
    if not any(lanes[1].stream is not None for lanes in eng.runner.splits.values()):
        raise SystemExit("bench.py split: this GPU, driver or Python has no green contexts (cuda.bindings)")
    res = {"sizes": dataclasses.asdict(sizes), "device": torch.cuda.get_device_name(), "proof": sm_proof(eng)}
    for row in res["proof"]:
        print(f"{row['split']:>9}  prefill kernels ran on {row['prefill_ran_on']} SMs, decode on "
              f"{row['decode_ran_on']}, both on {row['both_ran_on']}; the decode lane's graph on "
              f"{row['graph_ran_on']} ({row['graph_outside_decode']} outside its lane)", flush=True)
    res["rows"] = split_rows(eng, sizes)
    res["switch"] = switch_cost(eng, sizes)
    print(f"switch: a step right after set_split costs {res['switch']['switch_ms']:.2f} ms more than a step "
          f"({res['switch']['step_ms']:.2f} ms)")
    res["serve"] = [serve_steps(eng, sizes, split)
                    for split in (None, default_menu(num_sms(eng.model.device))[1])]
    for row in res["serve"]:
        print(f"serve, {row['split']:>9}: {row['steps']} steps with decodes beside a prompt: "
              f"p50 {row['p50_ms']:.1f} ms, p99 {row['p99_ms']:.1f}, max {row['max_ms']:.1f}; "
              f"{row['over_4x_p50']} over 4x p50", flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
        plot_split(res, out.rsplit(".", 1)[0] + ".png")
    return res


def plot_split(res: dict, path: str) -> None:
    """Decode step against decode SMs (alone, beside prefill; the whole GPU dotted),
    prefill tokens/s against prefill SMs, and serve's step times (as a CDF)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in res["rows"] if r["split"] != "whole"]
    whole = next(r for r in res["rows"] if r["split"] == "whole")
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 4.5))
    for b, color in zip(res["sizes"]["batches"], ("tab:blue", "tab:orange", "tab:green")):
        d = [r["decode_sms"] for r in rows]
        ax1.plot(d, [r[f"decode_b{b}_ms"] for r in rows], "o-", color=color, label=f"batch {b}, alone")
        ax1.plot(d, [r[f"decode_b{b}_beside_ms"] for r in rows], "s--", color=color,
                 label=f"batch {b}, beside prefill")
        ax1.axhline(whole[f"decode_b{b}_ms"], color=color, linestyle=":", linewidth=1)
    ax1.set(xlabel="decode lane SMs", ylabel="decode step (ms)",
            title="Decode step (dotted: whole GPU, alone)")
    ax1.legend(fontsize=7)
    p = [r["prefill_sms"] for r in rows]
    ax2.plot(p, [r["prefill_tok_s"] / 1e3 for r in rows], "o-", label="alone")
    ax2.plot(p, [r["prefill_beside_tok_s"] / 1e3 for r in rows], "s--",
             label=f"beside batch-{res['sizes']['beside_batch']} decodes")
    ax2.axhline(whole["prefill_tok_s"] / 1e3, color="gray", linestyle=":", label="whole GPU")
    ax2.set(xlabel="prefill lane SMs", ylabel="prefill (k tokens/s)", title="Prefill rate", ylim=(0, None))
    ax2.legend(fontsize=8)
    for row in res.get("serve", []):
        times = row["times_ms"]
        ax3.plot(times, [(k + 1) / len(times) for k in range(len(times))],
                 label=f"{row['split']}: p99 {row['p99_ms']:.0f} ms")
    ax3.set(xscale="log", xlabel="step with decodes beside a prompt (ms, log)", ylabel="fraction of steps",
            title="Serving long prompts: what decodes wait")
    ax3.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main(args: argparse.Namespace) -> None:
    """`bench.py split`, with bench.py's flags (--model, --small, --out)."""
    load_kernels_at_start()   # before anything asks CUDA about the device, as a split worker does
    if not torch.cuda.is_available():
        raise SystemExit("bench.py split measures the GPU: no CUDA device found")
    sizes = SMALL_SPLIT if args.small else SplitSizes()
    run_split(args.out, dataclasses.replace(sizes, model=args.model or sizes.model))
