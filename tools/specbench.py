"""`python bench.py speculative`: speculative decoding (speculate.py) on Qwen3-8B (random
weights), each case against plain decoding of the same requests in the same run:

  acceptance  output tokens/s at batch 1 and 32, k = 4, with a drafter that proposes the
              model's own greedy tokens, each right with probability a (0, 0.5, 0.8, 0.9):
              random weights make a real drafter's acceptance meaningless, so the bench
              sets it; a = 0 is what speculation costs when every draft misses
  crossover   the speed-up against the batch (1 to 128) at a = 0.8: where checking drafts
              costs more than it keeps
  ngram       prompt lookup on the preset as it is, one candidate a step and three (on
              copy-on-write branches), its acceptance and speed-up: a model with random
              weights falls into loops, which prompt lookup finds, so these say little of
              a trained model
  draft       draft_model: the qwen3-0.6b preset drafting for the model at batch 1 and
              32; random weights, so its drafts miss: what its passes cost
  verify      (CUDA) a check's cost at batch 1, in plain steps (a check: a drafting
              step's round, speculate.py): the whole check (the crossover's batch-1 case)
              against its decode graph alone (k + 1 rows against one, GPU time): the
              difference is the host's work, which a drafting step's first round cannot
              hide behind the step before it; and how long that graph, launched on an idle
              GPU, waits for its own launch

Every case also checks that speculation gave plain greedy decoding's tokens. Results are
printed and, with --out, written as JSON (a plot beside it, .png). --small runs at toy
sizes, seconds, to check that it runs; its numbers mean nothing. Every case drafts at
any batch (disable_by_batch_size None), so the crossover is measured, not the default
that it sets (config.py:SpeculativeConfig).
"""

import argparse
import dataclasses
import gc
import json
import random
import time

import torch

from nanopd import LLM, SamplingParams
from nanopd.speculate import DeviceDraft, PerSequence
from tools.microbench import launch_wait_ms, time_ms


@dataclasses.dataclass
class SpecSizes:
    model: str = "qwen3-8b"
    k: int = 4
    prompt_len: int = 128
    output_len: int = 128
    batches: tuple[int, ...] = (1, 32)                 # acceptance
    acceptances: tuple[float, ...] = (0.0, 0.5, 0.8, 0.9)
    crossover: tuple[int, ...] = (1, 4, 8, 16, 32, 64, 128)
    crossover_a: float = 0.8
    draft: str = "qwen3-0.6b"                         # draft_model's model
    # None: what fits; --small sizes its own (beside other GPU work)
    num_kv_blocks: int | None = None


SMALL_SPEC = SpecSizes(model="tiny", prompt_len=16, output_len=16, batches=(1, 2), acceptances=(0.0, 0.8),
                       crossover=(1, 8), draft="tiny", num_kv_blocks=512)   # 8: a graph for a verify step


BRANCHES = 3   # the ngram case with branches: up to 3 candidates a step (docs/speculative.md)


class OracleDrafter:
    """Drafts the model's own greedy continuation of each prompt (a script: the tokens of an
    earlier run), each token right with probability a and otherwise another token (so a step
    keeps each next draft with probability a, as the acceptance arithmetic assumes). Whether
    the draft at a position is right is drawn once per (prompt, position), here: every run
    with the same script drafts the same, step for step, and a draft costs a slice, as
    cheap as prompt lookup (a drafting step waits for its drafter)."""

    def __init__(self, continuations: dict[tuple, list[int]], prompt_len: int, a: float, vocab: int):
        self.prompt_len, self.table = prompt_len, None
        self.drafts = {key: [t if random.Random(hash((key, j))).random() < a else (t + 1) % vocab
                             for j, t in enumerate(right)] for key, right in continuations.items()}

    def __call__(self, tokens: list[int], k: int, branches: int = 1) -> list[list[int]]:
        done = len(tokens) - self.prompt_len
        return [self.drafts[tuple(tokens[:self.prompt_len])][done:done + k]]

    def on_device(self, seqs: list, upload) -> DeviceDraft:
        """The same drafts on the device, for a drafting step's later rounds: a lookup in the
        table of every prompt's drafts, uploaded at the first step (a script's end repeats
        its last draft: those positions are past max_tokens)."""
        if self.table is None:
            width = max(map(len, self.drafts.values()))
            self.row = {key: i for i, key in enumerate(self.drafts)}
            self.table = upload([t for d in self.drafts.values() for t in d + d[-1:] * (width - len(d))],
                                torch.int64).view(len(self.drafts), width)
        rows = upload([self.row[tuple(s.token_ids[:self.prompt_len])] for s in seqs], torch.int64)

        def draft(history: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
            at = (lengths - self.prompt_len)[:, None] + torch.arange(k, device=lengths.device)
            return self.table[rows[:, None], at.clamp(max=self.table.shape[1] - 1)]
        return draft


ORACLE_PASSES = 3   # untimed runs in which the oracle's script becomes speculation's own tokens


def learn_script(llm: LLM, prompts: list[list[int]], sizes: SpecSizes, drafter_for, script: list) -> list:
    """The oracle's script: plain decoding's tokens, then (up to ORACLE_PASSES times, until
    it stops changing) the tokens speculation gave with the script before. In bf16 a verify
    row and a plain decode round differently, and where the model's two likeliest tokens
    are that close the run parts from plain decoding's text; past that point plain
    decoding's tokens are another text's, and the oracle would draft nothing right."""
    for _ in range(ORACLE_PASSES):
        _, tokens, _ = timed_generate(llm, prompts, sizes,
                                      drafter_for(dict(zip(map(tuple, prompts), script))))
        if tokens == script:
            break
        script = tokens
    return script


def partings(plain: list, spec: list, logprobs: list) -> list[dict]:
    """Where each output with speculation first differs from plain decoding's, and by how
    much plain decoding preferred its own token there, its top one (log-probability, nats;
    inf if speculation's token was not among plain decoding's top 5): a parting at a
    near-tie is bf16 rounding, one at a wide margin a wrong token."""
    out = []
    for p, s, lps in zip(plain, spec, logprobs):
        at = next((i for i, (x, y) in enumerate(zip(p, s)) if x != y), None)
        if at is not None:
            out.append({"position": at, "margin": max(lp.logprob for lp in lps[at].values())
                        - (lps[at][s[at]].logprob if s[at] in lps[at] else -float("inf"))})
    return out


def timed_generate(llm: LLM, prompts: list[list[int]], sizes: SpecSizes, drafter,
                   logprobs: int | None = None) -> tuple[float, list, dict]:
    """Output tokens/s of greedy decoding of prompts with this drafter (None: plain), the
    outputs' tokens, and the drafts checked and kept (and, with logprobs, the outputs'
    top-logprobs as "logprobs")."""
    engine = llm.engine
    engine.speculator.drafter = drafter
    params = SamplingParams(temperature=0.0, max_tokens=sizes.output_len, ignore_eos=True, logprobs=logprobs)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    drafted = sum(o.metrics.spec_draft_tokens for o in outs)
    kept = sum(o.metrics.spec_accepted_tokens for o in outs)
    steps = sum(o.metrics.spec_steps for o in outs)
    return (len(prompts) * sizes.output_len / seconds, [o.outputs[0].token_ids for o in outs],
            {"drafted": drafted, "accepted": kept, "acceptance": kept / drafted if drafted else 0.0,
             "mean_kept_per_step": 1 + kept / steps if steps else 1.0,
             **({"logprobs": [o.outputs[0].logprobs for o in outs]} if logprobs else {})})


def compare(llm: LLM, sizes: SpecSizes, batch: int, drafter_for, name: str, learns: bool = False) -> dict:
    """One case: plain decoding of `batch` prompts, then with drafter_for(continuations)
    (learns: an oracle, whose script is learned first, learn_script)."""
    vocab = llm.engine.model.config.vocab_size
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, vocab, (sizes.prompt_len,), generator=g).tolist() for _ in range(batch)]
    timed_generate(llm, prompts[:1], sizes, None)   # warm: the shapes of this batch's steps
    plain, plain_tokens, _ = timed_generate(llm, prompts, sizes, None)
    script = learn_script(llm, prompts, sizes, drafter_for, plain_tokens) if learns else plain_tokens
    drafter = drafter_for(dict(zip(map(tuple, prompts), script)))
    timed_generate(llm, prompts[:1], sizes, drafter)
    spec, spec_tokens, stats = timed_generate(llm, prompts, sizes, drafter)
    parted, replayed = [], True
    # where, and at what margin: an untimed plain run, its logprobs its own tokens'
    if spec_tokens != plain_tokens:
        _, ref_tokens, ref = timed_generate(llm, prompts, sizes, None, logprobs=5)
        parted, replayed = partings(ref_tokens, spec_tokens, ref["logprobs"]), ref_tokens == plain_tokens
    row = {"case": name, "batch": batch, "plain_tok_s": plain, "spec_tok_s": spec, "speedup": spec / plain,
           "same_tokens": spec_tokens == plain_tokens, "partings": parted, "plain_replayed": replayed,
           **stats}
    same = "the same" if not parted else (f"{len(parted)} of {batch} part from plain decoding, at margins "
                                          f"up to {max(p['margin'] for p in parted):.3f} nats")
    same += "" if replayed else " (plain decoding with logprobs parted from plain decoding without)"
    print(f"{name:>10}  batch {batch:>3}: {plain:8.1f} -> {spec:8.1f} tokens/s ({row['speedup']:.2f}x), "
          f"acceptance {stats['acceptance']:.2f}, {stats['mean_kept_per_step']:.2f} kept per check, "
          f"tokens {same}", flush=True)
    return row


def run_speculative(out: str | None, sizes: SpecSizes) -> dict:
    llm = LLM(sizes.model, speculative_config={"method": "ngram", "num_speculative_tokens": sizes.k,
                                               "num_branches": BRANCHES, "disable_by_batch_size": None},
              max_num_seqs=max(sizes.crossover + sizes.batches),
              max_model_len=sizes.prompt_len + sizes.output_len + 8,
              num_kv_blocks=sizes.num_kv_blocks)
    # the engine's own ngram drafter
    vocab, prompt_lookup = llm.engine.model.config.vocab_size, llm.engine.speculator.drafter
    def oracle(a: float):
        def drafter(conts: dict) -> PerSequence:
            drafts = OracleDrafter(conts, sizes.prompt_len, a, vocab)
            return PerSequence(drafts, drafts.on_device)
        return drafter
    ngram = lambda conts: PerSequence(lambda tokens, k, branches: prompt_lookup.propose(tokens, k, 1),
                                      prompt_lookup.on_device)
    branched = lambda conts: prompt_lookup
    res = {"sizes": dataclasses.asdict(sizes),
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "acceptance": [], "crossover": [], "ngram": [], "draft_model": []}
    for a in sizes.acceptances:
        res["acceptance"] += [compare(llm, sizes, b, oracle(a), f"a={a}", learns=True) for b in sizes.batches]
    res["crossover"] = [compare(llm, sizes, b, oracle(sizes.crossover_a), f"a={sizes.crossover_a}",
                                learns=True)
                        for b in sizes.crossover]
    res["ngram"] = [compare(llm, sizes, b, ngram, "ngram") for b in sizes.batches]
    res["ngram"] += [compare(llm, sizes, b, branched, f"ngram x{BRANCHES}") for b in sizes.batches]
    one = next((r for r in res["crossover"] if r["batch"] == 1), None)
    # this LLM's last use: a replay writes the last step's slots
    if torch.cuda.is_available() and one is not None:
        res["verify"] = verify_cost(llm, sizes, one)
    llm.close()
    del llm
    gc.collect()   # the model's memory back before the next LLM sizes its KV cache
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    llm = LLM(sizes.model, speculative_config={"method": "draft_model", "model": sizes.draft,
                                               "num_speculative_tokens": sizes.k,
                                               "disable_by_batch_size": None},
              max_num_seqs=max(sizes.batches), max_model_len=sizes.prompt_len + sizes.output_len + 8,
              num_kv_blocks=sizes.num_kv_blocks)
    draft_model = llm.engine.speculator.drafter
    res["draft_model"] = [compare(llm, sizes, b, lambda conts: draft_model, "draft") for b in sizes.batches]
    llm.close()
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
        plot_speculative(res, out.rsplit(".", 1)[0] + ".png")
    return res


def verify_cost(llm: LLM, sizes: SpecSizes, row: dict) -> dict:
    """A check's cost in plain steps at batch 1 (row: a batch-1 case; a check is a
    drafting step's round, speculate.py): the whole check, from its tokens/s and tokens kept
    a check, against the GPU time of its decode graph alone (k + 1 rows, one each, against
    one row)."""
    lane = llm.engine.runner.full_gpu
    graphs = {n: next((b for b in lane.sizes if b >= n), None) for n in (1, sizes.k + 1)}
    if None in graphs.values():   # no graph that large (max_num_seqs): verify steps run without one
        return {}
    graph_ms = {n: time_ms(lane.graphs[b][0].replay) for n, b in graphs.items()}
    wait_ms, replay_host_ms = launch_wait_ms(lane.graphs[graphs[sizes.k + 1]][0].replay)
    step = row["mean_kept_per_step"] * row["plain_tok_s"] / row["spec_tok_s"]
    res = {"step_in_plain_steps": step, "graph_ms": graph_ms,
           "graph_ratio": graph_ms[sizes.k + 1] / graph_ms[1],
           "needed_for_3x": row["mean_kept_per_step"] / 3.0,
           "launch_wait_ms": wait_ms, "replay_host_ms": replay_host_ms,
           "plain_step_ms": 1e3 / row["plain_tok_s"]}
    print(f"    verify  batch   1: a check costs {step:.2f} plain steps; its graph alone "
          f"{graph_ms[sizes.k + 1]:.3f} ms on the GPU against {graph_ms[1]:.3f} for one row "
          f"({res['graph_ratio']:.2f}x); 3x would need {res['needed_for_3x']:.2f}. Launched on an "
          f"idle GPU (as a drafting step is), the graph waits {wait_ms:.3f} ms for its launch "
          f"(replay() takes {replay_host_ms:.3f} ms on the host); a plain step: "
          f"{res['plain_step_ms']:.3f} ms", flush=True)
    return res


def plot_speculative(res: dict, path: str) -> None:
    """Speed-up against acceptance (one line per batch, the arithmetic's ideal dotted), and
    against the batch at the crossover's acceptance."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    k = res["sizes"]["k"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for b in res["sizes"]["batches"]:
        rows = [r for r in res["acceptance"] if r["batch"] == b]
        ax1.plot([float(r["case"][2:]) for r in rows], [r["speedup"] for r in rows], "o-", label=f"batch {b}")
    a = [i / 20 for i in range(19)]
    ax1.plot(a, [(1 - x ** (k + 1)) / (1 - x) for x in a], ":", color="gray", label=f"tokens per step, k={k}")
    ax1.axhline(1, color="black", linewidth=0.8)
    ax1.set(xlabel="acceptance a (each draft right with probability a)",
            ylabel="speed-up over plain decoding", title=f"Speculative decoding, {res['sizes']['model']}")
    ax1.legend(fontsize=8)
    rows = res["crossover"]
    ax2.plot([r["batch"] for r in rows], [r["speedup"] for r in rows], "o-")
    ax2.axhline(1, color="black", linewidth=0.8)
    ax2.set(xscale="log", xlabel="batch (sequences)", ylabel="speed-up over plain decoding",
            title=f"Against the batch, a = {res['sizes']['crossover_a']}")
    ax2.set_xticks([r["batch"] for r in rows], [str(r["batch"]) for r in rows])
    ax2.minorticks_off()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main(args: argparse.Namespace) -> None:
    """`bench.py speculative`, with bench.py's flags (--model, --small, --out)."""
    sizes = SMALL_SPEC if args.small else SpecSizes()
    run_speculative(args.out, dataclasses.replace(sizes, model=args.model or sizes.model))
