"""Beam search, HF's algorithm, on the engine's sequences (engine.py).

Each step a beam search's live beams sample their 2k best continuations on the device
(sampler.py:beam_candidates). Back on the host, advance picks the k that go on: a parent
chosen more than once is forked (copy-on-write, so the beams share their prompt's and
common prefix's blocks), a beam chosen by none is freed. The search ends when nothing is
live or the best live beam can no longer beat the worst of k finished ones.
"""

from collections.abc import Callable

from nanopd.request import Logprob, Request, Sequence, Status


def score(seq: Sequence) -> float:
    """A finished hypothesis' score: summed logprob / length ** length_penalty."""
    return seq.cumulative_logprob / len(seq.output_ids) ** seq.request.length_penalty


def advance(req: Request, eos_ids: set[int], fork: Callable[[Sequence, int], Sequence],
            end: Callable[[Sequence], None]) -> None:
    """One beam-search step over all live beams' candidates: of the 2k best continuations
    (by summed logprob), those among the first k that end (EOS, or max_tokens reached)
    become finished hypotheses, of which the best k by score are kept; the best k that do
    not end go on as the live beams. fork(seq, index) forks a beam, end(seq) frees one."""
    k, live = req.beam_width, [s for s in req.seqs if s.status != Status.FINISHED]
    last_step = len(live[0].output_ids) + 1 >= req.params.max_tokens
    # what each beam's next token records (vLLM's): the logprobs of its 2k candidates, ranked
    steps = {s: {t: Logprob(lp, rank=r + 1) for r, (t, lp) in enumerate(s.beam_candidates)} for s in live}
    cands = sorted(((s.cumulative_logprob + lp, s, t) for s in live for t, lp in s.beam_candidates),
                   key=lambda c: -c[0])[:2 * k]
    keep = []
    for rank, (total, parent, token) in enumerate(cands):
        is_eos = token in eos_ids and not req.params.ignore_eos
        if is_eos or last_step:
            if rank < k:
                req.beams_done.append(finished_beam(parent, token, total, "stop" if is_eos else "length",
                                                    steps[parent]))
        elif len(keep) < k:
            keep.append((total, parent, token))
    req.beams_done = sorted(req.beams_done, key=lambda b: -score(b))[:k]
    # A parent chosen more than once is forked; all forks before any token is appended.
    taken, chosen = set(), []
    for total, parent, token in keep:
        chosen.append((parent if parent not in taken else fork(parent, len(req.seqs)), total, token, parent))
        taken.add(parent)
    for seq, total, token, parent in chosen:
        seq.token_ids.append(token)
        seq.logprobs.append(steps[parent])
        seq.cumulative_logprob = total
        seq.beam_candidates = None
    for seq in live:
        if seq not in taken:
            drop(req, seq, end)
    best_live = keep[0][0] / (len(live[0].output_ids) + 1) ** req.length_penalty if keep else None
    if best_live is None or (len(req.beams_done) == k and best_live <= score(req.beams_done[-1])):
        for seq in [s for s in req.seqs if s.status != Status.FINISHED]:
            drop(req, seq, end)
        req.seqs = req.beams_done


def drop(req: Request, seq: Sequence, end: Callable[[Sequence], None]) -> None:
    """A beam leaves the search: its blocks go back (shared ones stay with the other beams)."""
    end(seq)
    req.seqs.remove(seq)


def finished_beam(parent: Sequence, token: int, total: float, reason: str,
                  step: dict[int, Logprob]) -> Sequence:
    """The hypothesis parent + token, ended (by EOS or length), with its summed logprob and
    its logprobs, step (the candidates of its last token) the last of them."""
    return Sequence(parent.request, -1, parent.token_ids + [token], parent.num_prompt_tokens,
                    status=Status.FINISHED, cumulative_logprob=total, logprobs=parent.logprobs + [step],
                    finish_reason=reason)
