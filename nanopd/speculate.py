"""Speculative decoding: a drafter guesses the next few tokens of a sequence, and the engine
checks them all in one step (engine.py).

A decode step at a small batch reads every weight to produce one token per sequence; the
same read can compute a few more positions. So a drafter proposes k tokens d_1..d_k after a
sequence's last token, and the step computes the last token and the drafts as one short
chunk (the paged attention kernel attends a chunk to the context before it, as for a
prompt). Each of the k + 1 positions gives the model's distribution p_j of the token after
it. The engine samples s_j from each p_j, exactly as it would without drafts (same
temperature, top-k, top-p; a seeded sequence draws from its own generator in the same
order), and keeps

    d_1 .. d_a, then s_a      where a is how many leading drafts equal what was sampled
                              (d_{j+1} == s_j); all k agree: d_1 .. d_k, then s_k.

This is Leviathan et al.'s rejection rule for drafts that are certain (a drafter that
proposes one token, q = that token with probability 1): a draft is kept with probability
min(1, p/q) = p(d), which is the chance that s, drawn from p, is d; on a mismatch s is
drawn from p without d, renormalised, which is max(0, p - q) normalised. So every kept
token has the model's distribution, and greedy rows (s_j the argmax) give the tokens
plain greedy decoding gives. A seeded sequence's generator is set back after the step to
where plain decoding would have left it (one draw per kept token), so its tokens are
those of plain decoding too, token for token.

If each draft is right with probability a, independently, a step keeps
(1 - a^(k+1)) / (1 - a) tokens on average. Checking k drafts costs little while the step
is bound by reading the weights (small batches) and as much as k more decodes once it is
bound by compute (large ones): above `disable_by_batch_size` running sequences (vLLM's
setting) nothing drafts.

A draft needs the token before it on the host, so a step that will be followed by drafts
ends before the next is scheduled, giving up the overlap of the host's work with the
device's. Drafts that miss would make speculation cost more than it gains; so a sequence
whose drafts miss backs off (drafts_at), and a step after which nobody drafts keeps the
overlap.

Rounds. Where the drafter can also draft on the device (ngram; a bench's oracle), a
drafting step runs up to num_rounds draft-and-check rounds before the host reads its
tokens: each later round takes, on the device, what the round before kept (the same rule
as keep's), drafts k tokens after it and checks them (runner.py:Rounds). The GPU then waits
for the host once a step, not once a round. A step runs rounds only where nothing of its
sequences' sampling needs the host between tokens (chains) and every one drafted k tokens;
their slots are reserved for every round up front, and what a stop token or max_tokens
ends inside a round is dropped, as a plain step's token after a stop is.

Speculation plugs into the plain engine as three subclasses at the end of this file:
SpecScheduler (a drafted decode's tokens ahead, its branches), SpecRunner (the draft model,
the later rounds) and SpecEngine, which calls its Speculator at five points of a step:
draft (before scheduling), plan_checks (the step's check draws, before launching), rounds
(its later rounds, if any), launched, and keep (when the step's tokens are back: what each
drafted sequence keeps).

Drafters (vLLM's `speculative_config` methods):
  ngram        prompt lookup: the tokens that followed the latest earlier occurrence of
               the sequence's last n tokens, n from prompt_lookup_max down to
               prompt_lookup_min (and up to num_branches such continuations); with one
               candidate, a continuation that reaches the sequence's end goes round the
               loop it found (propose_looped), on the host and on the device.
  draft_model  a smaller model's greedy tokens (DraftModel).
"""

import functools
import itertools
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nanopd import gpu_kernels as kernels
from nanopd.config import EngineConfig, SpeculativeConfig
from nanopd.engine import Engine, LaunchedStep, banned_tokens
from nanopd.kv_cache import OutOfBlocks, allocate_kv_cache, kv_bytes_per_block
from nanopd.model import AttentionMetadata, CausalLM, load_model
from nanopd.request import Sequence, Status
from nanopd.runner import Lane, ModelRunner, StepOutput
from nanopd.sampler import Draw, TokenCounts, sample
from nanopd.scheduler import Batch, Scheduler


def load_draft(name: str, target: CausalLM, seed: int) -> CausalLM:
    """draft_model's model, on the target's device in its dtype; its vocabulary must be the target's."""
    draft = load_model(name, dtype=target.dtype, device=target.device, seed=seed)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"speculative_config's draft model {name!r} has a vocabulary of "
                         f"{draft.config.vocab_size} tokens, the model {target.config.vocab_size}: "
                         "a draft must share the model's tokenizer")
    return draft


# (history [B, W] int64: row b's tokens in its first lengths[b], lengths [B], k) -> drafts [B, k]
DeviceDraft = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


@dataclass
class Rounds:
    """A drafting step's rounds after its first (Speculator.rounds). Every sequence of the
    step checks k drafts a round; each round after the first takes, on the device, what the
    round before kept (the drafts up to the first one the sampled tokens disagree with, then
    the token sampled there), drafts k more after it and checks them (SpecRunner.later_rounds)."""
    count: int          # rounds in all, the first included
    k: int
    draft: DeviceDraft


# (the sequences, at most how many drafts each, branches) -> each one's candidates
Drafter = Callable[[list[Sequence], list[int], int], list[list[list[int]]]]


def propose_ngram(tokens: list[int], k: int, n_max: int, n_min: int, branches: int = 1) -> list[list[int]]:
    """Prompt lookup: the up to k tokens that followed earlier occurrences of the sequence's
    last n tokens, the longest n first, the latest occurrence first: up to `branches`
    candidate continuations, none a prefix of another, the longest first (the step checks
    the first on the sequence itself, the others on branches: Speculator.draft). [] if none occurs."""
    # 4 bytes a token: bytes.rfind runs in C
    data, size, found = array("i", tokens).tobytes(), len(tokens), []
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix, end = data[4 * (size - n):], 4 * (size - 1)   # an occurrence ends before the last token
        while len(found) < branches and (at := data.rfind(suffix, 0, end)) >= 0:
            end = at + len(suffix) - 1
            if at % 4 == 0:   # on a token boundary
                follows = tokens[at // 4 + n:at // 4 + n + k]
                if not any(c[:len(follows)] == follows for c in found):
                    found = [c for c in found if follows[:len(c)] != c] + [follows]
    return sorted(found, key=len, reverse=True)


def propose_ngram_on_device(history: torch.Tensor, lengths: torch.Tensor, k: int, n_max: int,
                            n_min: int) -> torch.Tensor:
    """propose_looped's drafts for every row at once, on the device (a DeviceDraft): history
    [B, W], row b's tokens its first lengths[b] -> drafts [B, k]. Where no n-gram recurs,
    every draft is the last token: a round checks k drafts whatever they are, and only
    agreeing drafts are kept."""
    rows, last = torch.arange(len(history), device=history.device)[:, None], lengths - 1
    follows = torch.full_like(lengths, -1)   # where the chosen occurrence's continuation starts
    for n in range(n_max, n_min - 1, -1):
        if n >= history.shape[1]:
            continue
        suffix = history[rows, (lengths[:, None] - n + torch.arange(n, device=history.device)).clamp(min=0)]
        starts = torch.arange(history.shape[1] - n + 1, device=history.device)
        # an occurrence ends before the last token: start + n <= last
        hit = (history.unfold(1, n, 1) == suffix[:, None, :]).all(-1) & (starts + n <= last[:, None])
        latest = torch.where(hit, starts, -1).amax(1)
        follows = torch.where((follows < 0) & (latest >= 0), latest + n, follows)
    # round the loop: the continuation's tokens again once it reaches the last one
    at = follows[:, None] + torch.arange(k, device=history.device) % (lengths - follows)[:, None]
    return history[rows, torch.where(follows[:, None] >= 0, at, last[:, None])]


def propose_looped(tokens: list[int], k: int, n_max: int, n_min: int) -> list[list[int]]:
    """propose_ngram's first candidate, k tokens long: a continuation that reaches the
    sequence's end (the only way one is shorter) goes round the loop it found, its tokens
    again, as generated text that repeats itself does. The one candidate of ngram without
    branches, so that a drafting step can run later rounds (Speculator.rounds)."""
    found = propose_ngram(tokens, k, n_max, n_min)
    return [[found[0][j % len(found[0])] for j in range(k)]] if found else []


class PerSequence:
    """A Drafter from a function of one sequence's tokens (tokens, k, branches) -> candidates.
    on_device, if given: the same drafter on the device for a drafting step's later rounds
    (runner.py:Rounds), (the step's sequences, upload) -> a DeviceDraft."""

    def __init__(self, propose: Callable[[list[int], int, int], list[list[int]]],
                 on_device: Callable[[list[Sequence], Callable], DeviceDraft] | None = None):
        self.propose, self.on_device = propose, on_device

    def __call__(self, seqs: list[Sequence], ks: list[int], branches: int) -> list[list[list[int]]]:
        return [self.propose(s.token_ids, k, branches) for s, k in zip(seqs, ks)]


class DraftModel:
    """draft_model: a smaller model of the same vocabulary proposes each sequence's next k
    tokens greedily, k passes a drafting step over all the sequences that draft. Its K/V
    live in a cache of its own under the target's block ids (one block table, two caches:
    runner.py), so the scheduler's blocks, copy-on-write copies and truncation serve both.
    A sequence's draft K/V is caught up lazily: the first pass computes every token since
    its last drafting step (all of them after an import or a preemption) and the last
    token, each next pass one draft. A prefix-cache hit shares blocks whose draft K/V the
    first pass writes again, the same values for the same tokens."""

    def __init__(self, runner: "SpecRunner", reserve: "Reserve"):
        self.runner, self.reserve = runner, reserve

    def __call__(self, seqs: list[Sequence], ks: list[int], branches: int) -> list[list[list[int]]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        live, copies = [], []
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            pairs = self.reserve(seq, len(seq.token_ids) + k)   # the slots the passes and the check write
            if pairs is not None:   # else no blocks free: no drafts
                copies += pairs
                live.append(i)
        self.runner.copy_blocks(copies)   # all of them in one launch
        self._catch_up([seqs[i] for i in live], [drafts[i] for i in live])
        for j in range(1, max((ks[i] for i in live), default=0)):   # then one draft a pass
            rows = [i for i in live if j < ks[i]]
            tokens = self.runner.draft_next([seqs[i].token_ids + drafts[i] for i in rows],
                                            [len(seqs[i].token_ids) - 1 + j for i in rows],
                                            [seqs[i].block_table for i in rows])
            for i, t in zip(rows, tokens):
                drafts[i].append(t)
        for i in live:   # its own tokens only: the drafts' K/V is right only where they are kept
            seqs[i].draft_computed = len(seqs[i].token_ids)
        return [[d] if d else [] for d in drafts]

    def _catch_up(self, seqs: list[Sequence], drafts: list[list[int]]) -> None:
        """The first pass: each sequence's tokens the draft has not computed, up to its last,
        in passes of at most a step's token budget; the first draft after each."""
        todo = {i: min(seq.draft_computed, seq.num_computed) for i, seq in enumerate(seqs)}
        while todo:
            rows, budget = [], self.runner.cfg.max_num_batched_tokens
            for i, start in todo.items():
                take = min(len(seqs[i].token_ids) - start, budget)
                if take == 0:
                    break
                rows.append((i, start, start + take))
                budget -= take
            tokens = self.runner.draft_next([seqs[i].token_ids[:end] for i, _, end in rows],
                                            [s for _, s, _ in rows],
                                            [seqs[i].block_table for i, _, _ in rows])
            for (i, _, end), t in zip(rows, tokens):
                if end == len(seqs[i].token_ids):
                    drafts[i].append(t)
                    del todo[i]
                else:
                    todo[i] = end


def ngram_drafter(cfg: SpeculativeConfig) -> PerSequence:
    """ngram's drafter: prompt lookup, looped where it checks one candidate a step, and on
    the device for later rounds."""
    n_max, n_min = cfg.prompt_lookup_max, cfg.prompt_lookup_min

    def propose(tokens: list[int], k: int, branches: int) -> list[list[int]]:
        if branches == 1:
            return propose_looped(tokens, k, n_max, n_min)
        return propose_ngram(tokens, k, n_max, n_min, branches)

    def on_device(seqs: list[Sequence], upload: Callable) -> DeviceDraft:
        return lambda history, lengths, k: propose_ngram_on_device(history, lengths, k, n_max, n_min)
    return PerSequence(propose, on_device)


Reserve = Callable[[Sequence, int], list[tuple[int, int]] | None]   # SpecScheduler.reserve_slots
DRAFTERS: dict[str, Callable[[SpeculativeConfig, ModelRunner, Reserve], Drafter]] = {   # a method's drafter
    "ngram": lambda cfg, runner, reserve: ngram_drafter(cfg),
    "draft_model": lambda cfg, runner, reserve: DraftModel(runner, reserve),
}


def can_speculate(seq: Sequence) -> bool:
    """Whether seq's drafts can be checked: its request decodes here (a prefill worker's
    parks after its first token). Logprobs come from the draw that
    sampled each kept token; penalties and min_tokens bans at a depth count the drafts
    before it (Speculator.plan_checks)."""
    return not seq.request.prefill_only


def chains(seq: Sequence) -> bool:
    """Whether seq's drafting step may run later rounds on the device (Speculator.rounds):
    nothing of its sampling waits for the host between its tokens (no logprobs, no logits
    adjusted, no generator of its own to set back), no branches, and its drafts are being
    kept (one step that kept none forgiven, as drafts_at forgives it)."""
    params = seq.request.params
    return (not seq.request.adjusts and params.logprobs is None and not seq.branches and seq.draft_misses <= 1
            and (seq.generator is None or params.greedy))


MAX_BACKOFF = 6   # a sequence whose drafts keep missing drafts every 2^6 = 64 steps at least


def drafts_at(seq: Sequence, step: int) -> bool:
    """Whether seq drafts at engine step `step`: every step while its drafts are kept (one
    miss in between is forgiven), then, with each more drafting step in a row that kept
    none (or found none), half as often, down to every 2^MAX_BACKOFF steps. Due steps are
    multiples of a power of two, so sequences backed off alike draft at the same steps,
    and the steps between them keep the host's overlap (engine.py)."""
    return step % (1 << min(max(seq.draft_misses - 1, 0), MAX_BACKOFF)) == 0


def num_accepted(drafts: list[int], sampled: list[int]) -> int:
    """How many leading drafts the sampled tokens agree with (sampled[j]: after draft j)."""
    a = 0
    while a < len(drafts) and drafts[a] == sampled[a]:
        a += 1
    return a


def rewind(generator: torch.Generator, state: torch.Tensor, draws: int, vocab: int) -> None:
    """Set a seeded sequence's generator to where plain decoding would leave it: back to
    state, then `draws` tokens on, each drawing one vocab-wide exponential sample, as
    sampler.sample draws a token."""
    generator.set_state(state)
    for _ in range(draws):
        torch.empty(vocab, dtype=torch.float32, device=generator.device).exponential_(generator=generator)


# ----------------------------------------------------------------------------- the engine's side


@dataclass
class Drafted:
    """A sequence whose drafts a step checks: the step samples a token after its last token
    and after each draft but the last (the check draws, from `checks` on), and after the
    last draft (its ordinary draw)."""
    drafts: list[int]
    checks: int
    generator_state: torch.Tensor | None   # a seeded sampled sequence's generator before the step
    branches: list[tuple[Sequence, list[int], int]] = field(default_factory=list)   # (branch, drafts, checks)


# (seq, drafts ahead) -> the tokens its next may not be, and those banned if its PENDING token is t
Banned = Callable[[Sequence, list[int]], tuple[list[int], list[tuple[int, int]]]]


class Speculator:
    """Speculative decoding in the engine's step (engine.py): who drafts at a step, their
    drafts (the drafter's), the draws that check them, and what each sequence keeps."""

    def __init__(self, spec: SpeculativeConfig, runner: ModelRunner, scheduler: "SpecScheduler",
                 banned: Banned):
        self.spec, self.scheduler, self.banned = spec, scheduler, banned
        self.max_model_len, self.vocab_size = runner.cfg.max_model_len, runner.model.config.vocab_size
        self.drafter = DRAFTERS[spec.method](spec, runner, scheduler.reserve_slots)
        self.upload = runner.upload
        self.num_steps = 0   # engine steps so far: drafts_at counts them

    def drafters(self, step: int) -> list[Sequence]:
        """The running sequences that draft at this step: none while more run than the
        config's disable_by_batch_size, or with no drafter (a benchmark's plain run)."""
        limit, running = self.spec.disable_by_batch_size, self.scheduler.running
        if self.drafter is None or limit is not None and len(running) > limit:
            return []
        return [s for s in running if can_speculate(s) and drafts_at(s, step)]

    def drafts_next_step(self) -> bool:
        """Whether a sequence drafts at the next step (the step launched now must then end
        before it: a draft needs the token before it on the host)."""
        return bool(self.drafters(self.num_steps + 1))

    def draft(self) -> list[Sequence]:
        """A new step: drafts for the sequences that draft now, decoding, as many as
        max_tokens and max_model_len leave room for after the token the step samples anyway
        (the scheduler checks as many as the step's budget holds): the longest candidate on
        the sequence, each other on a branch (SpecScheduler.branch). Finding none counts as a
        miss. The sequences given drafts."""
        self.num_steps += 1
        seqs, rooms = [], []
        for seq in self.drafters(self.num_steps):
            room = min(self.spec.num_speculative_tokens, seq.request.params.max_tokens - seq.num_outputs - 1,
                       self.max_model_len - len(seq.token_ids) - 1)
            if seq.num_pending == 1 and seq.num_outputs > 0 and seq.pending_row is None and room > 0:
                seqs.append(seq)
                rooms.append(room)
        drafting = []
        for seq, candidates in zip(seqs, self.drafter(seqs, rooms, self.spec.num_branches) if seqs else []):
            if not candidates:
                seq.draft_misses += 1
                continue
            seq.drafts = candidates[0]
            for drafts in candidates[1:]:
                self.scheduler.branch(seq, drafts)
            drafting.append(seq)
        return drafting

    def unscheduled(self, drafting: list[Sequence], batch: Batch) -> None:
        """Drafted sequences the step did not schedule (no budget) drop their drafts (a preempted
        one has dropped them already: SpecScheduler.preempt)."""
        for seq in set(drafting) - set(batch.seqs):
            seq.drafts = []
            self.scheduler.drop_branches(seq)

    def plan_checks(self, batch: Batch, done: list[int], plan: list[tuple[int, int]]
                    ) -> tuple[dict[Sequence, Drafted], list[Draw]]:
        """The drafted sequences among batch.seqs[done] and their check draws, which go first
        in the step's draws: each one's (a token after the last token and after each draft
        but the last, in that order, so a seeded sequence's generator draws them in the
        order plain decoding would), then their branches' (plan: the step's ordinary draws,
        (row, j) each; a sequence's draw after its last draft is its ordinary one)."""
        drafted, checks = {}, []
        for i in done:
            seq = batch.seqs[i]
            if seq.drafts and seq.trunk is None:
                seeded = seq.generator is not None and not seq.request.params.greedy
                drafted[seq] = Drafted(seq.drafts, len(checks), seq.generator.get_state() if seeded else None)
                checks += [self._check_draw(i, seq, seq.drafts[:j], generator=seq.generator)
                           for j in range(len(seq.drafts))]
        return drafted, checks + self._plan_branch_checks(batch, drafted, len(checks), plan)

    def _check_draw(self, row: int, seq: Sequence, before: list[int], **kw) -> Draw:
        """The draw after `before`, drafts of seq (or of a branch of seq) at batch row `row`:
        its penalties count them, and its bans count them as outputs (min_tokens's, while seq's
        outputs and they are fewer; a bad word's, whose rest they may end)."""
        if not seq.request.adjusts:
            return Draw(row, seq.request.params, position=len(before), before=before, **kw)
        banned, banned_if_pending = self.banned(seq, before)
        return Draw(row, seq.request.params, seq=seq, banned=banned, banned_if_pending=banned_if_pending,
                    position=len(before), before=before, **kw)

    def _plan_branch_checks(self, batch: Batch, drafted: dict[Sequence, Drafted], first: int,
                            plan: list[tuple[int, int]]) -> list[Draw]:
        """The draws of the drafted sequences' branches, after their own checks (from draw
        `first` on) and before the ordinary draws (plan): a token after the last token and
        after each draft. The draw at depth j of every branch reuses the noise of its
        sequence's draw at depth j (sampler.sample), so all candidates that agree up to a
        depth sample the same token there, the one plain decoding samples: checking more
        candidates changes how many tokens are kept, never which."""
        branched = [(seq, d) for seq, d in drafted.items() if seq.branches]
        if not branched:
            return []
        row = {s: i for i, s in enumerate(batch.seqs)}
        ordinary = first + sum(len(b.drafts) + 1 for seq, _ in branched for b in seq.branches)
        draws = []
        for seq, d in branched:
            depths = [d.checks + j for j in range(len(d.drafts))] + [ordinary + plan.index((row[seq], 0))]
            for branch in seq.branches:
                d.branches.append((branch, branch.drafts, first + len(draws)))
                draws += [self._check_draw(row[branch], seq, branch.drafts[:j], noise_of=depths[j])
                          for j in range(len(branch.drafts) + 1)]
        return draws

    def rounds(self, batch: Batch, drafted: dict[Sequence, Drafted]) -> Rounds | None:
        """The step's later rounds on the device (num_rounds in all: Rounds), or None:
        only where the drafter also drafts on the device and every sequence of the batch
        checks k drafts, needs nothing of the host between its tokens (chains) and has room
        for as many more; each one's slots for them reserved (None if the blocks are not free)."""
        k, on_device = self.spec.num_speculative_tokens, getattr(self.drafter, "on_device", None)
        if self.spec.num_rounds == 1 or on_device is None:
            return None
        count = self.spec.num_rounds
        for seq, n in zip(batch.seqs, batch.num_new):
            d = drafted.get(seq)
            if d is None or n != k + 1 or len(d.drafts) != k or not chains(seq):
                return None
            room = min(seq.request.params.max_tokens - seq.num_outputs,
                       self.max_model_len - len(seq.token_ids))
            count = min(count, room // (k + 1))
        if count < 2:
            return None
        for seq in batch.seqs:   # the last round writes up to position len - 2 + count * (k + 1)
            pairs = self.scheduler.reserve_slots(seq, len(seq.token_ids) - 1 + count * (k + 1))
            if pairs is None:
                return None
            batch.copies += pairs
        return Rounds(count, k, on_device(batch.seqs, self.upload))

    def launched(self, drafted: dict[Sequence, Drafted]) -> None:
        """The step is on the device: its drafts are the step's now, not the sequences'."""
        for seq in drafted:
            seq.drafts = []
            for branch in seq.branches:
                branch.drafts = []

    def keep(self, seq: Sequence, drafted: Drafted, checked: list[int], last: int, last_draw: int,
             later: list[list[int]] = ()) -> tuple[list[int], list[int]]:
        """The tokens a drafted sequence keeps, and the draws that sampled them (their
        logprobs; -1 in later rounds): of the candidate (its own drafts or a branch's) that
        keeps the most, the drafts up to the first the tokens sampled after each position
        disagree with, then the token sampled there; then, by the same rule, what each later
        round kept (later: its drafts, then its sampled tokens). A branch that wins gives the
        sequence its blocks; every branch is then dropped. last: the token of the sequence's
        ordinary draw, last_draw."""
        sampled = checked[drafted.checks:drafted.checks + len(drafted.drafts)] + [last]
        a, drafts, winner = num_accepted(drafted.drafts, sampled), drafted.drafts, None
        draws = [*range(drafted.checks, drafted.checks + len(drafted.drafts)), last_draw]
        for branch, its_drafts, at in drafted.branches:
            its_sampled = checked[at:at + len(its_drafts) + 1]
            if (its_a := num_accepted(its_drafts, its_sampled)) > a:
                a, drafts, sampled, winner = its_a, its_drafts, its_sampled, branch
                draws = list(range(at, at + len(its_drafts) + 1))
        if winner is not None:
            self.scheduler.take_branch(seq, winner)
        self.scheduler.drop_branches(seq)
        if drafted.generator_state is not None:   # where plain decoding leaves it: one draw per kept token
            rewind(seq.generator, drafted.generator_state, a + 1, self.vocab_size)
        kept, draws, accepted = drafts[:a] + [sampled[a]], draws[:a + 1], a
        for row in later:
            k = len(row) // 2
            a = num_accepted(row[:k], row[k:])
            kept, draws, accepted = kept + row[k:k + a + 1], draws + [-1] * (a + 1), accepted + a
        seq.draft_misses = 0 if accepted else seq.draft_misses + 1
        metrics = seq.request.metrics
        metrics.spec_draft_tokens += (len(drafted.drafts) + sum(len(d) for _, d, _ in drafted.branches)
                                      + sum(len(row) // 2 for row in later))
        metrics.spec_accepted_tokens += accepted
        metrics.spec_steps += 1 + len(later)
        return kept, draws


@torch.inference_mode()   # the counts' table is an inference tensor (built inside a step)
def count_kept(counts: TokenCounts, kept: list[tuple[Sequence, list[int]]], upload: Callable) -> None:
    """Each penalized seq kept these tokens of a drafting step (whose draws were not counted):
    into its token counts, all of a step's in one launch."""
    pairs = [(counts.row_of[seq], t) for seq, tokens in kept if seq in counts.row_of for t in tokens]
    if pairs:
        rows, tokens = upload(pairs, torch.int64).unbind(1)
        counts.count(rows, tokens)


def later_rounds_of(out: StepOutput) -> list[list[list[int]]]:
    """Wait for a step's copies: per sequence (batch row), each later round's drafts then its
    sampled tokens (SpecRunner.later_rounds sent them home in out.more); [] without later rounds."""
    out.wait()
    return [] if out.more is None else out.more.transpose(0, 1).tolist()


# ----------------------------------------------------------------------------- the scheduler's side


@dataclass(eq=False)
class DraftingSequence(Sequence):
    """A SpecEngine's sequence: the Sequence, and what speculation keeps of it."""
    drafts: list[int] = field(default_factory=list)   # guesses of the tokens after the last
    draft_misses: int = 0               # drafting steps in a row that kept none (drafts_at)
    # more candidates, each on a branch: a sequence forked for one step, sharing this one's
    # blocks (copy-on-write), in no queue and no request (SpecScheduler.branch)
    branches: list["DraftingSequence"] = field(default_factory=list)
    trunk: "DraftingSequence | None" = None   # a branch's: the sequence it was forked from
    draft_computed: int = 0             # draft_model: leading tokens whose K/V the draft's cache holds


class SpecScheduler(Scheduler):
    """The Scheduler, with a drafted decode's drafts scheduled after its last token (Batch.ahead,
    as many as the budget holds) and its branches right after it."""

    def _wanted(self, seq: Sequence) -> int:
        return seq.num_pending + len(seq.drafts)

    def _scheduled(self, seq: Sequence, n: int, batch: Batch, left: int) -> int:
        """seq's drafts that the n tokens hold go ahead of it in the batch; then its branches."""
        if seq.drafts:
            del seq.drafts[max(0, n - seq.num_pending):]
            if seq.drafts:
                batch.ahead[seq] = seq.drafts
        return self._schedule_branches(seq, n, batch, left) if seq.branches else 0

    def _shed(self, seq: Sequence) -> int:
        """Drafts are worth no preemption: they go first."""
        shed, seq.drafts = len(seq.drafts), []
        return shed

    def preempt(self, seq: Sequence) -> None:
        """A recomputed prompt has no drafts, no branches, no draft K/V."""
        self.drop_branches(seq)
        seq.drafts, seq.draft_computed = [], 0
        super().preempt(seq)

    def finish(self, seq: Sequence, free: bool = True) -> None:
        self.drop_branches(seq)
        super().finish(seq, free)

    def drafts_checked(self, seq: Sequence) -> None:
        """A drafted sequence's step has ended and its tokens are known: K/V counts up to
        the last, the blocks past its tokens (rejected drafts') go back, and the blocks now
        known enter the prefix cache. A rejected draft's slot in its last block is written
        again when its position comes."""
        seq.num_computed = len(seq.token_ids) - 1
        self.bm.truncate(seq.block_table, len(seq.token_ids))
        self.bm.cache_computed_blocks(seq.block_table, seq.token_ids, seq.num_computed)

    def reserve_slots(self, seq: Sequence, end: int) -> list[tuple[int, int]] | None:
        """Make seq's positions up to end writable (a branch's, or those a draft model's
        passes write before the step is scheduled): the copy-on-write pairs, or None if the
        blocks are not free (drafts are worth no preemption)."""
        try:
            return self.bm.append_slots(seq.block_table, seq.num_computed, end)
        except OutOfBlocks:
            return None

    # -- branches: more candidates of one drafted sequence, for one step

    def branch(self, trunk: Sequence, drafts: list[int]) -> None:
        """Check drafts on a branch of trunk: a sequence sharing every block of it
        (copy-on-write), in no queue, scheduled right after trunk, gone after the step."""
        branch = DraftingSequence(trunk.request, trunk.index, list(trunk.token_ids), trunk.num_prompt_tokens,
                          arrival=trunk.arrival, status=Status.RUNNING,
                          block_table=self.bm.fork(trunk.block_table), num_computed=trunk.num_computed,
                          drafts=drafts, trunk=trunk)
        trunk.branches.append(branch)

    def _schedule_branches(self, trunk: Sequence, n: int, batch: Batch, left: int) -> int:
        """trunk's branches, scheduled with it (n tokens), each checking no more drafts than
        trunk does (its draws share trunk's noise at each depth: Speculator), while the step's
        room (left tokens) and free blocks hold: a branch is worth no preemption. The others
        are dropped; the tokens taken."""
        kept, used = [], 0
        for branch in trunk.branches:
            m = min(1 + len(branch.drafts), n, left - used)
            if m < 2:
                continue
            copies = self.reserve_slots(branch, branch.num_computed + m)
            if copies is None:
                continue
            del branch.drafts[m - 1:]
            batch.add(branch, m, copies)
            batch.ahead[branch] = branch.drafts
            kept.append(branch)
            used += m
        self.drop_branches(trunk, keep=kept)
        return used

    def take_branch(self, trunk: Sequence, branch: Sequence) -> None:
        """branch's drafts won: trunk takes its blocks (and branch trunk's, to be dropped)."""
        trunk.block_table, branch.block_table = branch.block_table, trunk.block_table

    def drop_branches(self, trunk: Sequence, keep: list[Sequence] = ()) -> None:
        """Free trunk's branches but those in keep."""
        for branch in trunk.branches:
            if branch not in keep:
                self.bm.free(branch.block_table)
        trunk.branches = list(keep)


# ----------------------------------------------------------------------------- the runner's side


@dataclass(eq=False)
class DraftRow:
    """A row of a draft model's pass (SpecRunner.draft_next), as prepare reads a sequence."""
    token_ids: list[int]
    num_computed: int
    block_table: list[int]
    pending_row: None = None


class SpecRunner(ModelRunner):
    """The ModelRunner, with a draft model's own KV cache under the same block ids (draft_model)
    and a drafting step's later rounds on the device (Rounds)."""

    def __init__(self, model: CausalLM, cfg: EngineConfig):
        spec = cfg.speculative_config
        self.draft = load_draft(spec.model, model, cfg.seed + 1) if spec.method == "draft_model" else None
        super().__init__(model, cfg)

    def _allocate_caches(self) -> list[torch.Tensor]:
        caches, d = super()._allocate_caches(), self.draft
        if d is not None:
            caches.append(allocate_kv_cache(self.num_blocks, d.num_layers, d.num_kv_heads,
                                            self.cfg.block_size, d.head_dim, d.dtype, self.device))
        return caches

    def _bytes_per_block(self) -> int:
        d = self.draft
        return super()._bytes_per_block() + (0 if d is None else kv_bytes_per_block(
            d.num_layers, d.num_kv_heads, self.cfg.block_size, d.head_dim, d.dtype))

    @torch.inference_mode()
    def draft_next(self, tokens: list[list[int]], starts: list[int], tables: list[list[int]]) -> list[int]:
        """The draft model's greedy next token after each row: row r computes tokens[r] from
        position starts[r] on (the K/V before it in its draft cache), under block table
        tables[r]. Waits for the device."""
        # one-token rows first
        order = sorted(range(len(tokens)), key=lambda r: len(tokens[r]) - starts[r] > 1)
        rows = [DraftRow(tokens[r], starts[r], tables[r]) for r in order]
        batch = Batch(rows, [len(row.token_ids) - row.num_computed for row in rows])
        ids, positions, meta = self.prepare(batch)
        last = self.upload(list(itertools.accumulate(batch.num_new)), torch.int64) - 1
        hidden = self.draft(ids, positions, self.caches[1], meta)[last]
        ahead = self.draft.compute_logits(hidden).argmax(-1).tolist()
        at = {r: j for j, r in enumerate(order)}
        return [ahead[at[r]] for r in range(len(tokens))]


    def later_rounds(self, batch: Batch, out: StepOutput, rounds: Rounds) -> None:
        """A drafting step's rounds after its first (run's `after`), all on the device, no host
        sync: each keeps what the round before kept, drafts, checks (Rounds). Its draws were
        a check per draft of each sequence, in batch order, then a token after each one's
        last draft. Each round's drafts and sampled tokens go home together at the end (out.more)."""
        seqs, k, bs, lane = batch.seqs, rounds.k, self.cfg.block_size, self.lane
        width = max(len(s.token_ids) for s in seqs) + rounds.count * (k + 1)
        history = self.upload([t for s in seqs for t in s.token_ids + [0] * (width - len(s.token_ids))],
                              torch.int64).view(len(seqs), width)   # [B, W]
        tables = self._upload_many(lane.pack_tables([s.block_table for s in seqs]))[0].view(len(seqs), -1)
        lengths = self.upload([len(s.token_ids) for s in seqs], torch.int64)
        drafts = self.upload([t for s in seqs for t in batch.ahead[s]], torch.int64).view(len(seqs), k)
        checks = len(seqs) * k
        # [B, k + 1]: after the last token and each draft
        sampled = torch.cat([out.tokens[:checks].view(-1, k), out.tokens[checks:].view(-1, 1)], 1)
        ahead = torch.arange(k + 1, device=history.device)
        params = [s.request.params for s in seqs for _ in range(k + 1)]
        done = []
        for _ in range(rounds.count - 1):
            accepted = (drafts == sampled[:, :k]).long().cumprod(1).sum(1)          # [B]
            history.scatter_(1, lengths[:, None] + ahead, sampled)   # the kept ones: the first accepted + 1
            lengths = lengths + accepted + 1
            drafts = rounds.draft(history, lengths, k)
            positions = (lengths - 1)[:, None] + ahead                             # [B, k+1]
            ids = torch.cat([history.gather(1, positions[:, :1]), drafts], 1)
            slots = tables.gather(1, positions // bs) * bs + positions % bs
            hidden = self._rerun(batch, ids.flatten(), positions.flatten(), slots.flatten().int(),
                                 tables.repeat_interleave(k + 1, 0), lane)
            sampled = sample(self.model.compute_logits(hidden), params, [None] * len(params),
                             self.upload).view(-1, k + 1)
            done.append(torch.cat([drafts, sampled], 1))
        out.more = self.to_host(torch.stack(done))

    def _rerun(self, batch: Batch, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               tables: torch.Tensor, lane: Lane) -> torch.Tensor:
        """The batch's step again (a later round: later_rounds) on new tokens, a token a row
        attending up to its own position: on the decode graph its first round replayed,
        whose static block tables and query starts still hold, else eagerly."""
        n = len(ids)
        graph_bs = next((b for b in lane.sizes if b >= n), None)
        if graph_bs is not None:
            graph, hidden = lane.graphs[graph_bs]
            st = self.static
            for name, t in (("ids", ids), ("pos", positions), ("slots", slots), ("ctx", positions)):
                st[name][:n].copy_(t)
            graph.replay()
            return hidden[:n]
        meta = AttentionMetadata(
            slot_mapping=slots, block_tables=tables, ctx_lens=positions.int(), max_q_len=1, num_decodes=n,
            cu_q_lens=torch.arange(n + 1, dtype=torch.int32, device=ids.device),
            num_splits=kernels.choose_num_splits(n, self.model.num_kv_heads, 1, self.cfg.max_model_len,
                                                 self.device))
        return self.model(ids, positions, self.kv_cache, meta)


# ----------------------------------------------------------------------------- the engine's side


class SpecEngine(Engine):
    """The Engine, speculating (speculative_config): its Speculator drafts before a step is
    scheduled, adds the draws that check the drafts, and says what each drafted sequence
    keeps. A step that checks drafts, or after which a sequence drafts, ends before the next
    is scheduled (a draft needs the token before it on the host)."""
    features = ("speculative_config",)
    scheduler_class = SpecScheduler
    runner_class = SpecRunner
    sequence_class = DraftingSequence

    def _plug_in(self) -> None:
        # (a function of the EOS ids, not a method: a speculator holding the engine would make
        # a cycle, which the engine's frozen heap would keep from the collector)
        banned = functools.partial(banned_tokens, self.eos_ids)
        self.speculator = Speculator(self.cfg.speculative_config, self.runner, self.scheduler, banned)
        self.drafting: list[Sequence] = []   # the sequences given drafts for the step being scheduled

    def _before_schedule(self) -> None:
        self.drafting = self.speculator.draft()

    def _after_schedule(self, batch: Batch) -> None:
        if self.drafting:
            self.speculator.unscheduled(self.drafting, batch)
            self.drafting = []

    def _plan_draws(self, batch: Batch, done: list[int]) -> tuple[list[tuple[int, int]], list[Draw]]:
        """The ordinary draws; a branch's draws are checks (Speculator.plan_checks)."""
        return super()._plan_draws(batch, [i for i in done if batch.seqs[i].trunk is None])

    def _extra_draws(self, batch: Batch, done: list[int], plan: list[tuple[int, int]], step: LaunchedStep
                     ) -> tuple[list[Draw], Callable[[StepOutput], None] | None]:
        """The checks of the step's drafts (step.extra: the drafted sequences), and its later
        rounds on the device, if any."""
        drafted, checks = self.speculator.plan_checks(batch, done, plan)
        if not drafted:
            return [], None
        step.extra = drafted
        rounds = self.speculator.rounds(batch, drafted)
        self.speculator.launched(drafted)
        return checks, None if rounds is None else functools.partial(self.runner.later_rounds, batch,
                                                                     rounds=rounds)

    def _host_needs_now(self, step: LaunchedStep) -> bool:
        """Also a step that checks drafts (what follows depends on what it keeps), and any
        step after which a sequence drafts (a draft needs the token before it)."""
        return (super()._host_needs_now(step) or step.extra is not None
                or self.speculator.drafts_next_step())

    def _take_tokens(self, step: LaunchedStep, tokens: list[int], logprobs: dict) -> None:
        """A drafted sequence takes what it kept (_take_drafted); the others their token."""
        drafted, extra = step.extra, step.num_extra
        if drafted is None:
            return super()._take_tokens(step, tokens, logprobs)
        checked, later = tokens[:extra], later_rounds_of(step.output)   # later: per batch row (Rounds)
        counted: list[tuple[Sequence, list[int]]] = []   # penalized drafted sequences: what they kept
        for k, ((seq, index), token) in enumerate(zip(step.targets, tokens[extra:])):
            d = drafted.get(seq)
            if d is None or seq.status == Status.FINISHED:
                self._take_sampled(seq, index, token, extra + k, logprobs)
                continue
            rounds = later[step.batch.seqs.index(seq)] if later else ()
            self._take_drafted(seq, index, d, checked, token, extra + k, logprobs, counted, rounds)
        count_kept(self.runner.token_counts, counted, self.runner.upload)

    def _take_drafted(self, seq: Sequence, index: int, drafted: Drafted, checked: list[int], token: int,
                      draw: int, logprobs: dict, counted: list[tuple[Sequence, list[int]]],
                      later: list[list[int]]) -> None:
        """A drafted sequence's step ended: the drafts it kept and the token after them, in
        each of its rounds (Speculator.keep), take the PENDING token's place, each taken in
        turn until one stops it."""
        # draws: each kept token's
        kept, draws = self.speculator.keep(seq, drafted, checked, token, draw, later)
        if seq.request.params.penalized:   # its draws were not counted: what it kept is
            counted.append((seq, kept))
        seq.token_ids[index:index + 1] = kept
        if index + len(kept) == len(seq.token_ids):   # no later step has sampled after it yet
            seq.pending_row = None
        self.scheduler.drafts_checked(seq)
        for at, sampled_by in zip(range(index, index + len(kept)), draws):
            self._take_token(seq, at, sampled_by, logprobs)
            if seq.status == Status.FINISHED:
                break
