"""The single-device engine: requests in (submit), one step at a time (step), outputs out
(output). The offline LLM (llm.py) drives it through submit / poll / output, the same
interface the cluster of workers offers (cluster.py); a worker (workers.py) drives one per
device.

How a step works:
  1. Scheduler.schedule (scheduler.py) picks this step's work.
  2. ModelRunner.run (runner.py) runs the model on it and samples on the device: a token
     for every sequence whose last token was computed.
  3. The host takes the tokens, checks stop conditions and retires finished requests.
  Steps overlap: the host takes step N's tokens (stop checks, outputs) after launching
  step N+1, which reads them on the device (PENDING ids), so the GPU is not left idle
  while Python does its bookkeeping.

Parallel sampling (n > 1) prefills the prompt once and forks the sequence (copy-on-write).
Features beyond the plain engine are subclasses in files of their own, which change a step
at a few named points (the methods under "what a feature changes" below); make_engine
builds the engine a config asks for (config.py:FEATURES). A first reading can skip them all.
"""

import dataclasses
import gc
import importlib
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nanopd.config import EngineConfig
from nanopd.kv_cache import BlockManager
from nanopd.model import Detokenizer, eos_ids, load_model, load_tokenizer
from nanopd.request import (
    PENDING,
    CompletionOutput,
    Logprob,
    NewTokens,
    Request,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    Sequence,
    Status,
    check_request,
    seeded_generator,
    tokenize,
)
from nanopd.runner import Lane, ModelRunner, PromptScore, StepOutput
from nanopd.sampler import Draw, bad_word_bans
from nanopd.scheduler import Batch, Scheduler


def logprob_entry(token: int, token_logprob: float, rank: int, top_values: list[float], top_ids: list[int],
                  k: int) -> dict[int, Logprob]:
    """A token's logprobs entry, an output's or a prompt's (as vLLM's): the k most likely
    tokens' (ranks 1..k) and its own (its text is added at output)."""
    entry = {t: Logprob(v, r) for r, (t, v) in enumerate(zip(top_ids[:k], top_values[:k]), 1)}
    entry[token] = Logprob(token_logprob, rank)
    return entry


def banned_tokens(eos_ids: set[int], seq: Sequence, before: list[int] = ()
                  ) -> tuple[list[int], list[tuple[int, int]]]:
    """The tokens seq's next token (after the tokens ahead `before`) may not be: before
    min_tokens, EOS and the stop ids; a bad word's last token where the output ends in the
    rest of it. And the bad words' bans that wait for a PENDING last token
    (sampler.bad_word_bans)."""
    params = seq.request.params
    banned = []
    if seq.num_outputs + len(before) < params.min_tokens:
        banned = list(params.stop_token_ids) + ([] if params.ignore_eos else sorted(eos_ids))
    if not params.bad_words_token_ids:
        return banned, []
    words, if_pending = bad_word_bans(params.bad_words_token_ids,
                                      seq.token_ids[seq.num_prompt_tokens:] + list(before))
    return banned + words, if_pending


def record_logprobs(seq: Sequence, token: int, token_logprob: float, rank: int,
                    top_values: list[float], top_ids: list[int]) -> None:
    """The chosen token's and the top k's logprobs and ranks (their text is added at output)."""
    seq.logprobs.append(logprob_entry(token, token_logprob, rank, top_values, top_ids,
                                      seq.request.params.logprobs))
    seq.cumulative_logprob += token_logprob


def record_prompt_logprobs(step: "LaunchedStep") -> None:
    """Each prompt token the step scored: its entry, as an output token's, appended to its
    request's prompt_logprobs (steps finish in launch order: the entries in prompt order)."""
    scored = iter(step.output.scored())
    for req, targets in step.scored:
        for token, (token_logprob, rank, top_values, top_ids) in zip(targets, scored):
            req.prompt_logprobs.append(logprob_entry(token, token_logprob, rank, top_values, top_ids,
                                                     req.params.prompt_logprobs))


def found_stop_string(seq: Sequence, new_text: str) -> bool:
    """Whether the text new_text added to seq's output completes a stop string; if so,
    stop_reason is the string and text_end where the output's text ends (before the
    string unless include_stop_str_in_output). A stop string may span tokens: it is
    looked for in the new text and the few characters before it, the earliest first."""
    params, text = seq.request.params, seq.detokenizer.text
    start = max(0, len(text) - len(new_text) - max(map(len, params.stop)) + 1)
    found = min(((at, s) for s in params.stop if (at := text.find(s, start)) >= 0), default=None)
    if found is None:
        return False
    at, seq.stop_reason = found
    seq.text_end = at + len(found[1]) * params.include_stop_str_in_output
    return True


def plan_prompt_scores(batch: Batch) -> list[PromptScore]:
    """The prompt positions this step scores for prompt_logprobs: position p of a prompt
    chunk, up to the prompt's last but one, against prompt token p + 1 (the last
    position's logits are the first output token's draw). A chunk's last position scores
    the next chunk's first token, so no position is lost or doubled at a border; a prompt
    recomputed after preemption scores none again (Request.num_prompt_scored)."""
    scores = []
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new)):
        req = seq.request
        if not req.scores_prompt:
            continue
        first = max(seq.num_computed, req.num_prompt_scored)
        end = min(seq.num_computed + n, seq.num_prompt_tokens - 1)
        if first < end:
            scores.append(PromptScore(i, first - seq.num_computed, seq.token_ids[first + 1:end + 1],
                                      req.params.prompt_logprobs))
            req.num_prompt_scored = end
    return scores


@dataclass
class StepShape:
    """What one step computed: the router refits its step-time model on these (router.py)."""
    decodes: int = 0          # sequences that computed one token past their prompt
    context_tokens: int = 0   # ... and the tokens of context they read
    prefill_tokens: int = 0   # prompt tokens computed beside them


def step_shape(batch: Batch) -> StepShape:
    """A step's decodes, their context and its prompt tokens (prefix hits excluded)."""
    shape = StepShape()
    for seq, n in zip(batch.seqs, batch.num_new):
        if seq.num_computed < seq.num_prompt_tokens:
            shape.prefill_tokens += min(n, seq.num_prompt_tokens - seq.num_computed)
        else:
            shape.decodes, shape.context_tokens = shape.decodes + 1, shape.context_tokens + seq.num_computed
    return shape


@dataclass
class LaunchedStep:
    """A step whose sampled tokens are still on their way to the host (see Engine.step)."""
    batch: Batch
    seqs: list[Sequence]                 # the sequences whose last token this step computed
    shape: StepShape
    lane: Lane                           # where it runs
    output: StepOutput | None = None
    # per ordinary draw (those after the first num_extra): where its token goes
    targets: list[tuple[Sequence, int]] = field(default_factory=list)
    launched_at: float = field(default_factory=time.perf_counter)
    num_extra: int = 0                   # its first draws are a feature's (Engine._extra_draws)
    extra: object = None                 # ... and that feature's record of them
    # prompt_logprobs: per request, the prompt tokens it scores, in order
    scored: list[tuple[Request, list[int]]] = field(default_factory=list)

    def sequences(self) -> set[Sequence]:
        """The sequences this step computes or samples for."""
        return set(self.batch.seqs) | {seq for seq, _ in self.targets}


WARM_UP = [SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0, logprobs=1,
                          prompt_logprobs=1),
           SamplingParams(max_tokens=2, ignore_eos=True, temperature=1.0, top_k=2, top_p=0.9, seed=0,
                          min_tokens=1, repetition_penalty=1.1, presence_penalty=0.1, frequency_penalty=0.1)]


class Engine:
    features: tuple[str, ...] = ()   # the config's features this engine serves (EngineConfig.features)
    scheduler_class = Scheduler      # a feature's engine may bring its own scheduler, runner
    runner_class = ModelRunner       # and sequences
    sequence_class = Sequence

    def __init__(self, cfg: EngineConfig):
        missing = [f for f in cfg.features() if f not in self.features]
        if missing:
            raise ValueError(f"{', '.join(missing)} asks for a feature this engine lacks: "
                             "make_engine(cfg) builds the engine a config asks for")
        cfg.validate()
        torch.manual_seed(cfg.seed)   # vLLM's seed: where requests without a seed of their own draw from
        self.model = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device, seed=cfg.seed)
        config = self.model.config
        cfg.max_model_len = min(cfg.max_model_len, config.max_position_embeddings)
        self.cfg = cfg
        self.tokenizer = load_tokenizer(cfg.tokenizer or cfg.model)
        self.eos_ids = eos_ids(config)
        self.runner = self.runner_class(self.model, cfg)
        self.scheduler = self.scheduler_class(BlockManager(self.runner.num_blocks, cfg.block_size,
                                                           enable_prefix_caching=cfg.enable_prefix_caching),
                                              cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.requests: dict[int, Request] = {}      # submitted, output not yet taken
        self.in_flight: LaunchedStep | None = None   # launched, its tokens not yet taken
        self._request_ids = itertools.count()
        self._plug_in()
        if self.model.device.type == "cuda":
            self._warm_up()
        # What is built so far (the model, its graphs, the tokenizer) lives as long as the
        # engine. Frozen, it is out of the way of Python's full collections, which a step's
        # allocations set off every so often and which walked all of it: at a batch of 1,024
        # that was a quarter of the host's time per step (vLLM freezes its start-up heap too).
        gc.collect()
        gc.freeze()

    def _warm_up(self) -> None:
        """Serve two short requests, one greedy with logprobs and one sampled with top-k,
        top-p, a seed, penalties and min_tokens, through the whole step path, so that no
        request served later pays a one-off cost: CUDA loads a kernel at its first launch,
        Triton compiles (or loads) a kernel at its first use, the first copies set up their
        buffers. Such a cost inside a step also delays every message a worker has not read
        yet (an Import waits in the inbox while the step runs)."""
        names = itertools.count(-1, -1)   # ids no request sent from outside has
        ids = [self.submit([0] * self._warm_up_len(), p, request_id=next(names)) for p in WARM_UP]
        self._serve_warm_up(ids, names)

    def _warm_up_len(self) -> int:
        """The warm-up's prompt length: two tokens, or what max_model_len leaves room for."""
        return max(1, min(2, self.cfg.max_model_len - 2))

    def _serve_warm_up(self, ids: list[int], names: itertools.count) -> None:
        """Step until the warm-up's requests (ids) end, then forget them; names: more ids."""
        while self.has_unfinished():
            self.step()
        for request_id in ids:
            self.output(request_id)

    @property
    def bm(self) -> BlockManager:
        """The block manager, for inspection: the scheduler owns every block's lifetime."""
        return self.scheduler.bm

    # -- what a feature changes (config.py:FEATURES): these points of a step

    def _plug_in(self) -> None:
        """Set up what a feature adds, before the warm-up's first step (nothing here)."""

    def _before_schedule(self) -> None:
        """Work before a step is scheduled (nothing here)."""

    def _after_schedule(self, batch: Batch) -> None:
        """Work once a step's batch is chosen (nothing here)."""

    def _extra_draws(self, batch: Batch, done: list[int], plan: list[tuple[int, int]], step: "LaunchedStep"
                     ) -> tuple[list[Draw], Callable[[StepOutput], None] | None]:
        """Draws to make before the ordinary ones (plan, per draw (row, j)), recording what
        they are for in step.extra; and more work on the step's output on the device (the
        runner's `after`). None here."""
        return [], None

    def _host_needs_now(self, step: "LaunchedStep") -> bool:
        """Whether the host must take step's tokens before the next step is scheduled, giving
        up the overlap (never here)."""
        return False

    def _take_tokens(self, step: "LaunchedStep", tokens: list[int], logprobs: dict) -> None:
        """Fill each target of the step with its sampled token (tokens: every draw's)."""
        extra = step.num_extra
        for k, ((seq, index), token) in enumerate(zip(step.targets, tokens[extra:])):
            self._take_sampled(seq, index, token, extra + k, logprobs)

    def _take_sampled(self, seq: Sequence, index: int, token: int, draw: int, logprobs: dict) -> None:
        """seq's PENDING token at index is `token`, sampled by draw: in its place, then its
        logprobs and stop check (unless seq stopped one step earlier: the token is void)."""
        if seq.status == Status.FINISHED:
            return
        seq.token_ids[index] = token
        if index == len(seq.token_ids) - 1:   # no later step has sampled after it yet
            seq.pending_row = None
        self._take_token(seq, index, draw, logprobs)

    # -- requests in

    def submit(self, prompt: str | list[int], params: SamplingParams, request_id: int | None = None) -> int:
        """Validate and queue a request; its id. A bad one raises ValueError and changes nothing."""
        text, ids = tokenize(prompt, self.tokenizer)
        ids, params = check_request(ids, params, self.model.config.vocab_size, self.tokenizer, self.cfg,
                                    self.bm.num_blocks - self.bm.watermark_blocks)
        req = Request(next(self._request_ids) if request_id is None else request_id, text, ids, params,
                      RequestMetrics(time.perf_counter()))
        self._add_seq(req, 0, list(ids))   # first: if it raises, nothing is registered
        self.requests[req.request_id] = req
        return req.request_id

    def _add_seq(self, req: Request, index: int, token_ids: list[int]) -> Sequence:
        seq = self.sequence_class(req, index, token_ids, len(req.prompt_token_ids), arrival=req.arrival,
                                  generator=seeded_generator(req.params, index, self.model.device))
        req.seqs.append(seq)
        self.scheduler.add(seq)
        return seq

    def fork(self, seq: Sequence, index: int, generator: torch.Generator | None = None) -> Sequence:
        """A running child sharing every block of seq (copy-on-write); its own generator
        (seeded seed + index) unless given one."""
        generator = generator or seeded_generator(seq.request.params, index, self.model.device)
        child = self.sequence_class(seq.request, index, list(seq.token_ids), seq.num_prompt_tokens,
                                    num_computed=seq.num_computed, cumulative_logprob=seq.cumulative_logprob,
                                    logprobs=list(seq.logprobs), generator=generator)
        self.scheduler.fork(seq, child)
        seq.request.seqs.append(child)
        return child

    def set_token_budget(self, tokens: int | None) -> None:
        """Cut every step to this many tokens, decodes and prompt chunks together, from the
        next step on (None: max_num_batched_tokens again)."""
        self.scheduler.token_budget = tokens

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self.in_flight is not None

    # -- one step: launch it, then finish the previous one while the device computes

    def step(self) -> list[int]:
        """Schedule and launch a batch, then finish the step launched before it, whose
        sampled tokens were copied to the host meanwhile: the host's bookkeeping overlaps
        the device's work instead of leaving it idle. Returns the ids of the requests that
        finished. A step that raises ends the requests it carried with that error; the
        engine goes on serving the others."""
        self._before_schedule()
        batch = self.scheduler.schedule()
        self._after_schedule(batch)
        if not batch.seqs and self.in_flight is None:
            return self._end_unschedulable()
        try:
            launched = self._launch(batch, self.runner.full_gpu, self.in_flight) if batch.seqs else None
            finished = self._finish(self.in_flight) if self.in_flight else []
        except Exception as e:  # noqa: BLE001 (the requests end with it; nothing else is lost)
            return self._fail_step([batch], e)
        self.in_flight = launched
        if launched is not None and self._host_needs_now(launched):
            finished += self._finish(launched)
            self.in_flight = None
        return [r.request_id for r in finished]

    def poll(self, timeout: float = 0.0) -> list[int]:
        """Run a step if there is work, else wait timeout seconds; the ids of requests that
        ended (LLM's loop, which polls a cluster the same way)."""
        if self.has_unfinished():
            return self.step()
        time.sleep(timeout)
        return []

    def _launch(self, batch: Batch, lane: Lane, previous: LaunchedStep | None) -> LaunchedStep:
        """Run the model on the batch on lane and sample on the device; each sampled sequence
        gets a PENDING token, filled in by _finish (from previous, the lane's step in flight,
        where a sequence's last token is still PENDING)."""
        # the rows whose last token this step computes (a prompt's last chunk, a decode)
        done = [i for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new)) if n >= s.num_pending]
        seqs = [batch.seqs[i] for i in done]
        step = LaunchedStep(batch, seqs, step_shape(batch), lane)
        plan, draws = self._plan_draws(batch, done)
        extra, after = self._extra_draws(batch, done, plan, step)
        step.num_extra = len(extra)
        scores = plan_prompt_scores(batch)
        step.scored = [(batch.seqs[s.row].request, s.targets) for s in scores]
        prev_tokens = previous.output.tokens if previous else None
        step.output = self.runner.run(batch, extra + draws, prev_tokens, lane, scores, after)
        self.scheduler.computed(batch)
        targets = [batch.seqs[i] if j == 0 else self.fork(batch.seqs[i], j, d.generator)
                   for (i, j), d in zip(plan, draws)]
        for k, seq in enumerate(targets):
            seq.token_ids.append(PENDING)
            seq.pending_row = step.num_extra + k
            step.targets.append((seq, len(seq.token_ids) - 1))
        return step

    def _plan_draws(self, batch: Batch, done: list[int]) -> tuple[list[tuple[int, int]], list[Draw]]:
        """The tokens to sample after the sequences batch.seqs[done]: per draw (row, j) and
        its Draw. n > 1: a prompt's only sequence is forked once its first token is sampled,
        and each child j draws its own first token from the same logits, with its own
        generator. This runs for every sequence of every step: a request that adjusts no
        logits (Request.adjusts) costs one plain Draw. A sequence with tokens ahead
        (Batch.ahead) draws after the last of them, counting them as its own."""
        plan, draws = [], []
        for i in done:
            seq = batch.seqs[i]
            req = seq.request
            for j in range(req.params.n if seq.num_outputs == 0 else 1):
                g = seq.generator if j == 0 else seeded_generator(req.params, j, self.model.device)
                plan.append((i, j))
                if not req.adjusts:   # most draws: plain
                    draws.append(Draw(i, req.params, g))
                    continue
                before = batch.ahead.get(seq)
                banned = banned_tokens(self.eos_ids, seq, before or ())
                draws.append(Draw(i, req.params, g, seq, j > 0, *banned, before=before))
        return plan, draws

    def _finish(self, step: LaunchedStep) -> list[Request]:
        """Fill a launched step's PENDING tokens, record logprobs, stop sequences. Returns the
        requests that finished."""
        tokens, logprobs = step.output.collect()
        if step.scored:
            record_prompt_logprobs(step)
        now = time.perf_counter()
        for seq in step.seqs:
            if seq.request.metrics.first_token_time is None:
                seq.request.metrics.first_token_time = now
        self._take_tokens(step, tokens, logprobs)
        return self._finished(step, now)

    def _take_token(self, seq: Sequence, index: int, draw: int, logprobs: dict) -> None:
        """seq's token at index, sampled by draw, is known: its logprobs, then its stop check."""
        if draw in logprobs:
            record_logprobs(seq, seq.token_ids[index], *logprobs[draw])
        self._check_stop(seq, index)

    def _finished(self, step: LaunchedStep, now: float) -> list[Request]:
        """The requests that finished with step: a sequence of theirs stopped (and, n > 1, its
        siblings had)."""
        touched = {s.request: None for s, _ in step.targets if s.status == Status.FINISHED}
        finished = []
        for req in touched:
            if req.finished and req.metrics.finish_time is None and req.request_id in self.requests:
                req.metrics.finish_time = now
                finished.append(req)
        return finished

    # -- stops, logprobs

    def _check_stop(self, seq: Sequence, index: int) -> None:
        """Finish seq if its token at index ends it (from min_tokens on: EOS, a stop token, a
        stop string completed in the text; or max_tokens); a later token, already sampled
        by the step running now, is dropped."""
        params, num_outputs, token = (seq.request.params, index + 1 - seq.num_prompt_tokens,
                                      seq.token_ids[index])
        new_text = self._add_text(seq, index) if params.stop else ""
        if num_outputs >= params.min_tokens and (token in self.eos_ids and not params.ignore_eos
                                                 or token in params.stop_token_ids
                                                 or new_text and found_stop_string(seq, new_text)):
            seq.finish_reason = "stop"
            if token in params.stop_token_ids:
                seq.stop_reason = token
        elif num_outputs >= params.max_tokens:
            seq.finish_reason = "length"
        else:
            return
        self._stop(seq, index)

    def _stop(self, seq: Sequence, index: int, free: bool = True) -> None:
        """seq ends with its token at index (a later one, sampled by the step running now, is
        dropped); free=False keeps its blocks."""
        del seq.token_ids[index + 1:]
        seq.pending_row = None
        self._end(seq, free=free)

    def _add_text(self, seq: Sequence, index: int) -> str:
        """Detokenize seq's output up to its token at index; the text that token added."""
        return detokenized(seq, index, self.tokenizer).add(seq.token_ids[index])

    # -- requests that end early: aborted, failed, or unable to run

    def abort(self, request_ids: list[int]) -> None:
        """End these requests now and forget them, wherever they are (waiting, running, or
        held by a feature's engine); their blocks go back. A step in flight drops their tokens."""
        for request_id in request_ids:
            req = self.requests.pop(request_id, None)
            if req is not None:
                self._retire(req)
        step = self.in_flight
        if step is not None and all(s.request.request_id not in self.requests for s in step.sequences()):
            self.in_flight = None   # nothing left to take from it

    def _end_unschedulable(self) -> list[int]:
        """Nothing was scheduled, nothing is in flight: no later step can differ from this
        one (unless a feature's engine says more will come). End the requests that hold the
        engine still, with an error saying what they need, rather than spin: the running
        ones if any (none of them could compute), else the first in the queue (it cannot fit
        even in an empty engine). Their ids."""
        sched = self.scheduler
        if not sched.has_work():
            return []
        stuck = {s.request: None for s in sched.running} or {sched.waiting[0].request: None}
        bm, cfg = self.bm, self.cfg
        error = RuntimeError(
            f"no step could make progress: {len(sched.running)} sequences running, "
            f"{len(sched.waiting)} waiting, {bm.num_free_blocks} of {bm.num_blocks} KV blocks free "
            f"({bm.watermark_blocks} kept back), {cfg.max_num_seqs} seats (max_num_seqs), a step budget "
            f"of {cfg.max_num_batched_tokens} tokens (max_num_batched_tokens): a larger num_kv_blocks or "
            "max_num_seqs may let it run")
        for req in stuck:
            self._retire(req)
            req.error, req.metrics.finish_time = error, time.perf_counter()
        return [req.request_id for req in stuck]

    def _fail_step(self, batches: list[Batch], error: Exception, *launched: LaunchedStep | None) -> list[int]:
        """End every request of the batches and of the step in flight (and of launched,
        steps of this one already on the device) with error, freeing all they hold; their ids."""
        steps = [s for s in (self.in_flight, *launched) if s is not None]
        self.in_flight = None
        if steps and self.model.device.type == "cuda":   # nothing launched may still write what is freed here
            try:
                torch.cuda.synchronize(self.model.device)
            except RuntimeError:   # the device itself failed: the error below says so
                pass
        involved = {s.request: None for batch in batches for s in batch.seqs}
        for step in steps:
            involved.update({s.request: None for s in step.sequences()})
        ended = []
        for req in involved:
            if req.request_id in self.requests and req.metrics.finish_time is None:
                self._retire(req)
                req.error, req.metrics.finish_time = error, time.perf_counter()
                ended.append(req.request_id)
        return ended

    def _retire(self, req: Request) -> None:
        """Finish every sequence of req and give back every block it holds."""
        for seq in req.seqs:
            if seq.status != Status.FINISHED:
                self._end(seq)

    def _end(self, seq: Sequence, free: bool = True) -> None:
        """seq is finished: the scheduler retires it (free=False keeps its blocks), and its
        token counts, if the penalties kept any, go back."""
        self.scheduler.finish(seq, free=free)
        self.runner.token_counts.forget(seq)

    # -- outputs

    def new_tokens(self, text: bool = False) -> dict[int, NewTokens]:
        """Output tokens of the running single-completion requests since the last call, with
        their logprobs if asked, and with text=True each one's text so far (what a stream
        shows; a worker's reports leave it to the central process). n > 1 reports its
        completions when done."""
        new = {}
        for req in self.requests.values():
            if req.params.n > 1:
                continue
            seq = req.seqs[0]
            # output tokens known (the last may be PENDING)
            known = len(seq.token_ids) - (seq.pending_row is not None) - seq.num_prompt_tokens
            if known > req.num_streamed:
                ids = seq.token_ids[seq.num_prompt_tokens + req.num_streamed:seq.num_prompt_tokens + known]
                logprobs = None if req.params.logprobs is None else seq.logprobs[req.num_streamed:known]
                so_far = text_so_far(seq, known, self.tokenizer) if text else None
                new[req.request_id], req.num_streamed = NewTokens(ids, logprobs, so_far), known
        return new

    def output(self, request_id: int) -> RequestOutput:
        """A finished request's output (none but its .error if it failed); the engine forgets it."""
        req = self.requests.pop(request_id)
        want_lp = req.params.logprobs is not None
        seqs = [] if req.error else sorted(req.seqs, key=lambda s: s.index)
        outs = [CompletionOutput(s.index, s.output_ids, completion_text(s, self.tokenizer), s.finish_reason,
                                 s.cumulative_logprob if want_lp else None,
                                 decoded(s.logprobs, self.tokenizer) if want_lp else None, s.stop_reason)
                for s in seqs]
        prompt_logprobs = (None if req.error or req.prompt_logprobs is None
                           else decoded(req.prompt_logprobs, self.tokenizer))
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, req.metrics,
                             finished=req.finished, error=req.error, prompt_logprobs=prompt_logprobs)


def detokenized(seq: Sequence, upto: int, tokenizer) -> Detokenizer:
    """seq's detokenizer, made at first use (after an import or a fork, from the tokens the
    sequence came with) and fed its tokens before position upto: one a sequence, so its text
    is decoded once, for stop strings (Engine._add_text) and streams (text_so_far) alike."""
    if seq.detokenizer is None:
        seq.detokenizer = Detokenizer(tokenizer, skip_special_tokens=seq.request.params.skip_special_tokens)
    detok, start = seq.detokenizer, seq.num_prompt_tokens
    for token in seq.token_ids[start + len(detok.ids):upto]:
        detok.add(token)
    return detok


def text_so_far(seq: Sequence, known: int, tokenizer) -> str:
    """The text of seq's first known output tokens (cut where a stop string ended it)."""
    return detokenized(seq, seq.num_prompt_tokens + known, tokenizer).text[:seq.text_end]


def completion_text(seq: Sequence, tokenizer) -> str:
    """The completion's text: cut where its stop string was found, else its tokens decoded
    (without the special tokens unless skip_special_tokens is False)."""
    if isinstance(seq.stop_reason, str):
        return seq.detokenizer.text[:seq.text_end]
    skip = seq.request.params.skip_special_tokens
    return tokenizer.decode(seq.output_ids, skip_special_tokens=skip)


def decoded(logprobs: list[dict[int, Logprob] | None], tokenizer) -> list[dict[int, Logprob] | None]:
    """logprobs with each token's text (decoded alone, as vLLM's decoded_token)."""
    decode = tokenizer.decode
    return [None if entry is None else
            {t: dataclasses.replace(lp, decoded_token=decode([t])) for t, lp in entry.items()}
            for entry in logprobs]


def engine_class(cfg: EngineConfig) -> type[Engine]:
    """The engine cfg asks for: the plain Engine, or the subclass serving the feature it names
    (config.py:FEATURES), whose file is loaded only then."""
    where = cfg.engine_class()
    if where is None:
        return Engine
    module, name = where.split(":")
    return getattr(importlib.import_module(module), name)


def make_engine(cfg: EngineConfig) -> Engine:
    return engine_class(cfg)(cfg)
