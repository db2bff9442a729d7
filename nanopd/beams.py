"""Beam search, HF's algorithm, on top of the plain engine (as vLLM's LLM.beam_search runs it).

Each step, every live beam of every search is one plain request: its tokens as the prompt,
one greedy token, and the logprobs of its 2k most likely next tokens (logprobs=2k). The
prefix cache already holds what the beams share, so a step computes little more than each
beam's last block. Back on the host, advance keeps the k best continuations; the search
ends when nothing is live or the best live beam can no longer beat the worst of k finished
ones. The engine knows nothing of beams: it serves requests.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

from nanopd.request import (
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
    Logprob,
    RequestOutput,
    SamplingParams,
)

# (prompts as token ids, params) -> each prompt's output, in order: LLM's generate
Generate = Callable[[list[list[int]], SamplingParams], list[RequestOutput]]


@dataclass
class Beam:
    """One hypothesis: its tokens (the prompt's, then its own) and their summed logprob."""
    tokens: list[int]
    cum_logprob: float = 0.0
    # per output token: its step's candidates
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None   # ended: "stop" (EOS) or "length"

    def score(self, num_prompt: int, length_penalty: float) -> float:
        """HF's: summed logprob / output length ** length_penalty."""
        return self.cum_logprob / (len(self.tokens) - num_prompt) ** length_penalty


@dataclass
class Search:
    """One prompt's beam search: its live beams and its finished ones, best first."""
    num_prompt: int
    live: list[Beam]
    done: list[Beam] = field(default_factory=list)
    error: Exception | None = None   # a step of it failed: it has no beams


def search(generate: Generate, prompts: list[list[int]], params: BeamSearchParams, eos_ids: set[int],
           tokenizer, max_model_len: int) -> list[BeamSearchOutput]:
    """Each prompt's params.beam_width best beams, best first, every step one generate call
    for all live beams of all prompts."""
    for i, p in enumerate(prompts):
        if len(p) + params.max_tokens > max_model_len:
            raise ValueError(f"prompt {i}: max_tokens ({params.max_tokens}) + the prompt ({len(p)} tokens) "
                             f"exceeds max_model_len ({max_model_len})")
    k = params.beam_width
    searches = [Search(len(p), [Beam(list(p))]) for p in prompts]
    step = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * k, ignore_eos=True)
    for t in range(params.max_tokens):
        beams = [(s, b) for s in searches for b in s.live]
        if not beams:
            break
        outs = generate([b.tokens for _, b in beams], step)
        for s in searches:
            mine = [(b, o) for (of, b), o in zip(beams, outs) if of is s]
            s.error = next((o.error for _, o in mine if o.error is not None), None)
            if s.error is not None:
                s.live, s.done = [], []
            elif mine:
                advance(s, {id(b): candidates_of(o) for b, o in mine}, k,
                        eos_ids if not params.ignore_eos else set(), t + 1 == params.max_tokens,
                        params.length_penalty)
    return [output(s, tokenizer) for s in searches]


def candidates_of(out: RequestOutput) -> dict[int, Logprob]:
    """A beam's step: the logprobs of its 2k most likely next tokens, ranked."""
    return dict(sorted(out.outputs[0].logprobs[0].items(), key=lambda kv: kv[1].rank))


def advance(s: Search, candidates: dict[int, dict[int, Logprob]], k: int, eos_ids: set[int], last_step: bool,
            length_penalty: float) -> None:
    """One step over all live beams' candidates: of the 2k best continuations (by summed
    logprob), those among the first k that end (EOS, or the last step) become finished
    hypotheses, of which the best k by score are kept; the best k that do not end go on."""
    ranked = sorted(((b.cum_logprob + lp.logprob, b, t) for b in s.live
                     for t, lp in candidates[id(b)].items()), key=lambda c: -c[0])[:2 * k]
    keep = []
    for rank, (total, parent, token) in enumerate(ranked):
        beam = Beam(parent.tokens + [token], total, parent.logprobs + [candidates[id(parent)]])
        if token in eos_ids or last_step:
            if rank < k:
                beam.finish_reason = "stop" if token in eos_ids else "length"
                s.done.append(beam)
        elif len(keep) < k:
            keep.append(beam)
    s.done = sorted(s.done, key=lambda b: -b.score(s.num_prompt, length_penalty))[:k]
    s.live = keep
    if not keep or (len(s.done) == k and keep[0].score(s.num_prompt, length_penalty)
                    <= s.done[-1].score(s.num_prompt, length_penalty)):
        s.live = []


def output(s: Search, tokenizer) -> BeamSearchOutput:
    """vLLM's BeamSearchOutput: each beam's tokens (prompt and output), its text their decode
    (special tokens kept, as vLLM's), best first."""
    beams = [BeamSearchSequence(b.tokens, b.logprobs, b.cum_logprob, tokenizer.decode(b.tokens),
                                b.finish_reason) for b in s.done]
    return BeamSearchOutput(beams, error=s.error)
