"""The single-device engine: requests in (submit), one step at a time (step), outputs out
(output). The offline LLM (nanopd.py) drives it through submit / poll / output, the same
interface the cluster of workers offers (cluster.py); a worker (workers.py) drives one per
device, adding the handoff's parking, importing and releasing.

How a step works:
  1. Scheduler.schedule (scheduler.py) picks this step's work.
  2. ModelRunner.run (runner.py) runs the model on it and samples on the device: a token
     for every sequence whose last token was computed (or, in beam search, its candidate
     continuations).
  3. The host takes the tokens, checks stop conditions and retires finished requests.
  Steps overlap: the host takes step N's tokens (stop checks, outputs) after launching
  step N+1, which reads them on the device (PENDING ids), so the GPU is not left idle
  while Python does its bookkeeping. Beam search, which chooses on the host, waits.

Parallel sampling (n > 1) prefills the prompt once and forks the sequence; beam search
forks and frees sequences each step. Both share blocks through the scheduler's
copy-on-write forks.
"""

import collections
import itertools
import time
from dataclasses import dataclass, field

import torch

from config import EngineConfig
from kv_cache import BlockManager, cdiv
from model import Detokenizer, Qwen3, load_model, load_tokenizer
from request import (
    PENDING,
    CompletionOutput,
    Request,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    Sequence,
    Status,
    check_request,
    tokenize,
)
from runner import Draw, Lane, ModelRunner, StepOutput
from scheduler import Batch, Scheduler
from smsplit import Split, load_kernels_at_start
from speculate import DRAFTERS, can_speculate, due, num_accepted, rewind


@dataclass
class StepShape:
    """What one step computed: the router refits its step-time model on these (router.py)."""
    decodes: int = 0          # sequences that computed one token past their prompt
    context_tokens: int = 0   # ... and the tokens of context they read
    prefill_tokens: int = 0   # prompt tokens computed beside them


@dataclass
class LaunchedStep:
    """A step whose sampled tokens are still on their way to the host (see Engine.step)."""
    batch: Batch
    seqs: list[Sequence]                 # the sequences whose last token this step computed
    beams: list[Sequence]                # ... those in beam search: the host picks their tokens
    shape: StepShape
    output: StepOutput | None = None
    targets: list[tuple[Sequence, int]] = field(default_factory=list)   # per draw: where its token goes
    lane: Lane | None = None             # where it runs
    launched_at: float = field(default_factory=time.perf_counter)
    drafted: dict[Sequence, "Drafted"] = field(default_factory=dict)   # the sequences whose drafts it checks
    num_checks: int = 0                  # its first draws: a token after each draft's position (Drafted)

    def computing(self) -> set[Sequence]:
        """The sequences this step computes or samples for (the other lane leaves them alone)."""
        return set(self.batch.seqs) | {seq for seq, _ in self.targets}


@dataclass
class Drafted:
    """A sequence whose drafts a step checks (speculate.py): the step samples a token after
    its last token and after each draft but the last (the check draws, from `checks` on),
    and after the last draft (its ordinary draw)."""
    drafts: list[int]
    checks: int
    generator_state: torch.Tensor | None   # a seeded sampled sequence's generator before the step
    branches: list[tuple[Sequence, list[int], int]] = field(default_factory=list)   # (branch, drafts, checks)


@dataclass
class PrefillLaneStep:
    """A split worker's prompt chunk, done: what it computed, where (lane.split: None is
    the whole GPU), and the ms its lane was taken by it, from its launch until the host saw
    its tokens (the lane's next chunk starts only then)."""
    shape: StepShape
    split: Split | None
    ms: float


def computing(step: LaunchedStep | None) -> set[Sequence]:
    """The sequences a lane's step in flight computes (none if no step)."""
    return step.computing() if step is not None else set()


def wait_for(lane: Lane, step: LaunchedStep | None) -> None:
    """lane's next work starts on the device only once step (another lane's) has ended."""
    if step is not None and step.output.ready is not None:
        (lane.stream or torch.cuda.current_stream()).wait_event(step.output.ready)


class Engine:
    def __init__(self, cfg: EngineConfig):
        if cfg.splits_sms:   # before anything asks CUDA about the device (validate does)
            load_kernels_at_start()
        cfg.validate()
        self.model = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device, seed=cfg.seed)
        config = self.model.config
        cfg.max_model_len = min(cfg.max_model_len, config.max_position_embeddings)
        self.cfg = cfg
        self.tokenizer = load_tokenizer(cfg.model)
        eos = config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        spec = cfg.speculative_config
        draft = self._load_draft(spec) if spec is not None and spec.method == "draft_model" else None
        self.runner = ModelRunner(self.model, cfg, draft)
        self.scheduler = Scheduler(BlockManager(self.runner.num_blocks, cfg.block_size,
                                                enable_prefix_caching=cfg.enable_prefix_caching),
                                   cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.requests: dict[int, Request] = {}      # submitted, output not yet taken
        self.in_flight: LaunchedStep | None = None   # launched, its tokens not yet taken (split: the decode lane's)
        self.split: Split | None = None              # the SM split steps run on (None: the whole GPU)
        self.prefilling: LaunchedStep | None = None  # split: the prefill lane's step in flight
        self.fence_decode = False                    # the decode lane's next step waits for the prefill lane's
        self.ended_between: list[int] = []           # requests that finished while the split changed
        # Done since a worker last took them (bounded: an offline engine has nobody taking them).
        self.prefill_lane_steps: collections.deque[PrefillLaneStep] = collections.deque(maxlen=1024)
        self._request_ids = itertools.count()
        self.num_steps = 0                           # whole-GPU steps so far (speculate.due counts them)
        self.drafter = DRAFTERS[spec.method](spec, self.runner, self.scheduler.reserve_slots) \
            if spec is not None else None   # speculate.py
        if self.model.device.type == "cuda":
            for split in [None, *self.runner.splits]:   # every lane of the menu, first the whole GPU
                self.set_split(split)
                self._warm_up()
            self.prefill_lane_steps.clear()   # the warm-up's chunks: no work anyone sent
        self.set_split(cfg.sm_split)

    def _warm_up(self) -> None:
        """Serve two short requests, one greedy with logprobs and one sampled with top-k,
        top-p and a seed, through the whole step path, so that no request served later
        pays a one-off cost: CUDA loads a kernel at its first launch (a split worker's at
        start, smsplit.load_kernels_at_start), Triton compiles (or loads) a kernel at its
        first use, the first copies set up their buffers. Such a cost inside a step also
        delays every message the worker has not read yet (an Import waits in the inbox
        while the step runs). The sampled one has penalties and min_tokens too, so their
        kernels are compiled here.
        On a split, its two lanes too (a lane is taken only while the other has work): the
        two, and short requests in every other seat, decode on the decode lane beside the
        biggest prompt chunk on the prefill lane, so that each lane's stream has run its
        biggest step and keeps the memory for it. A stream that allocates from the driver
        mid-serve waits for the whole device: a decode step, for the chunk beside it."""
        n, bs = max(1, min(2, self.cfg.max_model_len - 2)), self.cfg.block_size
        params = [SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0, logprobs=1),
                  SamplingParams(max_tokens=2, ignore_eos=True, temperature=1.0, top_k=2, top_p=0.9, seed=0,
                                 min_tokens=1, repetition_penalty=1.1, presence_penalty=0.1, frequency_penalty=0.1)]
        names = itertools.count(-1, -1)   # ids no request sent from outside has
        ids = [self.submit([0] * n, p, request_id=next(names)) for p in params]
        if self.split is not None:
            room = self.bm.num_blocks - self.bm.watermark_blocks - len(ids) * cdiv(n + 2, bs)   # blocks left
            chunk = max(1, min(self.cfg.max_num_batched_tokens, room // 2 * bs))
            longest = self.cfg.max_model_len - 1
            prompts = [min(longest, chunk - i) for i in range(0, chunk, longest)]   # the chunk, in prompts that fit
            blocks = sum(cdiv(p + 1, bs) for p in prompts)
            seats = max(0, min(self.cfg.max_num_seqs - len(ids) - len(prompts), (room - blocks) // cdiv(n + 3, bs)))
            short = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0)
            ids += [self.submit([0] * n, short, request_id=next(names)) for _ in range(seats)]
            self.step()   # their prompts, on the whole GPU (nothing decodes yet)
            first = 1 + list(self.runner.splits).index(self.split) * len(prompts)   # prompts no cache has seen
            ids += [self.submit([first + j] * p, SamplingParams(max_tokens=1), request_id=next(names))
                    for j, p in enumerate(prompts)]
        while self.has_unfinished():
            self.step()
        for request_id in ids:
            self.output(request_id)

    def _load_draft(self, spec) -> Qwen3:
        """draft_model's model, on the target's device in its dtype; its vocabulary must be the target's."""
        cfg = self.cfg
        draft = load_model(spec.model, dtype=self.model.dtype, device=self.model.device, seed=cfg.seed + 1)
        if draft.config.vocab_size != self.model.config.vocab_size:
            raise ValueError(f"speculative_config's draft model {spec.model!r} has a vocabulary of "
                             f"{draft.config.vocab_size} tokens, the model {self.model.config.vocab_size}: "
                             "a draft must share the model's tokenizer")
        return draft

    @property
    def bm(self):
        """The block manager, for inspection: the scheduler owns every block's lifetime."""
        return self.scheduler.bm

    # -- requests in

    def submit(self, prompt: str | list[int], params: SamplingParams, beam_width: int = 0,
               length_penalty: float = 1.0, request_id: int | None = None, prefill_only: bool = False) -> int:
        """Validate and queue a request; its id. A bad one raises ValueError and changes nothing."""
        text, ids = tokenize(prompt, self.tokenizer)
        params = check_request(ids, params, beam_width, self.model.config.vocab_size, self.cfg,
                               self.bm.num_blocks - self.bm.watermark_blocks, length_penalty)
        req = Request(next(self._request_ids) if request_id is None else request_id, text, ids, params,
                      RequestMetrics(time.perf_counter()), beam_width=beam_width, length_penalty=length_penalty,
                      prefill_only=prefill_only)
        self._add_seq(req, 0, list(ids))   # first: if it raises, nothing is registered
        self.requests[req.request_id] = req
        return req.request_id

    def _add_seq(self, req: Request, index: int, token_ids: list[int]) -> Sequence:
        seq = Sequence(req, index, token_ids, len(req.prompt_token_ids), arrival=req.arrival,
                       generator=self._generator(req, index))
        req.seqs.append(seq)
        self.scheduler.add(seq)
        return seq

    def fork(self, seq: Sequence, index: int, generator: torch.Generator | None = None) -> Sequence:
        """A running child sharing every block of seq (copy-on-write); its own generator
        (seeded seed + index) unless given one."""
        child = Sequence(seq.request, index, list(seq.token_ids), seq.num_prompt_tokens,
                         num_computed=seq.num_computed, cumulative_logprob=seq.cumulative_logprob,
                         logprobs=list(seq.logprobs), generator=generator or self._generator(seq.request, index))
        self.scheduler.fork(seq, child)
        seq.request.seqs.append(child)
        return child

    def _generator(self, req: Request, index: int) -> torch.Generator | None:
        """Completion `index` of a seeded request draws from its own generator, seeded seed + index."""
        if req.params.seed is None:
            return None
        return torch.Generator(self.model.device).manual_seed(req.params.seed + index)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self.in_flight is not None or self.prefilling is not None

    # -- the split worker: prefill and decode at once on disjoint SMs (smsplit.py)

    def set_split(self, split: tuple[int, int] | None) -> None:
        """Run the next steps on this entry of the split menu (prefill SMs, decode SMs), or on
        the whole GPU (None). Between steps only: the steps in flight finish first, on the
        streams they were launched on (a step reads the one before it's tokens)."""
        key = None if split is None else Split(*split)
        if key is not None and key not in self.runner.splits:
            menu = ", ".join(f"({s.prefill_sms}, {s.decode_sms})" for s in self.runner.splits) or "none"
            raise ValueError(f"sm_split {tuple(split)} is not in this engine's split menu ({menu}): "
                             "pass one of those, or list it in split_menu")
        if key == self.split:
            return
        self.ended_between += [r.request_id for r in self._drain()]
        self.split = key

    def _drain(self) -> list[Request]:
        """Finish the steps in flight, on the device and on the host; the requests that finished."""
        finished = []
        for step in (self.prefilling, self.in_flight):
            if step is not None:
                finished += self._finish(step)
        self.prefilling = self.in_flight = None
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        return finished

    # -- the handoff: a prefill worker parks, a decode worker imports (workers.py)

    def queue_import(self, order: int) -> None:
        """An import arrived (order: request.arrival_order): it waits for a seat, first
        come, first served with the prompts here (the scheduler admits it: start_import)."""
        self.scheduler.queue_import(order)

    def forget_import(self, order: int) -> None:
        """An import still waiting for a seat was dropped: nothing waits for it now."""
        self.scheduler.forget_import(order)

    def start_import(self, request_id: int, token_ids: list[int], order: int, own: bool = False
                     ) -> tuple[list[int], int] | None:
        """A seat and blocks for a request prefilled elsewhere whose KV is about to be copied
        in: its block table and how many leading tokens the prefix cache already holds.
        own=True: this engine prefilled and parked it, and its blocks stay where they are.
        None while no seat or not enough blocks are free, or a prompt or a queued import
        that arrived before it (order: request.arrival_order) waits for a seat."""
        parked = self.requests[request_id].seqs[0].block_table if own else None
        return self.scheduler.start_import(token_ids, order, parked)

    def cancel_import(self, block_table: list[int]) -> None:
        """An import started but dropped (its source died): seat and blocks go back."""
        self.scheduler.cancel_import(block_table)

    def finish_import(self, request_id: int, token_ids: list[int], num_prompt_tokens: int, params: SamplingParams,
                      block_table: list[int], logprobs: list[dict[int, float]], cumulative_logprob: float,
                      generator_state: bytes | None) -> None:
        """The request's prompt KV is in block_table (start_import's); its first token is
        token_ids[-1]. It joins the decodes."""
        req = Request(request_id, None, token_ids[:num_prompt_tokens], params, RequestMetrics(time.perf_counter()),
                      num_streamed=1)   # the first token was streamed where it was prefilled
        seq = Sequence(req, 0, list(token_ids), num_prompt_tokens, block_table=block_table,
                       num_computed=num_prompt_tokens, cumulative_logprob=cumulative_logprob,
                       logprobs=list(logprobs), generator=self._generator(req, 0))
        if generator_state is not None:   # carry on the random stream where the prefill worker left it
            seq.generator.set_state(torch.frombuffer(bytearray(generator_state), dtype=torch.uint8))
        req.seqs.append(seq)
        self.requests.pop(request_id, None)   # our own parked record gives way to the decoding one
        self.requests[request_id] = req
        self.scheduler.finish_import(seq)

    def release(self, request_id: int) -> None:
        """Forget a parked request and free its blocks (its KV has been copied, or never will be)."""
        req = self.requests.get(request_id)
        if req is not None and req.parked:
            self._retire(req)
            del self.requests[request_id]

    # -- one step: launch it, then finish the previous one while the device computes

    def step(self) -> list[int]:
        """Schedule and launch a batch, then finish the step launched before it, whose
        sampled tokens were copied to the host meanwhile: the host's bookkeeping overlaps
        the device's work instead of leaving it idle. Returns the ids of the requests that
        finished (a prefill_only one: prefilled and parked). A step that raises ends the
        requests it carried with that error; the engine goes on serving the others."""
        ended, self.ended_between = self.ended_between, []
        return ended + (self._step_whole() if self.split is None else self._step_lanes())

    def _step_whole(self) -> list[int]:
        """A step on the whole GPU: decodes and prompt chunks together (chunked prefill).
        With speculative decoding a step ends before the next is scheduled when a sequence
        will draft in the next (a draft needs the token before it on the host)."""
        self.num_steps += 1
        drafting = self._draft()
        batch = self.scheduler.schedule()
        if drafting:
            for seq in set(drafting) - set(batch.seqs):   # not scheduled (preempted, no budget): drafts dropped
                seq.drafts = []
                self.scheduler.drop_branches(seq)
        if self._restart_beams() + len(batch.seqs) == 0 and self.in_flight is None:
            return self._end_unschedulable()
        try:
            launched = self._launch(batch, self.runner.whole, self.in_flight) if batch.seqs else None
            finished = self._finish(self.in_flight) if self.in_flight else []
        except Exception as e:  # noqa: BLE001 (the requests end with it; nothing else is lost)
            return self._fail_step([batch], e)
        self.in_flight = launched
        # Chosen on the host, now: beams; drafts (the sequence's next tokens depend on them);
        # and any step before a sequence drafts (a draft needs the token before it).
        if launched is not None and (launched.beams or launched.drafted or self._drafters(self.num_steps + 1)):
            finished += self._finish(launched)
            self.in_flight = None
        return [r.request_id for r in finished]

    def _drafters(self, step: int) -> list[Sequence]:
        """The running sequences that draft at this step (speculate.py): none without a
        drafter, or while more run than the config's disable_by_batch_size."""
        if self.drafter is None:
            return []
        limit, running = self.cfg.speculative_config.disable_by_batch_size, self.scheduler.running
        if limit is not None and len(running) > limit:
            return []
        return [s for s in running if can_speculate(s) and due(s, step)]

    def _draft(self) -> list[Sequence]:
        """Drafts for the sequences that draft now, decoding, as many as max_tokens and
        max_model_len leave room for after the token the step samples anyway (the scheduler
        checks as many as the step's budget holds; the step clears them): the longest
        candidate on the sequence, each other on a branch (Scheduler.branch). Finding none
        counts as a miss. The sequences given drafts."""
        spec, seqs, rooms = self.cfg.speculative_config, [], []
        for seq in self._drafters(self.num_steps):
            room = min(spec.num_speculative_tokens, seq.request.params.max_tokens - seq.num_outputs - 1,
                       self.cfg.max_model_len - len(seq.token_ids) - 1)
            if seq.num_pending == 1 and seq.num_outputs > 0 and seq.pending_row is None and room > 0:
                seqs.append(seq)
                rooms.append(room)
        drafting = []
        for seq, candidates in zip(seqs, self.drafter(seqs, rooms, spec.num_branches) if seqs else []):
            if not candidates:
                seq.draft_misses += 1
                continue
            seq.drafts = candidates[0]
            for drafts in candidates[1:]:
                self.scheduler.branch(seq, drafts)
            drafting.append(seq)
        return drafting

    def _step_lanes(self) -> list[int]:
        """A split worker's step: the prefill lane and the decode lane each keep a step on
        the device, at once, on their own SMs (smsplit.py).
          prefill lane: once its chunk's tokens have landed, take them (the prompts done
            join the decodes: their KV is in their blocks already) and launch the next;
          decode lane: a step of the decodes alone (launch N+1, finish N).
        Only while both have work are they split: the decodes step on the whole GPU's graphs
        while no prompt is in flight, and prompts prefill on the whole GPU while nothing
        decodes (a lane apart from the other has nothing to gain from fewer SMs). A step
        that reads the tokens of a step on another stream waits for it there.
        Both batches are scheduled first, then the decode step is launched before the
        chunk: a call in a launch that waits for the whole device (the driver allocating
        memory, loading a module) then waits for a decode step, never for a chunk just
        launched (which would hold the decode lane for the chunk's length).
        The host waits on the prefill lane only when there is nothing to decode. The lanes
        leave each other's sequences alone (busy). The decode lane's step in flight may
        still write blocks the host has freed (a sequence that just stopped): the prefill
        lane's next chunk waits for that step on the device before it starts; an abort of
        a sequence the prefill lane computes makes the decode lane wait likewise."""
        prefill_lane, decode_lane = self.runner.splits[self.split]
        idle = self.in_flight is None and self.prefilling is None   # nothing will land that frees room
        restarted, finished, batches, launched = self._restart_beams(), [], [], None
        try:
            if self.prefilling is not None and self.prefilling.output.done():
                step, self.prefilling = self.prefilling, None
                self.prefill_lane_steps.append(PrefillLaneStep(step.shape, step.lane.split,
                                                               (time.perf_counter() - step.launched_at) * 1e3))
                finished += self._finish(step)
            prompts = self.scheduler.schedule(decodes=False, busy=computing(self.in_flight)) \
                if self.prefilling is None else Batch()
            decodes = self.scheduler.schedule(prompts=False, busy=computing(self.prefilling) | set(prompts.seqs))
            batches = [prompts, decodes]
            written_by = self.in_flight   # the decode step the chunk waits for: it may write blocks freed since
            if decodes.seqs:
                lane = decode_lane if self.prefilling is not None or prompts.seqs else self.runner.whole
                if self.fence_decode:
                    wait_for(lane, self.prefilling)
                    self.fence_decode = False
                launched = self._launch(decodes, lane, self.in_flight)
            if prompts.seqs:
                lane = prefill_lane if self._decoding() else self.runner.alone
                wait_for(lane, written_by)
                self.prefilling = self._launch(prompts, lane, None)
                if self.prefilling.beams:   # beam search chooses on the host, now
                    finished += self._finish(self.prefilling)
                    self.prefilling = None
            finished += self._finish(self.in_flight) if self.in_flight else []
            self.in_flight = launched
            if launched is not None and launched.beams:
                finished += self._finish(launched)
                self.in_flight = None
        except Exception as e:  # noqa: BLE001 (the requests end with it; nothing else is lost)
            return self._fail_step(batches, e, launched)
        if self.in_flight is None and self.prefilling is not None:   # nothing to decode meanwhile
            self.prefilling.output.wait()
        ended = [r.request_id for r in finished]
        if idle and restarted + sum(len(b.seqs) for b in batches) == 0:
            ended += self._end_unschedulable()
        return ended

    def _decoding(self) -> bool:
        """Whether a decode step is in flight or a running sequence is past its prompt."""
        return self.in_flight is not None or any(s.num_computed >= s.num_prompt_tokens for s in self.scheduler.running)

    def _restart_beams(self) -> int:
        """Beam searches the scheduler preempted whole start again from their prompt, in
        their place in the queue; how many."""
        restarted, self.scheduler.restarted = self.scheduler.restarted, []
        for req in restarted:
            for seq in req.seqs:
                self.runner.token_counts.forget(seq)
            req.seqs, req.beams_done = [], []
            self._add_seq(req, 0, list(req.prompt_token_ids))
        return len(restarted)

    def _end_unschedulable(self) -> list[int]:
        """Nothing was scheduled, nothing is in flight: unless an import or a handoff will
        free seats or blocks (workers.py), no later step can differ from this one. End the
        requests that hold the engine still, with an error saying what they need, rather
        than spin: the running ones if any (none of them could compute), else the first in
        the queue (it cannot fit even in an empty engine). Their ids."""
        sched = self.scheduler
        if not sched.has_work() or sched.importing or sched.imports_waiting \
                or any(r.parked for r in self.requests.values()):
            return []
        stuck = {s.request: None for s in sched.running} or {sched.waiting[0].request: None}
        bm, cfg = self.bm, self.cfg
        error = RuntimeError(
            f"no step could make progress: {len(sched.running)} sequences running, {len(sched.waiting)} waiting, "
            f"{bm.num_free_blocks} of {bm.num_blocks} KV blocks free ({bm.watermark_blocks} kept back), "
            f"{cfg.max_num_seqs} seats (max_num_seqs), a step budget of {cfg.max_num_batched_tokens} tokens "
            f"(max_num_batched_tokens): a larger num_kv_blocks or max_num_seqs may let it run")
        for req in stuck:
            self._retire(req)
            req.error, req.metrics.finish_time = error, time.perf_counter()
        return [req.request_id for req in stuck]

    def _fail_step(self, batches: list[Batch], error: Exception, launched: LaunchedStep | None = None) -> list[int]:
        """End every request of the batches and of the steps in flight (and of launched, a
        step of this one already on the device) with error, freeing all they hold; their ids."""
        steps = [s for s in (self.in_flight, self.prefilling, launched) if s is not None]
        self.in_flight = self.prefilling = None
        if steps and self.model.device.type == "cuda":   # nothing launched may still write what is freed here
            try:
                torch.cuda.synchronize(self.model.device)
            except RuntimeError:   # the device itself failed: the error below says so
                pass
        involved = {s.request: None for batch in batches for s in batch.seqs}
        for step in steps:
            involved.update({s.request: None for s in step.computing()})
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
        if req.parked:
            self.scheduler.free(req.seqs[0].block_table)

    def _end(self, seq: Sequence, free: bool = True) -> None:
        """seq is finished: the scheduler retires it (free=False keeps its blocks, a parked
        prefill's), and its token counts, if the penalties kept any, go back."""
        self.scheduler.finish(seq, free=free)
        self.runner.token_counts.forget(seq)

    def abort(self, request_ids: list[int]) -> None:
        """End these requests now and forget them, wherever they are (waiting, running,
        parked); their blocks go back. A step in flight drops their tokens."""
        prefilling = computing(self.prefilling)
        for request_id in request_ids:
            req = self.requests.pop(request_id, None)
            if req is not None:
                self.fence_decode |= any(s in prefilling for s in req.seqs)   # its blocks: not before that step ends
                self._retire(req)
        step = self.in_flight
        if self.split is None and step is not None and all(s.request.request_id not in self.requests
                                                           for s in step.computing()):
            self.in_flight = None   # nothing left to take from it (a split keeps it: see _step_lanes)

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
        shape = self._shape(batch)
        if previous is not None and previous.lane is not lane:   # it reads previous's tokens from another stream
            wait_for(lane, previous)
            if previous.output.tokens is not None and previous.output.tokens.is_cuda:
                previous.output.tokens.record_stream(lane.stream or torch.cuda.current_stream())
        done = [i for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new)) if n == s.num_pending + len(s.drafts)]
        seqs = [batch.seqs[i] for i in done]
        step = LaunchedStep(batch, seqs, [s for s in seqs if s.request.beam_width], shape, lane=lane)
        beam_rows = [i for i in done if batch.seqs[i].request.beam_width]
        checks = self._plan_checks(batch, done, step)
        plan, draws = self._plan_draws(batch, done)
        checks += self._plan_branch_checks(batch, step, len(checks), plan)
        step.num_checks = len(checks)
        beam_k = 2 * max((s.request.beam_width for s in step.beams), default=0)
        step.output = self.runner.run(batch, checks + draws, beam_rows, beam_k,
                                      previous.output.tokens if previous else None, lane)
        for seq in step.drafted:   # their tokens are on their way: the drafts are the step's now
            seq.drafts = []
            for branch in seq.branches:
                branch.drafts = []
        self.scheduler.computed(batch)
        targets = [batch.seqs[i] if j == 0 else self.fork(batch.seqs[i], j, d.generator)
                   for (i, j), d in zip(plan, draws)]
        for k, seq in enumerate(targets):
            seq.token_ids.append(PENDING)
            seq.pending_row = step.num_checks + k
            step.targets.append((seq, len(seq.token_ids) - 1))
        return step

    def _plan_checks(self, batch: Batch, done: list[int], step: LaunchedStep) -> list[Draw]:
        """The check draws of the drafted sequences among batch.seqs[done]: a token after the
        last token and after each draft but the last, in that order (a seeded sequence's
        generator draws them in the order plain decoding would). They go first in the step's
        draws; each sequence's draw after its last draft is its ordinary one."""
        checks = []
        for i in done:
            seq = batch.seqs[i]
            if seq.drafts and seq.trunk is None:
                seeded = seq.generator is not None and not seq.request.params.greedy
                step.drafted[seq] = Drafted(seq.drafts, len(checks), seq.generator.get_state() if seeded else None)
                checks += [self._check_draw(i, seq, seq.drafts[:j], generator=seq.generator)
                           for j in range(len(seq.drafts))]
        return checks

    def _check_draw(self, row: int, seq: Sequence, before: list[int], **kw) -> Draw:
        """The draw after `before`, drafts of seq (or of a branch of seq) at batch row `row`:
        its penalties count them and its bans hold while seq's outputs and they are under
        min_tokens."""
        if not seq.request.adjusts:
            return Draw(row, seq.request.params, position=len(before), before=before, **kw)
        return Draw(row, seq.request.params, seq=seq, banned=self._banned(seq, len(before)), position=len(before),
                    before=before, **kw)

    def _plan_branch_checks(self, batch: Batch, step: LaunchedStep, first: int, plan: list[tuple[int, int]]
                            ) -> list[Draw]:
        """The draws of the drafted sequences' branches, after their own checks (from draw
        `first` on) and before the ordinary draws (plan): a token after the last token and
        after each draft. The draw at depth j of every branch reuses the noise of its
        sequence's draw at depth j (sampler.sample), so all candidates that agree up to a
        depth sample the same token there, the one plain decoding samples: checking more
        candidates changes how many tokens are kept, never which."""
        branched = [(seq, drafted) for seq, drafted in step.drafted.items() if seq.branches]
        if not branched:
            return []
        row = {s: i for i, s in enumerate(batch.seqs)}
        ordinary = first + sum(len(b.drafts) + 1 for seq, _ in branched for b in seq.branches)
        draws = []
        for seq, drafted in branched:
            depths = [drafted.checks + j for j in range(len(drafted.drafts))] + [ordinary + plan.index((row[seq], 0))]
            for branch in seq.branches:
                drafted.branches.append((branch, branch.drafts, first + len(draws)))
                draws += [self._check_draw(row[branch], seq, branch.drafts[:j], noise_of=depths[j])
                          for j in range(len(branch.drafts) + 1)]
        return draws

    def _plan_draws(self, batch: Batch, done: list[int]) -> tuple[list[tuple[int, int]], list[Draw]]:
        """The tokens to sample after the sequences batch.seqs[done] (beams excepted): per
        draw (row, j) and its Draw. n > 1: a prompt's only sequence is forked once its first
        token is sampled, and each child j draws its own first token from the same logits,
        with its own generator. This runs for every sequence of every step: a request that
        adjusts no logits (Request.adjusts) costs one plain Draw."""
        plan, draws = [], []
        for i in done:
            seq = batch.seqs[i]
            req = seq.request
            if req.beam_width or seq.trunk is not None:   # a branch's draws are checks (_plan_branch_checks)
                continue
            for j in range(req.params.n if seq.num_outputs == 0 else 1):
                g = seq.generator if j == 0 else self._generator(req, j)
                plan.append((i, j))
                before = list(seq.drafts) if seq.drafts else None   # drafted: after its last draft
                draws.append(Draw(i, req.params, g, seq, j > 0, self._banned(seq, len(seq.drafts)), before=before)
                             if req.adjusts else Draw(i, req.params, g))
        return plan, draws

    def _shape(self, batch: Batch) -> StepShape:
        """The step's decodes, their context and its prompt tokens (prefix hits excluded)."""
        shape = StepShape()
        for seq, n in zip(batch.seqs, batch.num_new):
            if seq.num_computed < seq.num_prompt_tokens:
                shape.prefill_tokens += min(n, seq.num_prompt_tokens - seq.num_computed)
            else:
                shape.decodes, shape.context_tokens = shape.decodes + 1, shape.context_tokens + seq.num_computed
        return shape

    def _finish(self, step: LaunchedStep) -> list[Request]:
        """Fill a launched step's PENDING tokens, record logprobs, stop sequences, advance
        beams. Returns the requests that finished."""
        tokens, logprobs = step.output.collect()
        checked, tokens = tokens[:step.num_checks], tokens[step.num_checks:]
        now = time.perf_counter()
        for seq in step.seqs:
            if seq.request.metrics.first_token_time is None:
                seq.request.metrics.first_token_time = now
        counted: list[tuple[Sequence, list[int]]] = []   # penalized drafted sequences: what they kept
        for k, ((seq, index), token) in enumerate(zip(step.targets, tokens)):
            if seq.status == Status.FINISHED:   # it stopped one step earlier: this token is void
                continue
            drafted, draw = step.drafted.get(seq), step.num_checks + k
            kept, draws = self._kept(seq, drafted, checked, token, draw) if drafted else ([token], [draw])
            if drafted and seq.request.params.penalized:   # its draws were not counted: what it kept is
                counted.append((seq, kept))
            seq.token_ids[index:index + 1] = kept
            if index + len(kept) == len(seq.token_ids):   # no later step has sampled after it yet
                seq.pending_row = None
            if drafted:
                self.scheduler.drafts_checked(seq)
            for at, draw in zip(range(index, index + len(kept)), draws):
                if draw in logprobs:
                    self._record_logprobs(seq, seq.token_ids[at], *logprobs[draw])
                self._check_stop(seq, at)
                if seq.status == Status.FINISHED:
                    break
        self.runner.token_counts.count_kept(counted, self.runner.upload)
        for seq, candidates in zip(step.beams, step.output.beams):
            k = 2 * seq.request.beam_width
            seq.beam_candidates = list(zip(candidates[0][:k], candidates[1][:k]))
        # Requests that may have finished: a sequence of theirs stopped, or a beam step ran.
        touched = {s.request: None for s, _ in step.targets if s.status == Status.FINISHED}
        touched.update({s.request: None for s in step.beams})
        finished = []
        for req in touched:
            if req.beam_width and not req.finished and all(s.beam_candidates is not None for s in req.seqs
                                                           if s.status != Status.FINISHED):
                self._advance_beams(req)
            if req.finished and req.metrics.finish_time is None and req.request_id in self.requests:
                req.metrics.finish_time = now
                finished.append(req)
        return finished

    def _kept(self, seq: Sequence, drafted: Drafted, checked: list[int], last: int, last_draw: int
              ) -> tuple[list[int], list[int]]:
        """The tokens a drafted sequence keeps (speculate.py), and the draws that sampled
        them (their logprobs): of the candidate (its own drafts or a branch's) that keeps
        the most, the drafts up to the first the tokens sampled after each position disagree
        with, then the token sampled there. A branch that wins gives the sequence its
        blocks; every branch is then dropped. last: the token of the sequence's ordinary
        draw, last_draw."""
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
        seq.draft_misses = 0 if a else seq.draft_misses + 1
        metrics = seq.request.metrics
        metrics.spec_draft_tokens += len(drafted.drafts) + sum(len(d) for _, d, _ in drafted.branches)
        metrics.spec_accepted_tokens += a
        metrics.spec_steps += 1
        if drafted.generator_state is not None:   # where plain decoding leaves it: one draw per kept token
            rewind(seq.generator, drafted.generator_state, a + 1, self.model.config.vocab_size)
        return drafts[:a] + [sampled[a]], draws[:a + 1]

    def _banned(self, seq: Sequence, ahead: int = 0) -> list[int]:
        """The tokens seq's next token (after `ahead` drafts) may not be: before min_tokens,
        EOS and the stop ids."""
        params = seq.request.params
        if seq.num_outputs + ahead >= params.min_tokens:
            return []
        return list(params.stop_token_ids) + ([] if params.ignore_eos else sorted(self.eos_ids))

    def _record_logprobs(self, seq: Sequence, token: int, token_logprob: float, top_values: list[float],
                         top_ids: list[int]) -> None:
        k = seq.request.params.logprobs
        entry = dict(zip(top_ids[:k], top_values[:k]))
        entry[token] = token_logprob
        seq.logprobs.append(entry)
        seq.cumulative_logprob += token_logprob

    def _check_stop(self, seq: Sequence, index: int) -> None:
        """Finish seq if its token at index ends it (from min_tokens on: EOS, a stop token, a
        stop string completed in the text; or max_tokens); a later token, already sampled
        by the step running now, is dropped."""
        params, num_outputs, token = seq.request.params, index + 1 - seq.num_prompt_tokens, seq.token_ids[index]
        new_text = self._add_text(seq, index) if params.stop else ""
        if num_outputs >= params.min_tokens and (token in self.eos_ids and not params.ignore_eos
                                                 or token in params.stop_token_ids
                                                 or new_text and self._found_stop_string(seq, new_text)):
            seq.finish_reason = "stop"
            if token in params.stop_token_ids:
                seq.stop_reason = token
        elif num_outputs >= params.max_tokens:
            seq.finish_reason = "length"
        elif not seq.request.prefill_only:
            return
        del seq.token_ids[index + 1:]
        seq.pending_row = None
        # A prefill worker's request ends after its first token with finish_reason None
        # (parked): its blocks stay until a decode worker has pulled them (release).
        self._end(seq, free=seq.finish_reason is not None)

    def _add_text(self, seq: Sequence, index: int) -> str:
        """Detokenize seq's output up to its token at index; the text that token added. The
        detokenizer starts at the first check (after an import or a fork, from the tokens
        the sequence came with)."""
        if seq.detokenizer is None:
            seq.detokenizer = Detokenizer(self.tokenizer, seq.token_ids[seq.num_prompt_tokens:index])
        return seq.detokenizer.add(seq.token_ids[index])

    def _found_stop_string(self, seq: Sequence, new_text: str) -> bool:
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

    # -- beam search: fork the best continuations, free the rest (HF's algorithm)

    def _advance_beams(self, req: Request) -> None:
        """One beam-search step over all live beams' candidates, as HF's beam search does:
        of the 2k best continuations (by summed logprob), those among the first k that end
        (EOS, or max_tokens reached) become finished hypotheses, scored by summed logprob /
        length ** length_penalty, of which the best k are kept; the best k that do not end
        go on as the live beams. The search stops when nothing is live or, with k finished,
        when the best live beam can no longer beat the worst finished one."""
        k, live = req.beam_width, [s for s in req.seqs if s.status != Status.FINISHED]
        last_step = len(live[0].output_ids) + 1 >= req.params.max_tokens
        cands = sorted(((s.cumulative_logprob + lp, s, t) for s in live for t, lp in s.beam_candidates),
                       key=lambda c: -c[0])[:2 * k]
        keep = []
        for rank, (score, parent, token) in enumerate(cands):
            is_eos = token in self.eos_ids and not req.params.ignore_eos
            if is_eos or last_step:
                if rank < k:
                    req.beams_done.append(self._finished_beam(parent, token, score, "stop" if is_eos else "length"))
            elif len(keep) < k:
                keep.append((score, parent, token))
        req.beams_done = sorted(req.beams_done, key=lambda b: -self.beam_score(b))[:k]
        # A parent chosen more than once is forked; all forks before any token is appended.
        taken, chosen = set(), []
        for score, parent, token in keep:
            chosen.append((parent if parent not in taken else self.fork(parent, len(req.seqs)), score, token))
            taken.add(parent)
        for seq, score, token in chosen:
            seq.token_ids.append(token)
            seq.cumulative_logprob = score
            seq.beam_candidates = None
        for seq in live:
            if seq not in taken:
                self._drop_beam(req, seq)
        best_live = keep[0][0] / (len(live[0].output_ids) + 1) ** req.length_penalty if keep else None
        if best_live is None or (len(req.beams_done) == k and best_live <= self.beam_score(req.beams_done[-1])):
            for seq in [s for s in req.seqs if s.status != Status.FINISHED]:
                self._drop_beam(req, seq)
            req.seqs = req.beams_done

    def _drop_beam(self, req: Request, seq: Sequence) -> None:
        self._end(seq)   # its blocks go back (shared ones stay with the other beams)
        req.seqs.remove(seq)

    def _finished_beam(self, parent: Sequence, token: int, score: float, reason: str) -> Sequence:
        return Sequence(parent.request, -1, parent.token_ids + [token], parent.num_prompt_tokens,
                        status=Status.FINISHED, cumulative_logprob=score, finish_reason=reason)

    def beam_score(self, seq: Sequence) -> float:
        return seq.cumulative_logprob / len(seq.output_ids) ** seq.request.length_penalty

    # -- outputs

    def new_tokens(self) -> dict[int, list[int]]:
        """Output tokens of the running single-completion requests since the last call:
        what a stream shows (n > 1 and beams report their completions when done)."""
        new = {}
        for req in self.requests.values():
            if req.beam_width or req.params.n > 1 or req.parked:
                continue
            seq = req.seqs[0]
            known = len(seq.token_ids) - (seq.pending_row is not None)   # the last may be PENDING
            if known - seq.num_prompt_tokens > req.num_streamed:
                new[req.request_id] = seq.token_ids[seq.num_prompt_tokens + req.num_streamed:known]
                req.num_streamed = known - seq.num_prompt_tokens
        return new

    def _text(self, seq: Sequence) -> str:
        """The completion's text: cut where its stop string was found, else its tokens decoded."""
        if isinstance(seq.stop_reason, str):
            return seq.detokenizer.text[:seq.text_end]
        return self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)

    def output(self, request_id: int) -> RequestOutput:
        """A finished request's output (none but its .error if it failed); the engine forgets it."""
        req = self.requests.pop(request_id)
        want_lp = req.params.logprobs is not None or req.beam_width > 0
        seqs = [] if req.error else req.seqs if req.beam_width else sorted(req.seqs, key=lambda s: s.index)
        outs = [CompletionOutput(i if req.beam_width else s.index, s.output_ids, self._text(s), s.finish_reason,
                                 s.cumulative_logprob if want_lp else None,
                                 s.logprobs if req.params.logprobs is not None else None, s.stop_reason)
                for i, s in enumerate(seqs)]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, req.metrics,
                             finished=req.finished, error=req.error)
