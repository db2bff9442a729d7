"""What a run's cluster did inside, read off its central scheduler for bench.py's
results.json: each worker's configuration, its SM split and token budget, as its controller
changed it (config_timeline), every step the workers timed (timed_steps), and the planner's
regime and each worker's role (regime_timeline); then how long each configuration held
(held_shares) and the lines under the table that say so (print_timelines). Times count in
seconds from the run's start.
"""


def config_timeline(cluster, log: list, held: dict, start: float, seconds: float) -> dict:
    """Each worker's configuration over a run (times in s after its start): the one it held
    when the run started (its last change before, or the engine's own: held), then every
    change during it. The log's times (cluster.py:ConfigChange) count from the cluster's
    start (cluster.started, on perf_counter's clock)."""
    origin = cluster.started - start
    first = {w: {"time": 0.0, "worker": w, "sm_split": held["sm_split"], "token_budget": held["token_budget"]}
             for w in range(len(cluster.devices))}
    changes = []
    for c in sorted(log, key=lambda c: c.time_s):
        t = c.time_s + origin
        row = {"time": max(0.0, t), "worker": c.worker,
               "sm_split": None if c.sm_split is None else list(c.sm_split), "token_budget": c.token_budget}
        if t <= 0:
            first[c.worker] = row
        elif t <= seconds:
            changes.append(row)
    return {"seconds": seconds, "changes": list(first.values()) + changes}


def timed_steps(cluster, start: float, seconds: float) -> list[list]:
    """Every step the workers timed during a run (cluster.step_log), what step models learn
    from: [s after the run's start, worker, decodes, context tokens, prompt tokens, ms,
    sm_split or None]."""
    origin = cluster.started - start
    return [[round(t + origin, 4), w, s.decodes, s.context_tokens, s.prefill_tokens, round(s.ms, 3),
             None if s.sm_split is None else list(s.sm_split)]
            for t, w, s in cluster.step_log if 0 < t + origin <= seconds]


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


def token_budget_of(change: dict) -> int:
    """A change's token budget (config_timeline's), also in a results.json recorded before
    ConfigChange.budget became ConfigChange.token_budget, whose changes call it "budget"."""
    return change["token_budget"] if "token_budget" in change else change["budget"]


def config_text(sm_split: list[int] | None, token_budget: int) -> str:
    """A configuration as the notes name it: its SM split (or the whole GPU) and token budget."""
    return f"{'whole GPU' if sm_split is None else f'{sm_split[0]}/{sm_split[1]} SMs'} @{token_budget}"


def held_shares(timeline: dict) -> dict[int, dict[str, float]]:
    """Each worker's configurations (config_text) over a run of config_timeline, by the share
    of the run it held each, the longest first."""
    shares: dict[int, dict[str, float]] = {}
    for c, end in config_spans(timeline):
        mine = shares.setdefault(c["worker"], {})
        text = config_text(c["sm_split"], token_budget_of(c))
        mine[text] = mine.get(text, 0.0) + (end - c["time"]) / max(timeline["seconds"], 1e-9)
    return {w: dict(sorted(s.items(), key=lambda kv: -kv[1])) for w, s in sorted(shares.items())}


def config_spans(timeline: dict) -> list[tuple[dict, float]]:
    """Each change of config_timeline with the time it lasted to (the worker's next change,
    or the run's end)."""
    ends, spans = {}, []
    for c in reversed(timeline["changes"]):   # in time order per worker: a change ends at the next
        spans.append((c, ends.get(c["worker"], timeline["seconds"])))
        ends[c["worker"]] = c["time"]
    return spans[::-1]


def print_timelines(timelines: list[dict], configs: list[dict]) -> None:
    """The regimes the planner went through, and what each worker's controller held for how
    much of the run (the plots and results.json say more)."""
    for tl in timelines:   # when the planner changed the regime
        print(f"{tl['policy']} regimes, {tl['workload']} at {tl['rate']:g} req/s: "
              + ", ".join(f"{c['time']:.1f} s {c['regime']}" for c in tl["changes"]))
    for tl in configs:   # what each worker's controller held, for how much of the run
        print(f"{tl['policy']} configurations, {tl['workload']} at {tl['rate']:g} req/s, "
              f"{len(tl['changes']) - len(held_shares(tl))} changes: "
              + "; ".join(f"worker {w} " + ", ".join(f"{text} {share:.0%}" for text, share in shares.items())
                          for w, shares in held_shares(tl).items()))
