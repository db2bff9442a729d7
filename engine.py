"""The single-device engine: Engine.step() schedules a batch, runs it, samples, and
retires finished requests; EngineConfig holds its settings.

How a step works:
  1. Scheduler.schedule (scheduler.py) picks this step's work.
  2. ModelRunner.run (runner.py) runs the model on it.
  3. Every sequence whose last token was computed gets a new token, sampled on the
     device, or, in beam search, its candidate continuations; requests that hit a stop
     condition finish.
  Steps overlap: the host takes step N's tokens (stop checks, outputs) after launching
  step N+1, which reads them on the device (PENDING ids), so the GPU is not left idle
  while Python does its bookkeeping. Beam search, which chooses on the host, waits.

Parallel sampling (n > 1) prefills the prompt once and forks the sequence; beam search
forks and frees sequences each step. Both share blocks through the BlockManager's
copy-on-write.
"""

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kv_cache import BlockManager, cdiv
from model import load_model
from runner import ModelRunner, sample
from scheduler import (
    PENDING,
    Batch,
    CompletionOutput,
    Request,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    Scheduler,
    Sequence,
    Status,
)

# ----------------------------------------------------------------------------- the engine


def check_request(ids: list[int], params: SamplingParams, beam_width: int, vocab: int, cfg: "EngineConfig",
                  room_blocks: int) -> None:
    """Raise a ValueError naming what is wrong with a request; room_blocks is the KV cache's
    size less its watermark (the most one request may ever hold)."""
    params.validate()
    if not ids:
        raise ValueError("the prompt is empty")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
    if len(ids) + params.max_tokens > cfg.max_model_len:
        raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                         f"max_model_len ({cfg.max_model_len})")
    if params.logprobs is not None and params.logprobs > vocab:
        raise ValueError(f"logprobs={params.logprobs} exceeds the vocabulary size ({vocab})")
    width = max(params.n, beam_width)
    if width > cfg.max_num_seqs:
        raise ValueError(f"{'beam_width' if beam_width else 'n'}={width} exceeds max_num_seqs ({cfg.max_num_seqs})")
    # Beams advance together, so all of them must fit at once (full prompt blocks are
    # shared; each beam owns the rest). Samples of n > 1 progress independently: one must fit.
    bs = cfg.block_size
    shared = len(ids) // bs if beam_width else 0
    need = shared + (beam_width or 1) * (cdiv(len(ids) + params.max_tokens, bs) - shared)
    if need > room_blocks:
        raise ValueError(f"the request needs {need} KV blocks, more than the whole cache holds ({room_blocks})")


@dataclass
class EngineConfig:
    model: str = "tiny"
    dtype: str | torch.dtype | None = None
    device: str | None = None
    block_size: int = 16
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 256
    max_model_len: int = 4096
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enforce_eager: bool = False        # no CUDA graphs
    seed: int = 0                      # random weights of presets

    def validate(self) -> None:
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1 (or None to size it), got {self.num_kv_blocks}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        check_device(self.device)


def check_device(device: str | torch.device | None) -> torch.device | None:
    """The device, or a ValueError naming it if this machine has no such device (None: the default)."""
    if device is None:
        return None
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not a device name (cpu, cuda, cuda:N)") from None
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available")
    if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if d.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: only cpu and cuda devices are supported")
    return d


class ByteTokenizer:
    """For random-weight presets (and checkpoints without tokenizer files): UTF-8 bytes."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], **_) -> str:
        return bytes(i for i in ids if i < 256).decode(errors="replace")


def load_tokenizer(model_name: str):
    folder = Path(model_name)
    if folder.is_dir() and any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(folder)
    return ByteTokenizer()


@dataclass
class StepShape:
    """What one step computed: the router refits its step-time model on these (router.py)."""
    decodes: int          # sequences that computed one token past their prompt
    context_tokens: int   # ... and the tokens of context they read
    prefill_tokens: int   # prompt tokens computed beside them


@dataclass
class LaunchedStep:
    """A step whose sampled tokens are still on their way to the host (see Engine.step)."""
    seqs: list[Sequence]                 # the sequences whose last token this step computed
    beams: list[Sequence]                # ... those in beam search: the host picks their tokens
    shape: StepShape
    beam_logits: torch.Tensor | None = None
    targets: list[tuple[Sequence, int]] = field(default_factory=list)   # per sampled row: where its token goes
    tokens: torch.Tensor | None = None   # [rows] on the device: the next step's PENDING ids come from here
    want_logprobs: list[int] = field(default_factory=list)   # rows that report logprobs
    host: list[torch.Tensor] = field(default_factory=list)   # tokens (and logprobs), copying to the host
    ready: torch.cuda.Event | None = None


class Engine:
    def __init__(self, cfg: EngineConfig):
        cfg.validate()
        self.model = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device, seed=cfg.seed)
        config = self.model.config
        cfg.max_model_len = min(cfg.max_model_len, config.max_position_embeddings)
        self.cfg = cfg
        self.tokenizer = load_tokenizer(cfg.model)
        eos = config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.runner = ModelRunner(self.model, cfg)
        self.bm = BlockManager(self.runner.num_blocks, cfg.block_size,
                               enable_prefix_caching=cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.bm, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.num_prefill_tokens = 0   # prompt tokens actually computed (prefix hits excluded)
        self.in_flight: LaunchedStep | None = None   # launched, its tokens not yet taken
        self._request_ids = itertools.count()

    # -- requests

    def add_request(self, prompt: str | list[int], params: SamplingParams, beam_width: int = 0,
                    length_penalty: float = 1.0, request_id: int | None = None,
                    prefill_only: bool = False) -> Request:
        """Validate and queue a request; a bad one raises ValueError and changes nothing."""
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_request(ids, params, beam_width, self.model.config.vocab_size, self.cfg,
                      self.bm.num_blocks - self.bm.watermark_blocks)
        req = Request(next(self._request_ids) if request_id is None else request_id, text, ids, params,
                      RequestMetrics(time.perf_counter()), beam_width=beam_width, length_penalty=length_penalty,
                      prefill_only=prefill_only)
        self._add_seq(req, 0, list(ids))
        return req

    def add_prefilled(self, request_id: int, token_ids: list[int], num_prompt_tokens: int,
                      params: SamplingParams, block_table: list[int], logprobs: list[dict[int, float]],
                      cumulative_logprob: float, generator_state: bytes | None) -> Request:
        """A request whose prompt was prefilled elsewhere (a decode worker's import): its KV for
        the prompt is already in block_table, and its first token is token_ids[-1]."""
        req = Request(request_id, None, token_ids[:num_prompt_tokens], params, RequestMetrics(time.perf_counter()),
                      forked=True)
        seq = Sequence(req, 0, list(token_ids), num_prompt_tokens, status=Status.RUNNING, block_table=block_table,
                       num_computed=num_prompt_tokens, cumulative_logprob=cumulative_logprob,
                       logprobs=list(logprobs), generator=self._generator(req, 0))
        if generator_state is not None:   # carry on the random stream where the prefill worker left it
            seq.generator.set_state(torch.frombuffer(bytearray(generator_state), dtype=torch.uint8))
        req.seqs.append(seq)
        self.scheduler.running.append(seq)
        return req

    def _add_seq(self, req: Request, index: int, token_ids: list[int]) -> Sequence:
        seq = Sequence(req, index, token_ids, len(req.prompt_token_ids), generator=self._generator(req, index))
        req.seqs.append(seq)
        self.scheduler.add(seq)
        return seq

    def fork(self, seq: Sequence, index: int) -> Sequence:
        """A running child sharing every block of seq (copy-on-write)."""
        child = Sequence(seq.request, index, list(seq.token_ids), seq.num_prompt_tokens,
                         status=Status.RUNNING, block_table=self.bm.fork(seq.block_table),
                         num_computed=seq.num_computed, cumulative_logprob=seq.cumulative_logprob,
                         logprobs=list(seq.logprobs), generator=self._generator(seq.request, index))
        seq.request.seqs.append(child)
        self.scheduler.running.append(child)
        return child

    def _generator(self, req: Request, index: int) -> torch.Generator | None:
        """Completion `index` of a seeded request draws from its own generator, seeded seed + index."""
        if req.params.seed is None:
            return None
        return torch.Generator(self.model.device).manual_seed(req.params.seed + index)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self.in_flight is not None

    # -- one step: launch it, then finish the previous one while the device computes

    def step(self) -> list[Request]:
        """Schedule and launch a batch, then finish the step launched before it, whose
        sampled tokens were copied to the host meanwhile: the host's bookkeeping overlaps
        the device's work instead of leaving it idle. Returns the requests that finished."""
        batch = self.scheduler.schedule()
        launched = self._launch(batch) if batch.seqs else None
        finished = self._finish(self.in_flight) if self.in_flight else []
        self.in_flight = launched
        if launched is not None and launched.beams:   # beam search chooses on the host, now
            finished += self._finish(launched)
            self.in_flight = None
        return finished

    def _launch(self, batch: Batch) -> "LaunchedStep":
        """Run the model on the batch and sample on the device; each sampled sequence gets a
        PENDING token, filled in by _finish."""
        shape = StepShape(0, 0, 0)
        for seq, n in zip(batch.seqs, batch.num_new):
            if seq.num_computed < seq.num_prompt_tokens:
                prompt_tokens = min(n, seq.num_prompt_tokens - seq.num_computed)
                self.num_prefill_tokens += prompt_tokens
                shape.prefill_tokens += prompt_tokens
            else:
                shape.decodes, shape.context_tokens = shape.decodes + 1, shape.context_tokens + seq.num_computed
        done = [i for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new)) if n == s.num_pending]
        logits = self.runner.run(batch, done, self.in_flight.tokens if self.in_flight else None)
        for seq, n in zip(batch.seqs, batch.num_new):
            seq.num_computed += n
            # A block enters the prefix cache once its tokens are known: never with a PENDING one.
            known = len(seq.token_ids) - (seq.pending_row is not None)
            self.bm.cache_computed_blocks(seq.block_table, seq.token_ids, min(seq.num_computed, known))
        seqs = [batch.seqs[i] for i in done]
        step = LaunchedStep(seqs, [s for s in seqs if s.request.beam_width], shape)
        if step.beams:
            step.beam_logits = logits[[i for i, s in enumerate(seqs) if s.request.beam_width]].float()
        rows = [i for i, s in enumerate(seqs) if not s.request.beam_width]
        # n > 1: the prompt's only sequence is forked before its first token, and each child
        # draws its own first token from the same logits.
        expanded = [(i, j) for i in rows for j in range(self._draws(seqs[i]))]
        targets = [seqs[i] if j == 0 else self.fork(seqs[i], j) for i, j in expanded]
        for i in rows:
            seqs[i].request.forked = True
        if not targets:
            return step
        upload = self.runner.upload
        source_rows = [i for i, _ in expanded]
        row_logits = logits if source_rows == list(range(len(logits))) else logits[upload(source_rows)]
        step.tokens = sample(row_logits, [t.request.params for t in targets], [t.generator for t in targets],
                             upload)
        host = [step.tokens]
        step.want_logprobs = [k for k, t in enumerate(targets) if t.request.params.logprobs is not None]
        if step.want_logprobs:   # the chosen token's logprob and the top alternatives, on the device
            want = upload(step.want_logprobs, torch.int64)
            lp = torch.log_softmax(row_logits[want].float(), -1)
            top = lp.topk(max(1, max(targets[k].request.params.logprobs for k in step.want_logprobs)), -1)
            host += [lp.gather(1, step.tokens[want, None])[:, 0], top.values, top.indices]
        step.host = [self.runner.to_host(t) for t in host]
        if self.model.device.type == "cuda":
            step.ready = torch.cuda.Event()
            step.ready.record()
        for k, seq in enumerate(targets):
            seq.token_ids.append(PENDING)
            seq.pending_row = k
            step.targets.append((seq, len(seq.token_ids) - 1))
        return step

    def _finish(self, step: "LaunchedStep") -> list[Request]:
        """Fill a launched step's PENDING tokens, record logprobs, stop sequences, advance
        beams. Returns the requests that finished."""
        if step.ready is not None:
            step.ready.synchronize()
        now = time.perf_counter()
        for seq in step.seqs:
            if seq.request.metrics.first_token_time is None:
                seq.request.metrics.first_token_time = now
        tokens, *logprobs = [t.tolist() for t in step.host] or [[]]
        logprobs = dict(zip(step.want_logprobs, zip(*logprobs)))
        for k, ((seq, index), token) in enumerate(zip(step.targets, tokens)):
            if seq.status == Status.FINISHED:   # it stopped one step earlier: this token is void
                continue
            seq.token_ids[index] = token
            if index == len(seq.token_ids) - 1:   # no later step has sampled after it yet
                seq.pending_row = None
            if k in logprobs:
                self._record_logprobs(seq, token, *logprobs[k])
            self._check_stop(seq, index)
        if step.beams:
            self._store_beam_candidates(step.beams, step.beam_logits)
        # Requests that may have finished: a sequence of theirs stopped, or a beam step ran.
        touched = {s.request: None for s, _ in step.targets if s.status == Status.FINISHED}
        touched.update({s.request: None for s in step.beams})
        finished = []
        for req in touched:
            if req.beam_width and not req.finished and all(s.beam_candidates is not None for s in req.seqs
                                                           if s.status != Status.FINISHED):
                self._advance_beams(req)
            if req.finished and req.metrics.finish_time is None:
                req.metrics.finish_time = now
                finished.append(req)
        return finished

    def _draws(self, seq: Sequence) -> int:
        return seq.request.params.n if not seq.request.forked else 1

    def _record_logprobs(self, seq: Sequence, token: int, token_logprob: float, top_values: list[float],
                         top_ids: list[int]) -> None:
        k = seq.request.params.logprobs
        entry = dict(zip(top_ids[:k], top_values[:k]))
        entry[token] = token_logprob
        seq.logprobs.append(entry)
        seq.cumulative_logprob += token_logprob

    def _check_stop(self, seq: Sequence, index: int) -> None:
        """Finish seq if its token at index ends it; a later token, already sampled by the
        step running now, is dropped."""
        params, token = seq.request.params, seq.token_ids[index]
        if token in params.stop_token_ids or (token in self.eos_ids and not params.ignore_eos):
            seq.finish_reason = "stop"
        elif index + 1 - seq.num_prompt_tokens >= params.max_tokens:
            seq.finish_reason = "length"
        elif not seq.request.prefill_only:
            return
        del seq.token_ids[index + 1:]
        seq.pending_row = None
        # A prefill worker's request ends after its first token with finish_reason None;
        # its blocks stay until a decode worker has pulled them (workers.py).
        self.scheduler.finish(seq, free=seq.finish_reason is not None)

    # -- beam search: fork the best continuations, free the rest (HF's algorithm)

    def _store_beam_candidates(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        logprobs = torch.log_softmax(logits, -1)
        top = logprobs.topk(2 * max(s.request.beam_width for s in seqs), -1)
        for seq, tokens, values in zip(seqs, top.indices.tolist(), top.values.tolist()):
            k = 2 * seq.request.beam_width
            seq.beam_candidates = list(zip(tokens[:k], values[:k]))

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
        self.scheduler.finish(seq)   # its blocks go back (shared ones stay with the other beams)
        req.seqs.remove(seq)

    def _finished_beam(self, parent: Sequence, token: int, score: float, reason: str) -> Sequence:
        return Sequence(parent.request, -1, parent.token_ids + [token], parent.num_prompt_tokens,
                        status=Status.FINISHED, cumulative_logprob=score, finish_reason=reason)

    def beam_score(self, seq: Sequence) -> float:
        return seq.cumulative_logprob / len(seq.output_ids) ** seq.request.length_penalty

    # -- outputs

    def output(self, req: Request) -> RequestOutput:
        def text(ids):
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        want_lp = req.params.logprobs is not None or req.beam_width > 0
        outs = [CompletionOutput(i if req.beam_width else s.index, s.output_ids, text(s.output_ids),
                                 s.finish_reason, s.cumulative_logprob if want_lp else None,
                                 s.logprobs if req.params.logprobs is not None else None)
                for i, s in enumerate(sorted(req.seqs, key=lambda s: s.index) if not req.beam_width
                                      else req.seqs)]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, req.metrics,
                             finished=req.finished)
