"""The request lifecycle on the central scheduler (cluster.py): its record of each request
(RequestRecord), and the ledger of them all (RequestLedger) that says how a request ends.

    queued -> prefill -> done                          on one worker (its prompt and decode)
    queued -> prefill -> transfer -> decode -> done    handed off: its KV moves to a decode worker

A request of n > 1 samples that may be handed off is served as n requests of one sample
(split_samples), which end together as their parent. Every ending, wherever it happened,
is kept for the next poll (ended); its output stays until asked for (output).
"""

import dataclasses
import itertools
import time
from dataclasses import dataclass, field

from nanopd.model import Detokenizer
from nanopd.request import Logprob, RequestMetrics, RequestOutput, SamplingParams


@dataclass(eq=False)
class RequestRecord:
    """The central scheduler's record of one request."""
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    worker: int | None = None          # where it runs now (its decode worker once handed off)
    prefill_worker: int | None = None
    decode_worker: int | None = None   # where it goes after its prefill (None: the least loaded then)
    phase: str = "queued"              # prefill, transfer, decode, done
    tokens: list[int] = field(default_factory=list)   # streamed so far
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)   # theirs, if it asked for logprobs
    shown: int = 0                     # of them, handed out by CentralScheduler.new_tokens
    text: Detokenizer | None = None    # their text, when new_tokens was asked for it
    output: RequestOutput | None = None
    retried: bool = False
    samples: list[int] = field(default_factory=list)  # n > 1 split into samples (when it may be handed off)
    parent: int | None = None


class RequestLedger:
    """Every request the central scheduler serves: the active ones, the ended ones whose
    output was not asked for yet (done), and the ids ended since the last poll (ended)."""

    def __init__(self):
        self.active: dict[int, RequestRecord] = {}
        self.done: dict[int, RequestRecord] = {}
        self.ended: list[int] = []            # ids ended since the last poll, wherever they ended
        self._ids = itertools.count()

    def track(self, prompt: str | None, ids: list[int], params: SamplingParams,
              metrics: RequestMetrics | None = None, parent: int | None = None) -> RequestRecord:
        """A new active request."""
        t = RequestRecord(next(self._ids), prompt, ids, params,
                          metrics or RequestMetrics(time.perf_counter()), parent=parent)
        self.active[t.request_id] = t
        return t

    def split_samples(self, t: RequestRecord) -> list[RequestRecord]:
        """n > 1 across workers: n requests of one sample each. Sample j draws from seed + j,
        as child j does in one engine; sample 0 alone scores the prompt (prompt_logprobs: one
        per request)."""
        samples = []
        for j in range(t.params.n):
            seed = None if t.params.seed is None else t.params.seed + j
            params = dataclasses.replace(t.params, n=1, seed=seed,
                                         prompt_logprobs=t.params.prompt_logprobs if j == 0 else None)
            sample = self.track(t.prompt, t.prompt_token_ids, params,
                                metrics=RequestMetrics(t.metrics.arrival_time), parent=t.request_id)
            t.samples.append(sample.request_id)
            samples.append(sample)
        return samples

    def current(self, w: int, request_id: int, prefill_side: bool = False) -> RequestRecord | None:
        """The request, if w's report is about its current attempt (not one restarted elsewhere)."""
        t = self.active.get(request_id)
        if t is None or not (t.worker == w or (prefill_side and t.prefill_worker == w)):
            return None
        return t

    def finish(self, t: RequestRecord, w: int, output: RequestOutput) -> None:
        """t is done on worker w: its metrics as w saw them fill in what this process did not see."""
        m, theirs = t.metrics, output.metrics
        m.first_scheduled_time = m.first_scheduled_time or theirs.first_scheduled_time
        m.first_token_time = m.first_token_time or theirs.first_token_time
        m.finish_time, m.num_cached_tokens = theirs.finish_time, theirs.num_cached_tokens
        m.spec_draft_tokens, m.spec_accepted_tokens, m.spec_steps = (theirs.spec_draft_tokens,
                                                                     theirs.spec_accepted_tokens,
                                                                     theirs.spec_steps)
        m.path = (t.prefill_worker,) + ((w,) if w != t.prefill_worker else ())
        t.output = dataclasses.replace(output, request_id=t.request_id, prompt=t.prompt, metrics=m)
        self.end(t)

    def fail(self, t: RequestRecord, error: Exception) -> None:
        t.metrics.finish_time = time.perf_counter()
        t.output = RequestOutput(t.request_id, t.prompt, t.prompt_token_ids, [], t.metrics, error=error)
        self.end(t)

    def end(self, t: RequestRecord) -> None:
        """Retire t; a top-level request that is now complete goes to `ended`."""
        t.phase = "done"
        self.done[t.request_id] = self.active.pop(t.request_id)
        if t.parent is None:
            self.ended.append(t.request_id)
            return
        parent = self.active[t.parent]
        if any(s not in self.done for s in parent.samples):
            return
        samples = [self.done.pop(s) for s in parent.samples]
        errors = [s.output.error for s in samples if s.output.error is not None]
        outs = [dataclasses.replace(s.output.outputs[0], index=j) for j, s in enumerate(samples)
                if not s.output.error]
        ms = [s.metrics for s in samples]
        parent.metrics = dataclasses.replace(ms[0], finish_time=max(m.finish_time or 0.0 for m in ms))
        parent.output = RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids,
                                      [] if errors else outs, parent.metrics,
                                      error=errors[0] if errors else None,
                                      prompt_logprobs=None if errors else samples[0].output.prompt_logprobs)
        self.end(parent)

    def restart(self, t: RequestRecord) -> bool:
        """Make t's next attempt start from its prompt, if it has not had one already; False
        if it has (its path broke twice)."""
        if t.retried:
            return False
        t.retried, t.tokens, t.logprobs, t.worker, t.prefill_worker = True, [], [], None, None
        t.metrics = RequestMetrics(t.metrics.arrival_time)
        return True

    def take_ended(self) -> list[int]:
        """The ids ended since the last call."""
        ended, self.ended = self.ended, []
        return ended

    def output(self, request_id: int) -> RequestOutput:
        """An ended request's output; it is forgotten."""
        return self.done.pop(request_id).output

    def forget(self, request_id: int) -> RequestRecord | None:
        """Forget a request, ended or not; its record if it was active. One that ended but
        was not polled yet leaves `ended` too: no poll hands out an id that has no output."""
        if self.done.pop(request_id, None) is not None and request_id in self.ended:
            self.ended.remove(request_id)
        return self.active.pop(request_id, None)
