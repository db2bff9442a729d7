"""Sampling on the device: what a step samples (Draw), the logits each draw samples from
(adjust_logits: bans, bias, penalties), its tokens and their logprobs, and the per-sequence
token counts the penalties read. The model
runner (runner.py) calls these; nothing here waits for the device, so the host can run
ahead while the GPU samples.
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from nanopd import gpu_kernels as kernels
from nanopd.request import PENDING, SamplingParams, Sequence

# host list -> tensor on the device (ModelRunner.upload)
Upload = Callable[[list, torch.dtype], torch.Tensor]


@dataclass(slots=True)   # one per sequence per step: slots make it cheap to build
class Draw:
    """One token to sample in a step: after which of the batch's sequences, and how."""
    row: int                            # index into Batch.seqs
    params: SamplingParams
    generator: torch.Generator | None = None
    seq: Sequence | None = None         # that sequence, if its request adjusts its logits (Request.adjusts)
    child: bool = False                 # the token starts a child forked from seq (n > 1), not seq's own
    banned: Iterable[int] = ()          # tokens it may not be (min_tokens, bad_words)
    # (token, t): banned if seq's last token, PENDING on the host, is t (a bad word's rest ends there)
    banned_if_pending: Iterable[tuple[int, int]] = ()
    # after which of the row's new tokens (-1: the last; Batch.ahead's: each)
    position: int = -1
    noise_of: int = -1                  # the draw whose sampling noise it reuses (sampler.sample), if any
    # A draw among a sequence's tokens ahead (Batch.ahead): those before its position, which
    # its penalties count as the sequence's own; its token is counted only once kept.
    before: list[int] | None = None


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           upload: Upload | None = None, same_noise: list[tuple[int, int]] = ()) -> torch.Tensor:
    """One token per row of logits [R, vocab]. Greedy rows take the argmax; the others draw
    from softmax(logits / T) restricted by min_p, then top-k and top-p, through the
    exponential race argmax(p / E), E ~ Exp(1): seeded rows draw E from their own generator,
    so their tokens do not depend on the other rows. same_noise (row, src): row reuses src's
    E, so rows of the same logits sample the same token (candidates checked side by side). upload puts
    host lists on the logits' device (ModelRunner.upload, which never waits for the device)."""
    upload = upload or (lambda data, dtype: torch.tensor(data, dtype=dtype, device=logits.device))
    greedy = logits.argmax(-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return greedy
    top_k = [params[i].top_k if params[i].top_k > 0 else logits.shape[1] for i in rows]
    top_p = [params[i].top_p for i in rows]
    min_p = [params[i].min_p for i in rows]
    knobs = upload([[params[i].temperature, top_p[j], top_k[j], min_p[j]] for j, i in enumerate(rows)],
                   torch.float32)
    row_ids = upload(rows, torch.int64)
    x = logits[row_ids].float() / knobs[:, :1]
    if max(min_p) > 0:
        x = apply_min_p(x, knobs[:, 3])
    if min(top_k) < x.shape[1] or min(top_p) < 1.0:
        x = apply_top_k_top_p(x, knobs[:, 2], knobs[:, 1])
    noise = torch.empty_like(x).exponential_()
    for j, i in enumerate(rows):
        if generators[i] is not None:
            noise[j].exponential_(generator=generators[i])
    if same_noise:
        j_of = {i: j for j, i in enumerate(rows)}
        tied = [(j_of[r], j_of[src]) for r, src in same_noise if r in j_of]
        if tied:
            at = upload(tied, torch.int64)
            noise[at[:, 0]] = noise[at[:, 1]]
    greedy[row_ids] = (x.softmax(-1) / noise).argmax(-1)
    return greedy


def apply_min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf the logits (after temperature) of the tokens less likely than min_p times
    each row's most likely one (vLLM's and HF's min_p; 0 keeps every token)."""
    probs = x.softmax(-1)
    return x.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), float("-inf"))


def apply_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf the logits outside each row's top_k, then outside the smallest set whose
    probability reaches top_p (the most likely token always stays)."""
    sorted_x, order = x.sort(-1, descending=True)
    rank = torch.arange(x.shape[1], device=x.device)
    sorted_x.masked_fill_(rank[None] >= top_k[:, None], float("-inf"))
    probs = sorted_x.softmax(-1)
    sorted_x.masked_fill_(probs.cumsum(-1) - probs > top_p[:, None], float("-inf"))
    return torch.full_like(x, float("-inf")).scatter_(-1, order, sorted_x)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Of the model's distribution (before penalties, temperature, top-k and top-p, as vLLM
    reports them): each row's chosen token's logprob [R] and its rank [R] (1 + the tokens
    more likely than it), and its k most likely tokens' logprobs and ids [R, k]."""
    lp = torch.log_softmax(logits.float(), -1)
    top = lp.topk(max(1, k), -1)
    chosen = lp.gather(1, tokens[:, None])
    return chosen[:, 0], (lp > chosen).sum(-1) + 1, top.values, top.indices


def adjust_logits(logits: torch.Tensor, draws: list[Draw], prev_tokens: torch.Tensor | None, upload: Upload,
                  counts: "TokenCounts") -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """The logits the draws sample from [D, vocab]: the model's, or a float32 copy changed
    in vLLM's order: the tokens outside allowed_token_ids, the bad words' and min_tokens'
    banned tokens at -inf, logit_bias added, then every penalty of the step in one launch.
    Also (draws, statistics rows) of the penalised draws whose token is their sequence's own."""
    adjusted = [k for k, d in enumerate(draws) if d.seq is not None]   # most steps: none
    allowed = [(k, t) for k in adjusted for t in draws[k].params.allowed_token_ids or ()]
    bans = [(k, t) for k in adjusted for t in draws[k].banned]
    pending = [(k, t, draws[k].seq.pending_row, last) for k in adjusted
               for t, last in draws[k].banned_if_pending]
    bias = [(k, t, b) for k in adjusted for t, b in (draws[k].params.logit_bias or {}).items()]
    penalized = [k for k in adjusted if draws[k].params.penalized]
    if not (allowed or bans or pending or bias or penalized):
        return logits, None
    x, counted, inf = logits.to(torch.float32, copy=True), None, float("-inf")
    if allowed:
        at = upload(allowed, torch.int64)
        outside = torch.zeros_like(x, dtype=torch.bool)
        outside[at[:, 0]] = True
        outside[at[:, 0], at[:, 1]] = False
        x.masked_fill_(outside, inf)
    if bans:
        at = upload(bans, torch.int64)
        x[at[:, 0], at[:, 1]] = inf
    if pending:   # -inf where the PENDING token is the word's (adding: two words may share a token)
        at = upload(pending, torch.int64)
        hit = prev_tokens[at[:, 2]].long() == at[:, 3]
        x.index_put_((at[:, 0], at[:, 1]), torch.where(hit, inf, 0.0), accumulate=True)
    if bias:
        at = upload([(k, t) for k, t, _ in bias], torch.int64)
        x.index_put_((at[:, 0], at[:, 1]), upload([b for *_, b in bias], torch.float32),
                     accumulate=True)
    if penalized:
        rows = counts.penalize(x, penalized, [draws[k].seq for k in penalized],
                                          [draws[k].params for k in penalized], prev_tokens, upload,
                                          [draws[k].before or [] for k in penalized])
        own = [j for j, k in enumerate(penalized) if not draws[k].child and draws[k].before is None]
        counted = (upload([penalized[j] for j in own], torch.int64),
                   rows[upload(own, torch.int64)])
    return x, counted


def bad_word_bans(words: list[list[int]], outputs: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """vLLM's bad_words at one draw, after these output tokens: a word's last token is
    banned when the output ends in the rest of the word (a one-token word: always). The
    output's last token may be PENDING (still on the device): a word whose rest ends in it
    then gives (its last token, the token the PENDING one must be), banned on the device
    (ModelRunner._adjust). Returns (banned, those pairs)."""
    banned, if_pending = [], []
    for *rest, last in words:
        if len(rest) > len(outputs):
            continue
        tail = outputs[len(outputs) - len(rest):]
        if tail[:-1] != rest[:-1]:
            continue
        if not rest or tail[-1] == rest[-1]:
            banned.append(last)
        elif tail[-1] == PENDING:
            if_pending.append((last, rest[-1]))
    return banned, if_pending


# ----------------------------------------------------------------------------- what the penalties read


class TokenCounts:
    """Per-sequence token statistics on the device, for the repetition, presence and
    frequency penalties: row r of in_prompt [rows, vocab] marks the tokens of a sequence's
    prompt, row r of counts [rows, vocab] counts its output tokens.

    A sequence gets a row at its first penalised draw, built from its token ids (so a
    request imported from another worker, a forked child or one back from preemption
    needs nothing sent or kept for it); from then on every step adds the tokens it
    sampled, on the device, so no step uploads a history. The engine returns a row when
    its sequence finishes (forget). Rows are few until penalties are used: the table
    doubles when full."""

    def __init__(self, vocab: int, device: torch.device):
        self.vocab, self.device = vocab, device
        self.counts = torch.zeros(0, vocab, dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros(0, vocab, dtype=torch.uint8, device=device)
        self.row_of: dict[Sequence, int] = {}
        self.free: list[int] = []

    def rows(self, seqs: list[Sequence], prev_tokens: torch.Tensor | None, upload: Upload) -> list[int]:
        """Each sequence's row, building the missing ones; a PENDING last token is read on the
        device from prev_tokens, the sampled tokens of the step before (see runner.py)."""
        missing = [s for s in dict.fromkeys(seqs) if s not in self.row_of]
        if missing:
            self._build(missing, prev_tokens, upload)
        return [self.row_of[s] for s in seqs]

    def _build(self, seqs: list[Sequence], prev_tokens: torch.Tensor | None, upload: Upload) -> None:
        self._grow(len(seqs))
        prompt_rows, prompt_ids, out_rows, out_ids, fills = [], [], [], [], []
        for seq in seqs:
            row = self.row_of[seq] = self.free.pop()
            outputs = seq.token_ids[seq.num_prompt_tokens:]
            if outputs and outputs[-1] == PENDING:   # sampled by the step before, still on the device
                fills += [len(out_ids) + len(outputs) - 1, seq.pending_row]
            prompt_rows += [row] * seq.num_prompt_tokens
            prompt_ids += seq.token_ids[:seq.num_prompt_tokens]
            out_rows += [row] * len(outputs)
            out_ids += [max(t, 0) for t in outputs]
        rows = upload([self.row_of[s] for s in seqs], torch.int64)
        self.counts[rows], self.in_prompt[rows] = 0, 0
        prompt = upload([prompt_rows, prompt_ids], torch.int64)
        self.in_prompt[prompt[0], prompt[1]] = 1
        if out_ids:
            out = upload([out_rows, out_ids], torch.int64)
            if fills:
                at, src = upload(fills, torch.int64).view(-1, 2).unbind(1)
                out[1, at] = prev_tokens[src].long()
            self.counts.index_put_((out[0], out[1]), torch.ones_like(out[0], dtype=torch.int32),
                                   accumulate=True)

    def _grow(self, need: int) -> None:
        if len(self.free) >= need:
            return
        old = len(self.counts)
        new = max(8, 2 * old, old + need - len(self.free))
        self.counts = torch.cat([self.counts, self.counts.new_zeros(new - old, self.vocab)])
        self.in_prompt = torch.cat([self.in_prompt, self.in_prompt.new_zeros(new - old, self.vocab)])
        self.free += range(new - 1, old - 1, -1)

    def penalize(self, logits: torch.Tensor, draws: list[int], seqs: list[Sequence],
                 params: list[SamplingParams], prev_tokens: torch.Tensor | None, upload: Upload,
                 before: list[list[int]] = ()) -> torch.Tensor:
        """Apply the penalties of params[i] to row draws[i] of logits [D, vocab] (float32, in
        place), from the statistics of seqs[i] and the tokens before[i] (tokens ahead of the
        sequence's own, Batch.ahead, not yet the sequence's), all in one launch; the rows used [P]."""
        rows = upload(self.rows(seqs, prev_tokens, upload), torch.int64)
        knobs = upload([[p.repetition_penalty, p.presence_penalty, p.frequency_penalty] for p in params],
                       torch.float32)
        counts, in_prompt, at = self.counts, self.in_prompt, rows
        if any(before):   # each draw its own copy of its row, with the tokens ahead counted
            counts, in_prompt = self.counts[rows], self.in_prompt[rows]
            at = torch.arange(len(rows), device=rows.device)
            pairs = upload([[i, t] for i, tokens in enumerate(before) for t in tokens],
                           torch.int64).view(-1, 2)
            counts.index_put_((pairs[:, 0], pairs[:, 1]), torch.ones(len(pairs), dtype=torch.int32,
                                                                     device=rows.device), accumulate=True)
        kernels.apply_penalties(logits, upload(draws, torch.int64), at, knobs, counts, in_prompt)
        return rows

    def count(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """The step sampled tokens[i] for the sequence of row rows[i]."""
        self.counts.index_put_((rows, tokens.long()), torch.ones_like(rows, dtype=torch.int32),
                               accumulate=True)

    def forget(self, seq: Sequence) -> None:
        row = self.row_of.pop(seq, None)
        if row is not None:
            self.free.append(row)
