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

The engine calls its Speculator at five points of a step: draft (before scheduling),
plan_checks (the step's check draws, before launching), rounds (its later rounds, if any),
launched, and keep (when the step's tokens are back: what each drafted sequence keeps).

Drafters (vLLM's `speculative_config` methods):
  ngram        prompt lookup: the tokens that followed the latest earlier occurrence of
               the sequence's last n tokens, n from prompt_lookup_max down to
               prompt_lookup_min (and up to num_branches such continuations); with one
               candidate, a continuation that reaches the sequence's end goes round the
               loop it found (propose_looped), on the host and on the device.
  draft_model  a smaller model's greedy tokens (DraftModel).
"""

from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nanopd.config import SpeculativeConfig
from nanopd.model import CausalLM, load_model
from nanopd.request import Sequence
from nanopd.runner import DeviceDraft, Draw, ModelRunner, Rounds
from nanopd.scheduler import Batch, Scheduler


def load_draft(name: str, target: CausalLM, seed: int) -> CausalLM:
    """draft_model's model, on the target's device in its dtype; its vocabulary must be the target's."""
    draft = load_model(name, dtype=target.dtype, device=target.device, seed=seed)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"speculative_config's draft model {name!r} has a vocabulary of "
                         f"{draft.config.vocab_size} tokens, the model {target.config.vocab_size}: "
                         "a draft must share the model's tokenizer")
    return draft


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

    def __init__(self, runner: ModelRunner, reserve: "Reserve"):
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


Reserve = Callable[[Sequence, int], list[tuple[int, int]] | None]   # Scheduler.reserve_slots
DRAFTERS: dict[str, Callable[[SpeculativeConfig, ModelRunner, Reserve], Drafter]] = {   # a method's drafter
    "ngram": lambda cfg, runner, reserve: ngram_drafter(cfg),
    "draft_model": lambda cfg, runner, reserve: DraftModel(runner, reserve),
}


def can_speculate(seq: Sequence) -> bool:
    """Whether seq's drafts can be checked: its request searches no beams and decodes here
    (a prefill worker's parks after its first token). Logprobs come from the draw that
    sampled each kept token; penalties and min_tokens bans at a depth count the drafts
    before it (Speculator.plan_checks)."""
    req = seq.request
    return not req.beam_width and not req.prefill_only


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

    def __init__(self, spec: SpeculativeConfig, runner: ModelRunner, scheduler: Scheduler, banned: Banned):
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
        the sequence, each other on a branch (Scheduler.branch). Finding none counts as a
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
        one has dropped them already: Scheduler.preempt)."""
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
        """The step's later rounds on the device (num_rounds in all: runner.py:Rounds), or None:
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
