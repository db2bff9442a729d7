"""The docs' figures, drawn from the code's own structures and from measured results:

  kv_fork.png      block tables and reference counts of a fork, then its copy-on-write
                   (kv_cache.BlockManager, docs/kv_cache.md's worked example)
  step_batch.png   the batches of docs/scheduling.md's worked example (scheduler.Scheduler)
  handoff.png      a handoff on a timeline, from the profile two H200s measured
                   (H200X2_PROFILE below) and the messages it sends (messages.py)
  regimes.png      the regimes the planner chose over a phased run of bench.py on one
                   H200 (REGIMES_RUN below)
  split_gpu.png    one H200's SMs split for each entry of the menu, with what each lane
                   measured (SPLIT_RUN below: bench.py split's table)
  core.png         the plain engine's three classes and the features plugged into them:
                   each feature's subclasses and the core methods they change, read from
                   the classes themselves (config.FEATURES, handoff.py)

    python bench.py figures      writes them into docs/figures/ (--out: elsewhere)

Both languages' pages show the same PNGs; labels are in English.
"""

import argparse
import inspect
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after the backend is chosen
from matplotlib.patches import FancyArrowPatch, Rectangle

from nanopd import handoff, lanes, speculate
from nanopd.engine import Engine
from nanopd.kv_cache import BlockManager
from nanopd.request import Request, RequestMetrics, SamplingParams, Sequence
from nanopd.runner import ModelRunner
from nanopd.scheduler import Scheduler

ROOT = Path(__file__).resolve().parent.parent   # the repository: the results read, the docs written
FIGURES = ROOT / "docs" / "figures"
# The runs the figures read (results/README.md names each run's command, machine and date)
REGIMES_RUN = ROOT / "results" / "h200" / "split_phased17" / "adaptive_bbc1236.json"
SPLIT_RUN = ROOT / "results" / "h200" / "split.json"
COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860"]
PREFILL, DECODE, IDLE = "#DD8452", "#4C72B0", "#DDDDDD"


def save(fig, out: Path, name: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / name, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out / name


# ----------------------------------------------------------------------------- the KV cache


FORK_BLOCKS = 8   # the physical blocks the fork figure shows


def fork_states() -> list[tuple[str, dict[str, list[int]], dict[int, int]]]:
    """docs/kv_cache.md's example on a real BlockManager: a 6-token prompt (block size 4)
    forked for n = 3, then every sequence writes position 6. Per moment: its title, each
    sequence's block table and each used block's reference count."""
    bm = BlockManager(num_blocks=FORK_BLOCKS, block_size=4, watermark=0.0, enable_prefix_caching=False)
    parent, _ = bm.allocate(list(range(6)))
    tables = {"parent": parent, "child 1": bm.fork(parent), "child 2": bm.fork(parent)}

    def snapshot(title: str) -> tuple[str, dict[str, list[int]], dict[int, int]]:
        used = sorted({b for t in tables.values() for b in t})
        return title, {k: list(v) for k, v in tables.items()}, {b: bm.blocks[b].ref_count for b in used}
    states = [snapshot("after fork: three tables, two shared blocks")]
    copies = [bm.append_slots(tables[name], 6, 7) for name in tables]   # each writes position 6, in turn
    states.append(snapshot("after each writes position 6: copies " + ", ".join(f"{s}->{d}" for c in copies
                                                                               for s, d in c)))
    return states


def draw_kv_fork(out: Path) -> Path:
    """Two panels, before and after copy-on-write: each sequence's block table (top) points
    at physical blocks (bottom), each labelled with its reference count."""
    states = fork_states()
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.6), layout="constrained")
    for ax, (title, tables, refs) in zip(axes, states):
        for row, (name, table) in enumerate(tables.items()):
            y = 2.6 - 0.75 * row
            ax.text(-0.2, y + 0.25, name, ha="right", va="center", fontsize=10)
            for i, b in enumerate(table):
                ax.add_patch(Rectangle((i * 0.9, y), 0.8, 0.5, fc=COLORS[row], alpha=0.85))
                ax.text(i * 0.9 + 0.4, y + 0.25, str(b), ha="center", va="center", color="white", fontsize=10)
                ax.add_patch(FancyArrowPatch((i * 0.9 + 0.4, y), (3 + b * 0.9 + 0.4, 0.5),
                                             arrowstyle="->", color=COLORS[row], alpha=0.5, mutation_scale=8))
        for b in range(FORK_BLOCKS):
            held = b in refs
            ax.add_patch(Rectangle((3 + b * 0.9, 0), 0.8, 0.5, fc="#555555" if held else IDLE))
            ax.text(3 + b * 0.9 + 0.4, 0.25, str(b), ha="center", va="center",
                    color="white" if held else "black")
            if held:
                ax.text(3 + b * 0.9 + 0.4, -0.3, f"ref {refs[b]}", ha="center", fontsize=9)
        ax.text(2.9, 0.25, "physical blocks", ha="right", va="center", fontsize=10)
        ax.set_title(title, fontsize=10)
        ax.set_xlim(-1.3, 10.4)
        ax.set_ylim(-0.6, 3.3)
        ax.axis("off")
    fig.suptitle("Block tables and reference counts (block size 4, a 6-token prompt, n = 3)", fontsize=11)
    return save(fig, out, "kv_fork.png")


# ----------------------------------------------------------------------------- a step's batch


def worked_example_steps() -> list[list[tuple[str, int, bool, bool]]]:
    """docs/scheduling.md's worked example on a real Scheduler (budget 8 tokens, 3 seats):
    prompts of 5, 12 and 3 tokens, A, B, C in that order. Per step: (request, tokens it
    computes, whether the step samples its next token, whether they are prompt tokens)."""
    sched = Scheduler(BlockManager(64, 4, watermark=0.0), max_num_seqs=3, max_num_batched_tokens=8)
    names = {}
    for name, length in (("A", 5), ("B", 12), ("C", 3)):
        seq = Sequence(Request(len(names), None, [0] * length, SamplingParams(), RequestMetrics(0.0)), 0,
                       [0] * length, length)
        names[id(seq)] = name
        sched.add(seq)
    steps = []
    for _ in range(4):
        batch = sched.schedule()
        sampled = [n == seq.num_pending for seq, n in zip(batch.seqs, batch.num_new)]
        steps.append([(names[id(s)], n, done, s.num_computed < s.num_prompt_tokens)
                      for s, n, done in zip(batch.seqs, batch.num_new, sampled)])
        sched.computed(batch)
        for seq, done in zip(batch.seqs, sampled):
            if done:
                seq.token_ids.append(0)   # the token the step samples
    return steps


def draw_step_batch(out: Path) -> Path:
    """One bar per step: each sequence's tokens in it, a decode's one token or a prompt's
    chunk, against the token budget."""
    steps = worked_example_steps()
    color = {"A": COLORS[0], "B": COLORS[1], "C": COLORS[2]}
    fig, ax = plt.subplots(figsize=(8, 3.2), layout="constrained")
    for i, step in enumerate(steps):
        left = 0
        for name, n, sampled, prompt in step:
            ax.barh(i, n, left=left, color=color[name], edgecolor="white", height=0.6,
                    hatch="//" if prompt else None)
            label = f"{name} {n}" + ("*" if sampled else "")
            ax.text(left + n / 2, i, label, ha="center", va="center", color="black", fontsize=10,
                    bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.9})
            left += n
    ax.axvline(8, color="black", linestyle="--", linewidth=1)
    ax.text(8.05, len(steps) - 0.6, "token budget", fontsize=9, va="center")
    ax.set_yticks(range(len(steps)), [f"step {i + 1}" for i in range(len(steps))])
    ax.invert_yaxis()
    ax.set_xlim(0, 9.6)
    ax.set_xlabel("tokens computed in the step (hatched: prompt tokens, a chunk; plain: a decode; *: the "
                  "step samples that sequence's next token)", fontsize=9)
    ax.set_title("A step takes decodes first, then prompt chunks, within the budget (scheduler.Scheduler)",
                 fontsize=10)
    return save(fig, out, "step_batch.png")


# ----------------------------------------------------------------------------- the handoff


# The start-up profile two H200s measured (python -m nanopd.profiler; results/README.md), in ms
H200X2_PROFILE = {"alpha0": 2.09, "alpha": 0.02202, "alpha2": 8.21e-7, "beta": 5.046,
                  "transfer_rate": 0.00422}


def draw_handoff(out: Path, prompt: int = 2048, steps: int = 6) -> Path:
    """A 2048-token request handed from a prefill to a decode worker, on a time axis in ms:
    its prefill (alpha0 + alpha L + alpha2 L^2), the KV pulled at the measured handoff rate
    (transfer_rate x L), then decode steps (beta each), with the messages between them."""
    p = H200X2_PROFILE
    prefill = p["alpha0"] + p["alpha"] * prompt + p["alpha2"] * prompt ** 2
    pull = p["transfer_rate"] * prompt
    fig, ax = plt.subplots(figsize=(10, 2.8), layout="constrained")
    ax.broken_barh([(0, prefill)], (2, 0.6), color=PREFILL)
    ax.text(prefill / 2, 2.3, f"prefill {prompt} tokens, {prefill:.0f} ms", ha="center", va="center",
            color="white")
    ax.broken_barh([(prefill, pull)], (2, 0.6), color="#BBBBBB")
    ax.text(prefill + pull / 2, 2.85, "blocks parked", ha="center", fontsize=9)
    ax.broken_barh([(prefill, pull)], (0, 0.6), color="#8C8C8C")
    ax.text(prefill + pull / 2, -0.35, f"pull {pull:.1f} ms", ha="center", fontsize=9)
    ax.broken_barh([(prefill + pull + k * p["beta"], p["beta"] * 0.95) for k in range(steps)], (0, 0.6),
                   color=DECODE)
    ax.text(prefill + pull + steps * p["beta"] / 2, 0.3, f"decode steps, {p['beta']:.1f} ms each",
            ha="center", va="center", color="white", fontsize=9)
    for t, y0, y1, label, side in ((prefill, 2, 1.3, "Handoff(Import)", -1),
                                   (prefill, 1.1, 0.6, "Import", -1),
                                   (prefill + pull, 0.6, 1.1, "Imported", 1),
                                   (prefill + pull, 1.3, 2, "Release", 1)):
        ax.annotate("", xy=(t, y1), xytext=(t, y0), arrowprops={"arrowstyle": "->", "color": "black"})
        ax.text(t + 0.4 * side, (y0 + y1) / 2, label, fontsize=8, va="center",
                ha="left" if side > 0 else "right")
    ax.text(prefill, 2.75, "first token ", ha="right", fontsize=9)
    ax.set_yticks([0.3, 1.2, 2.3], ["decode worker", "central scheduler", "prefill worker"])
    ax.set_xlabel("ms after the prompt's first chunk starts (profile of two H200s: "
                  "results/h200x2/profile.txt)")
    ax.set_title("The KV handoff: the first token comes from the prefill worker, the rest from the decode "
                 "worker", fontsize=10)
    ax.set_xlim(0, prefill + pull + steps * p["beta"] + 2)
    ax.set_ylim(-0.6, 3.1)
    return save(fig, out, "handoff.png")


# ----------------------------------------------------------------------------- regimes and splits


def phase_rates(requests: list[dict]) -> dict[str, float]:
    """Each phase's mean arrival rate over the run (requests per second of that phase's
    time): its requests over the seconds the 1 s bins it arrived in cover."""
    seconds = {}
    for r in requests:
        seconds.setdefault(r["phase"], set()).add(int(r["arrival"]))
    return {phase: sum(r["phase"] == phase for r in requests) / len(s) for phase, s in seconds.items()}


MIX_COLORS = {"long": PREFILL, "prefill-heavy": PREFILL, "sharegpt": COLORS[2]}   # others: COLORS in turn


def draw_arrivals(ax, arrivals: list[tuple[float, str]], end: float, labels: dict[str, str] | None = None,
                  bin_s: float = 1.0, **legend) -> None:
    """Requests arriving per second over a run, in bins of bin_s seconds, stacked by the mix
    that drew them (the workload, or the phase of bench.py's phased one), a colour each;
    the legend names each mix (labels, or its name) with its mean rate while it arrived
    (its requests over the bins they arrived in), placed by legend (default: upper right)."""
    mixes = list(dict.fromkeys(mix for _, mix in arrivals))
    bottom = [0.0] * (int(end / bin_s) + 1)
    for k, mix in enumerate(mixes):
        bins = [0.0] * len(bottom)
        for t, m in arrivals:
            bins[min(int(t / bin_s), len(bins) - 1)] += (m == mix) / bin_s
        rate = sum(m == mix for _, m in arrivals) / (sum(b > 0 for b in bins) * bin_s)
        ax.bar([i * bin_s for i in range(len(bins))], bins, width=bin_s, bottom=bottom, align="edge",
               color=MIX_COLORS.get(mix, COLORS[(k + 3) % len(COLORS)]),
               label=f"{(labels or {}).get(mix, mix)}: {rate:.0f} req/s on average")
        bottom = [b + x for b, x in zip(bottom, bins)]
    ax.legend(fontsize=8, **(legend or {"loc": "upper right"}))
    ax.set_ylabel("requests arriving\nin each second" if bin_s == 1 else "requests arriving\nper second")


def draw_regimes(out: Path, run: Path = REGIMES_RUN) -> Path:
    """The requests arriving per second (1 s bins, by the phase that drew them) over the
    run, and under them the regime the planner held: the whole GPU or a split (prefill SMs
    / decode SMs). The title gives the run's --rate, the long prompts' rate (the other
    phase's is a multiple of it: bench.py's PHASES); the legend each phase's rate as it
    arrived."""
    data = json.loads(run.read_text())
    requests, changes = data["requests"], data["regimes"][0]["changes"]
    end = max(r["arrival"] + r["e2e"] for r in requests)
    rates = phase_rates(requests)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 3.8), sharex=True, height_ratios=[3, 1],
                                      layout="constrained")
    draw_arrivals(top, [(r["arrival"], r["phase"]) for r in requests], end,
                  {"long": "long prompts (1024-2048 tokens)",
                   "sharegpt": "ShareGPT-like (median 256 tokens)"})
    top.set_title(f"The planner's regime on one H200 over bench.py's phased workload, --rate "
                  f"{requests[0]['rate']:g} (the long\nprompts' rate; the ShareGPT-like phase arrives "
                  f"{rates['sharegpt'] / rates['long']:.1f}x as fast), {len(requests)} requests over "
                  f"{max(r['arrival'] for r in requests):.0f} s", fontsize=10)
    for change, nxt in zip(changes, changes[1:] + [{"time": end}]):
        split = change["regime"] != "1 both"
        bottom.broken_barh([(change["time"], nxt["time"] - change["time"])], (0, 1),
                           color=DECODE if split else "#999999", edgecolor="white")
        bottom.text((change["time"] + nxt["time"]) / 2, 0.5,
                    change["regime"].replace("1 ", "").replace("both", "whole GPU"), ha="center", va="center",
                    color="white", fontsize=9)
    bottom.set_yticks([])
    bottom.set_xlabel("seconds into the run")
    bottom.set_xlim(0, end)
    return save(fig, out, "regimes.png")


def draw_split_gpu(out: Path, run: Path = SPLIT_RUN) -> Path:
    """Each split of bench.py split's table as a bar of the GPU's SMs, prefill lane then
    decode lane, labelled with the decode step at batch 64 beside a prefill and the prefill
    rate beside decodes that the lanes measured."""
    rows = json.loads(run.read_text())["rows"]
    whole, rows = next(r for r in rows if r["split"] == "whole"), [r for r in rows if r["split"] != "whole"]
    fig, ax = plt.subplots(figsize=(9, 0.5 + 0.45 * len(rows)), layout="constrained")
    for i, r in enumerate(rows):
        ax.barh(i, r["prefill_sms"], color=PREFILL, height=0.7)
        ax.barh(i, r["decode_sms"], left=r["prefill_sms"], color=DECODE, height=0.7)
        ax.text(r["prefill_sms"] / 2, i, f"{r['prefill_beside_tok_s'] / 1e3:.1f}k tok/s", ha="center",
                va="center", color="white", fontsize=8)
        ax.text(r["prefill_sms"] + r["decode_sms"] / 2, i, f"{r['decode_b64_beside_ms']:.1f} ms", ha="center",
                va="center", color="white", fontsize=8)
    ax.set_yticks(range(len(rows)), [f"{r['prefill_sms']}/{r['decode_sms']}" for r in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, 132)
    ax.set_xlabel("SMs of one H200 (orange: prefill lane, its prompt tokens/s beside decodes; blue: decode "
                  "lane, its batch-64 step beside a prefill)\nthe whole GPU, one lane at a time: "
                  f"{whole['prefill_tok_s'] / 1e3:.1f}k tok/s, a batch-64 step "
                  f"{whole['decode_b64_ms']:.1f} ms", fontsize=8)
    ax.set_title("One GPU, two lanes: each split bench.py split measures, and what its lanes did",
                 fontsize=10)
    return save(fig, out, "split_gpu.png")


# ----------------------------------------------------------------------------- the core and its features


CORE = [Engine, Scheduler, ModelRunner]   # the plain engine's classes, left to right
# each feature: its file, what it does, its classes (each extends the core class of its column)
PLUGGED = [("speculate.py", "speculative decoding",
            [speculate.SpecEngine, speculate.SpecScheduler, speculate.SpecRunner]),
           ("lanes.py", "a split worker's two lanes", [lanes.SplitEngine, None, lanes.SplitRunner]),
           ("handoff.py", "the KV handoff (every worker's)",
            [handoff.HandoffEngine, handoff.HandoffSeats, None])]


def changed(feature: type, core: type) -> list[str]:
    """The methods of core that feature's class defines again: where it plugs in."""
    return sorted(name for name, value in vars(feature).items()
                  if inspect.isfunction(value) and name in vars(core) and not name.startswith("__"))


def draw_box(ax, x: float, y: float, w: float, h: float, title: str, names: list[str], color: str,
             per_line: int = 2) -> None:
    """A class as a box: its title, then names per_line to a line."""
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="black", linewidth=0.8))
    ax.text(x + 0.1, y + h - 0.12, title, fontsize=9, fontweight="bold", va="top")
    lines = [", ".join(names[i:i + per_line]) for i in range(0, len(names), per_line)]
    ax.text(x + 0.1, y + h - 0.45, "\n".join(lines), fontsize=7.5, va="top", family="monospace")


def draw_core(out: Path) -> Path:
    """The core's three classes in a row, under the LLM front and beam search; each feature a
    row below, its classes under the core classes they extend, with the methods they change."""
    fig, ax = plt.subplots(figsize=(13, 7.5), layout="constrained")
    w, gap, h, pitch, core_h = 4.5, 0.3, 1.3, 1.55, 2.0
    xs = [i * (w + gap) for i in range(len(CORE))]
    top = 0.4 + pitch * len(PLUGGED)
    draw_box(ax, 0, top + core_h + 0.25, xs[-1] + w, 0.8,
             "llm.py: LLM and its Driver (generate, chat, the server's streams)",
             ["beams.py: beam search on top, every live beam a plain one-token request a step"], "#EEEEEE")
    for x, cls in zip(xs, CORE):
        hooks = sorted({name for _, _, classes in PLUGGED for c in classes
                        if c is not None and issubclass(c, cls) for name in changed(c, cls)})
        title = f"{cls.__module__.split('.')[-1]}.py: {cls.__name__}"
        draw_box(ax, x, top, w, core_h, title, hooks, "#C9D7EE")
    for row, (file, what, classes) in enumerate(PLUGGED):
        y = top - pitch * (row + 1)
        ax.text(-0.15, y + h / 2, f"{file}\n{what}", fontsize=8.5, ha="right", va="center")
        for x, cls, core in zip(xs, classes, CORE):
            if cls is not None:
                draw_box(ax, x, y, w, h, f"{cls.__name__} ({core.__name__}'s subclass)", changed(cls, core),
                         "#F3D9C4")
    ax.set_xlim(-2.7, xs[-1] + w + 0.1)
    ax.set_ylim(top - pitch * len(PLUGGED) - 0.1, top + core_h + 1.1)
    ax.axis("off")
    ax.set_title("The plain engine (blue: the methods features change) knows no feature; each feature's "
                 "classes (below) subclass the column's core class, changing the methods listed", fontsize=10)
    return save(fig, out, "core.png")


DRAW = [draw_kv_fork, draw_step_batch, draw_handoff, draw_regimes, draw_split_gpu, draw_core]


def add_flags(p: argparse.ArgumentParser) -> None:
    """`bench.py figures`' flag."""
    p.add_argument("--out", type=Path, default=FIGURES, help="folder for the PNGs (default: docs/figures)")


def main(args: argparse.Namespace) -> None:
    """`bench.py figures`: every figure into args.out."""
    for draw in DRAW:
        print("wrote", draw(Path(args.out)))
