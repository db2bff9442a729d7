"""A serving run's plots: the PNGs `python bench.py` writes beside its results.json and
`python bench.py replot` draws again from that file (docs/benchmark.md lists them), from the
run's summary rows (bench.py:summarize, each with its series' label), its requests' results
(bench.py:Result) and what its cluster did inside (tools/timelines.py). Each figure is headed
by the run's caption.
"""

import math
from collections.abc import Callable
from pathlib import Path

from tools.figures import draw_arrivals
from tools.frontier import rate_text, run_config
from tools.timelines import config_spans, token_budget_of


def plot(out: Path, caption: str, rows: list[dict], results: list, goodput: dict, timelines: list[dict],
         configs: list[dict], rates: list[float], slo: tuple[float, float]) -> list[str]:
    """The PNGs a reader would rather look at than read, under out; their file names.
    Every figure is headed by the run's caption (policies, workloads, model, devices). rates
    and slo (TTFT s, TPOT s): the run's, for the goodput figure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figures, styles = {}, series_styles(rows)
    if len({r["rate"] for r in rows}) > 1:
        figures["latency_throughput_vs_rate.png"] = plot_vs_rate(plt, rows, styles)
        figures["goodput.png"] = plot_goodput(plt, goodput, styles, rates, slo)
    figures["latency_cdf.png"] = plot_cdf(plt, rows, results, styles)
    routed = [r for r in results if r.routed]
    if routed:
        figures["router_choices.png"] = plot_router(plt, routed)
    if timelines:
        figures["roles_over_time.png"] = plot_roles(plt, timelines)
    if configs:
        figures["configs_over_time.png"] = plot_configs(plt, configs, results)
    for name, fig in figures.items():
        fig.suptitle(caption, fontsize=8, color="0.3")
        fig.savefig(out / name, dpi=110, bbox_inches="tight")   # legends outside the axes stay in
        plt.close(fig)
    return list(figures)


# the same in every plot and run. Where two policies' lines coincide the later one is drawn
# over the earlier, thinner: the earlier shows as a wider band of its colour around it.
POLICY_COLORS = {"collocated": "C0", "disaggregated": "C1", "adaptive": "C2", "server": "C4"}
POLICY_WIDTHS = {"collocated": 4.0, "disaggregated": 2.6, "adaptive": 1.3, "server": 2.0}
POLICY_MARKERS = {"collocated": ("o", 10), "disaggregated": ("s", 7), "adaptive": ("^", 5),   # (shape, size)
                  "server": ("D", 6)}   # a server measured over HTTP (--url)
LINE_STYLES = ["-", "--", ":", "-."]


# A policy's runs at a max_num_batched_tokens below its largest (one device's `--policy all`,
# tools/frontier.py:ONE_DEVICE_ALL):
# a colour of their own each, and a line thinner by this per step down, drawn after it.
VARIANT_COLORS = ["C4", "C9", "C5", "C6", "C8"]
VARIANT_THINNER = 0.35


def run_looks(names: list[str]) -> dict[str, tuple[str, float]]:
    """Each run's colour and line width (by its name): its policy's, or for a run below its
    policy's largest max_num_batched_tokens, a colour of VARIANT_COLORS and a thinner line."""
    def max_num_batched_tokens(name: str) -> float:
        return run_config(name)[1] or math.inf
    looks, variants = {}, 0
    for name in names:
        policy = run_config(name)[0]
        below = sum(run_config(m)[0] == policy and max_num_batched_tokens(m) > max_num_batched_tokens(name)
                    for m in names)
        color = VARIANT_COLORS[variants % len(VARIANT_COLORS)] if below else POLICY_COLORS[policy]
        variants += below > 0
        looks[name] = (color, POLICY_WIDTHS[policy] - VARIANT_THINNER * below)
    return looks


def series_styles(rows: list[dict]) -> dict[str, dict]:
    """Each series' look (by its label): the colour and width its run's (run_looks), the line
    style its workload's; drawn in order of width, the widest first."""
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    looks = run_looks(list(dict.fromkeys(r["policy"] for r in rows)))
    styles = {r["label"]: {"color": looks[r["policy"]][0], "linewidth": looks[r["policy"]][1],
                           "linestyle": LINE_STYLES[workloads.index(r["workload"]) % len(LINE_STYLES)]}
              for r in rows}
    return dict(sorted(styles.items(), key=lambda kv: -kv[1]["linewidth"]))


def log_ticks(axis) -> None:
    """Label a log axis at 1, 2 and 5 times each power of ten, as plain numbers (0.2, 1, 5),
    its view widened out to such numbers and to at least three of them: however narrow the
    data's range, a reader has several numbered ticks. Call it once the data is drawn."""
    from matplotlib import ticker
    axis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    axis.set_minor_formatter(ticker.NullFormatter())
    lo, hi = sorted(axis.get_view_interval())
    if not 0 < lo <= hi < math.inf:
        return
    nice = [m * 10.0 ** k for k in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 2)
            for m in (1, 2, 5)]
    lo, hi = max(t for t in nice if t <= lo * 1.0001), min(t for t in nice if t >= hi / 1.0001)
    while sum(lo <= t <= hi for t in nice) < 3:
        hi = min(t for t in nice if t > hi)
    axis.set_view_interval(lo, hi, ignore=True)


def plot_vs_rate(plt, rows: list[dict], styles: dict):
    """E2E p50, E2E p99 and output throughput against the arrival rate, a panel each, a
    line per series; one legend, beside the panels."""
    fig, axes = plt.subplots(1, 3, figsize=(14, 4), layout="constrained")
    for name, style in styles.items():
        mine = sorted((r for r in rows if r["label"] == name), key=lambda r: r["rate"])
        marker, size = POLICY_MARKERS[run_config(mine[0]["policy"])[0]]
        for ax, key in zip(axes, ("e2e_p50", "e2e_p99", "output_tok_s")):
            ax.plot([r["rate"] for r in mine], [r[key] for r in mine], marker=marker, markersize=size,
                    label=name, **style)
    for ax, what in zip(axes, ("median (p50)", "p99")):
        ax.set(ylabel="end-to-end latency (s, log scale)", yscale="log", title=f"{what} latency vs rate")
        log_ticks(ax.yaxis)
    axes[2].set(ylabel="output tokens/s", title="throughput vs rate")
    for ax in axes:
        ax.set(xlabel="arrival rate (requests/s)", xticks=sorted({r["rate"] for r in rows}))
        ax.grid(alpha=0.3)
    axes[2].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig


def plot_goodput(plt, goodput: dict, styles: dict, rates: list[float], slo: tuple[float, float]):
    """Each series' goodput as a bar, its number beside it."""
    fig, ax = plt.subplots(figsize=(6.5, 0.9 + 0.45 * len(goodput)), layout="constrained")
    names = list(goodput)[::-1]   # the first series on top
    bars = ax.barh(names, [goodput[n] for n in names], color=[styles[n]["color"] for n in names], height=0.6)
    ax.bar_label(bars, [f"{goodput[n]:g}" for n in names], padding=3, fontsize=8)
    ax.set(xlabel="goodput (requests/s)", xlim=(0, max(rates) * 1.12),
           title=f"goodput: the highest rate swept (of {', '.join(f'{r:g}' for r in rates)} req/s) with "
                 f">= 90% of requests\ninside the SLO of TTFT <= {slo[0]:g} s and TPOT <= "
                 f"{slo[1] * 1e3:g} ms")
    ax.title.set_fontsize(9)
    return fig


def plot_router(plt, routed: list):
    """Each adaptive request's prompt length against the decodes on its prefill worker when
    it was routed, by the path taken: the rarer path drawn last and larger, so that its
    few points stand out of the many."""
    from matplotlib import ticker
    fig, ax = plt.subplots(figsize=(6.5, 4), layout="constrained")
    paths = [(name, [r for r in routed if (len(r.path) == 2) == two], color)
             for name, two, color in (("collocated", False, "C0"), ("disaggregated", True, "C3"))]
    paths = sorted((p for p in paths if p[1]), key=lambda p: -len(p[1]))   # the commoner first, underneath
    for k, (name, pts, color) in enumerate(paths):
        rare = k > 0
        ax.scatter([r.routed["decode_batch"] for r in pts], [r.prompt_len for r in pts], color=color,
                   s=45 if rare else 14, marker="D" if rare else "o", alpha=1.0 if rare else 0.5,
                   edgecolors="black" if rare else "none", linewidths=0.6, zorder=3 if rare else 2,
                   label=f"{name} ({len(pts)})")
    # Whole counts only, and a view at least half a count past the extremes: a run whose
    # requests all saw one count gets that one tick, not steps of 0.02 around it.
    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True, min_n_ticks=1))
    most = max(r.routed["decode_batch"] for r in routed)
    ax.set_xlim(-max(0.5, 0.05 * most), most + max(0.5, 0.05 * most))
    ax.set(xlabel="sequences decoding on the prefill worker when routed", ylabel="prompt tokens",
           title="the adaptive router's path for each request")
    ax.grid(alpha=0.3)
    ax.legend(title="path (requests)", fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig


ROLE_COLORS = {"both": "C0", "prefill": "C1", "decode": "C2", "split": "C3"}   # roles.py:ROLES
ROLE_NAMES = {"both": "both (prefill and decode)", "prefill": "prefill only", "decode": "decode only",
              "split": "split (prefill and decode on SM partitions)"}


def plot_roles(plt, timelines: list[dict]):
    """Each worker's role in the adaptive policy's regime over each run (one panel a run);
    the phased workload's phases shaded behind; the legend lists the roles that occur."""
    fig, axes = plt.subplots(len(timelines), 1, figsize=(9, 1.4 + 1.2 * len(timelines)), squeeze=False,
                             layout="constrained")
    for ax, tl in zip(axes[:, 0], timelines):
        workers = sorted({int(w) for c in tl["changes"] for w in c["roles"]})
        if tl["workload"] == "phased":   # each phase named in a strip above the bars, every other one shaded
            ax.set_ylim(-0.5, workers[-1] + 0.9)
            phases, phase_s = tl["phases"], tl["phase_s"]
            for k in range(math.ceil(tl["seconds"] / phase_s)):
                start, end = k * phase_s, min((k + 1) * phase_s, tl["seconds"])
                if k % 2:
                    ax.axvspan(start, end, color="0.9")
                # too short a stub left at the end: no room for a name
                if end - start > 0.15 * tl["seconds"]:
                    ax.text((start + end) / 2, 0.97, f"phase {phases[k % len(phases)][0]}", ha="center",
                            va="top", fontsize=7, transform=ax.get_xaxis_transform())
        ends = [c["time"] for c in tl["changes"][1:]] + [tl["seconds"]]
        for change, end in zip(tl["changes"], ends):
            for w, role in change["roles"].items():
                ax.barh(int(w), end - change["time"], left=change["time"], color=ROLE_COLORS[role],
                        height=0.6)
        regimes = [c["regime"] for c in tl["changes"]]
        held = (f"regime '{regimes[0]}' throughout" if len(set(regimes)) == 1
                else f"{len(regimes) - 1} regime changes")
        ax.set(xlim=(0, tl["seconds"]), title=f"the adaptive policy's worker roles, {tl['workload']} at "
               f"{rate_text(tl['rate'])}: {held}")
        ax.set_yticks(workers, [f"worker {w}" for w in workers])
    axes[-1, 0].set(xlabel="seconds into the run")
    seen = {role for tl in timelines for c in tl["changes"] for role in c["roles"].values()}
    axes[0, 0].legend(handles=[plt.Rectangle((0, 0), 1, 1, color=ROLE_COLORS[r], label=ROLE_NAMES[r])
                               for r in ROLE_COLORS if r in seen],
                      title="role", fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig


WHOLE_GPU = "#999999"
SPLIT_COLORS = ["#1F3F73", "#2F5A9E", "#4C72B0", "#7C9CD0", "#A9C0E6"]   # by decode SMs, fewest darkest
BUDGET_MENU = (256, 512, 1024, 2048, 4096, 8192)   # the controllers' budgets, the colour scale's ends


def budget_color(plt, token_budget: int):
    """A token budget's colour: light for small budgets, dark for large, on a log scale."""
    k = math.log2(max(token_budget, 1) / BUDGET_MENU[0]) / math.log2(BUDGET_MENU[-1] / BUDGET_MENU[0])
    return plt.get_cmap("YlOrBr")(0.2 + 0.7 * min(1.0, max(0.0, k)))


def plot_configs(plt, configs: list[dict], results: list):
    """For each adaptive run with its controllers' log (config_timeline): on top the
    requests arriving per second, by the mix (phase) that drew them; under it one band
    per worker, its upper half the SM split it held (grey: the whole GPU; blue: prefill
    SMs / decode SMs), its lower half the step's token budget (darker: larger), each
    labelled where there is room; the phased workload's phase boundaries dotted across."""
    heights = [h for tl in configs for h in (2.0, 0.8 * len({c["worker"] for c in tl["changes"]}))]
    fig, axes = plt.subplots(len(heights), 1, figsize=(10, 0.6 + sum(heights)), height_ratios=heights,
                             layout="constrained", squeeze=False)
    for k, tl in enumerate(configs):
        top, bands = axes[2 * k, 0], axes[2 * k + 1, 0]
        bands.sharex(top)
        mine = [(r.arrival, r.phase or r.workload) for r in results
                if (r.policy, r.workload, r.rate) == (tl["policy"], tl["workload"], tl["rate"])]
        draw_arrivals(top, mine, tl["seconds"], bin_s=1.0 if tl["seconds"] > 30 else 0.5, loc="upper left",
                      bbox_to_anchor=(1.01, 1.0))
        changes = len(tl["changes"]) - len({c["worker"] for c in tl["changes"]})
        top.set_title(f"the adaptive controllers' configuration, {tl['workload']} at "
                      f"{rate_text(tl['rate'])}: {changes} changes over {tl['seconds']:.1f} s", fontsize=10)
        draw_config_bands(plt, bands, tl)
        if tl["workload"] == "phased":
            for ax in (top, bands):
                for t in [i * tl["phase_s"] for i in range(1, math.ceil(tl["seconds"] / tl["phase_s"]))]:
                    ax.axvline(t, color="black", linestyle=":", linewidth=0.8)
        top.set_xlim(0, tl["seconds"])
        top.tick_params(labelbottom=False)   # the bands under it carry the times
    axes[-1, 0].set_xlabel("seconds into the run")
    return fig


def draw_config_bands(plt, ax, tl: dict) -> None:
    """config_timeline's changes as a band per worker (plot_configs), with their legends."""
    workers = sorted({c["worker"] for c in tl["changes"]})
    splits = sorted({tuple(c["sm_split"]) for c in tl["changes"] if c["sm_split"]}, key=lambda s: s[1])
    budgets = sorted({token_budget_of(c) for c in tl["changes"]})
    spans = config_spans(tl)
    for w in workers:
        y = len(workers) - 1 - workers.index(w)   # worker 0 on top
        mine = [(c, end) for c, end in spans if c["worker"] == w]
        for (t0, t1, split), base in ((s, y + 0.02) for s in held_runs(mine, lambda c: c["sm_split"])):
            color = WHOLE_GPU if split is None else \
                SPLIT_COLORS[splits.index(tuple(split)) % len(SPLIT_COLORS)]
            label_span(ax, t0, t1, base, color, "whole GPU" if split is None else f"{split[0]}/{split[1]}",
                       "white", tl["seconds"])
        for t0, t1, token_budget in held_runs(mine, token_budget_of):
            label_span(ax, t0, t1, y - 0.45, budget_color(plt, token_budget), str(token_budget),
                       "white" if token_budget >= 2048 else "black", tl["seconds"])
    ax.set_yticks([t for y in range(len(workers))[::-1] for t in (y + 0.235, y - 0.235)],
                  [t for w in workers for t in (f"worker {w} SMs", f"worker {w} budget")], fontsize=8)
    ax.set_ylim(-0.55, len(workers) - 0.45)
    patches = [plt.Rectangle((0, 0), 1, 1, color=WHOLE_GPU, label="whole GPU")] + [
        plt.Rectangle((0, 0), 1, 1, color=SPLIT_COLORS[i % len(SPLIT_COLORS)], label=f"{p}/{d}")
        for i, (p, d) in enumerate(splits)]
    ax.add_artist(ax.legend(handles=patches, title="SM split\n(prefill/decode)", fontsize=7, title_fontsize=7,
                            loc="lower left", bbox_to_anchor=(1.01, 0.0)))
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=budget_color(plt, b), label=str(b))
                       for b in budgets], title="token budget\n(tokens a step)", fontsize=7,
              title_fontsize=7,
              loc="lower left", bbox_to_anchor=(1.16, 0.0), ncol=1 + (len(budgets) > 3))


def held_runs(spans: list[tuple[dict, float]], value: Callable[[dict], object]
              ) -> list[tuple[float, float, object]]:
    """A worker's config_spans as (start, end, value(change)), a span per run of one value."""
    runs = []
    for c, end in spans:
        if runs and runs[-1][2] == value(c):
            runs[-1] = (runs[-1][0], end, value(c))
        else:
            runs.append((c["time"], end, value(c)))
    return runs


def label_span(ax, t0: float, t1: float, base: float, color, text: str, ink: str, seconds: float) -> None:
    """A bar of a band from t0 to t1, labelled text where it is wide enough to hold it."""
    ax.broken_barh([(t0, t1 - t0)], (base, 0.43), color=color)
    if t1 - t0 > 0.012 * seconds * (len(text) + 2):   # about a character's width at 10 inches
        ax.text((t0 + t1) / 2, base + 0.215, text, ha="center", va="center", fontsize=8, color=ink)


def plot_cdf(plt, rows: list[dict], results: list, styles: dict):
    """The E2E latency CDF of every series at the highest rate: colour the policy, line
    style the workload."""
    fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
    top = max(r["rate"] for r in rows)
    for r in rows:
        e2e = sorted(x.e2e for x in results
                     if (x.policy, x.workload, x.rate) == (r["policy"], r["workload"], top)
                     and x.error is None)
        if r["rate"] == top and e2e:   # (a phase's row has no requests of its own name)
            ax.plot(e2e, [(i + 1) / len(e2e) for i in range(len(e2e))], label=r["label"],
                    **styles[r["label"]])
    ax.set(xlabel="end-to-end latency (s, log scale)", ylabel="fraction of requests", xscale="log",
           ylim=(0, 1.02), title=f"end-to-end latency CDF at {rate_text(top)}")
    log_ticks(ax.xaxis)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig
