"""Requests: what a user asks for (SamplingParams) and gets back (RequestOutput, with its
RequestMetrics), the record an engine keeps of each request (Request) and the token
streams it becomes (Sequence), and check_request, the one validation every request goes
through before any engine or worker sees it.
"""

import itertools
import numbers
from dataclasses import dataclass, field
from enum import Enum

import torch

from config import EngineConfig, check_int, check_real
from kv_cache import cdiv

# ----------------------------------------------------------------------------- what a user asks for and gets


@dataclass
class SamplingParams:
    max_tokens: int = 32
    temperature: float = 0.0           # 0: greedy
    top_p: float = 1.0
    top_k: int = -1                    # -1: no limit
    seed: int | None = None            # same seed, same tokens, whatever else is in the batch
    n: int = 1                         # completions per prompt
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None        # also return this many top alternatives per token

    def validate(self) -> None:
        """Raise a ValueError naming the first field that is of the wrong type or out of range."""
        check_int("max_tokens", self.max_tokens, low=1)
        check_int("n", self.n, low=1)
        check_real("temperature", self.temperature, low=0.0)
        check_real("top_p", self.top_p, low=0.0)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        check_int("top_k", self.top_k, low=-1)
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (no limit) or positive, got 0")
        if self.seed is not None:   # child j draws from seed + j, a 64-bit generator seed
            check_int("seed", self.seed, low=0, high=2 ** 63 - self.n)
        if not isinstance(self.stop_token_ids, list | tuple):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        for t in self.stop_token_ids:
            check_int("stop_token_ids", t)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, low=0)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0         # prompt tokens found in the prefix cache
    imported_time: float | None = None  # disaggregated: when the decode worker had the KV
    kv_bytes_moved: int = 0             # ... how much KV it copied
    kv_copy_time: float | None = None   # ... and how long the copy itself took (s)
    seat_wait: float = 0.0              # ... after waiting there for a seat and blocks (s)
    path: tuple[int, ...] = ()          # the workers that served it (prefill, then decode)
    routed: tuple | None = None         # adaptive: (predicted latency ms, prefill worker's WorkerLoad,
                                        # decode worker's WorkerLoad) when the router chose the path

    def kv_copy_GBps(self) -> float:
        """The KV copy's rate (disaggregated; needs kv_copy_time)."""
        return self.kv_bytes_moved / self.kv_copy_time / 1e9

    def phases(self) -> dict[str, float]:
        """Seconds spent queued, prefilling, handing the KV over, waiting for a seat on the
        decode worker (a handoff's wait there) and decoding: the path's cost."""
        decode_start = self.imported_time or self.first_token_time
        return {"queued": self.first_scheduled_time - self.arrival_time,
                "prefill": self.first_token_time - self.first_scheduled_time,
                "transfer": decode_start - self.first_token_time - self.seat_wait,
                "seat_wait": self.seat_wait,
                "decode": self.finish_time - decode_start}


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None          # "stop", "length", or None while running
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    finished: bool = True
    error: Exception | None = None     # why it failed (ValueError: rejected); outputs is then empty


def tokenize(prompt, tokenizer) -> tuple[str | None, list[int]]:
    """(the text, or None, and the token ids) of a prompt: a string or a list of token ids."""
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, list | tuple):
        for t in prompt:
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise ValueError(f"a prompt's token ids must be integers, got {t!r}")
        return None, [int(t) for t in prompt]
    raise ValueError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")


def check_request(ids: list[int], params: SamplingParams, beam_width: int, vocab: int, cfg: EngineConfig,
                  room_blocks: int, length_penalty: float = 1.0) -> None:
    """Raise a ValueError naming what is wrong with a request; room_blocks is the KV cache's
    size less its watermark (the most one request may ever hold)."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    params.validate()
    check_int("beam_width", beam_width, low=0)
    check_real("length_penalty", length_penalty)
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


# ----------------------------------------------------------------------------- what an engine keeps


class Status(Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


_arrivals = itertools.count()
PENDING = -1   # a sampled token the host has not received yet


def arrival_order() -> int:
    """A number that grows with every arrival in this process (a sequence, or an import
    waiting for a seat): first come, first served compares these."""
    return next(_arrivals)


@dataclass(eq=False)
class Sequence:
    """One stream of tokens: a prompt and the completion growing after it."""
    request: "Request"
    index: int                          # which completion of its request
    token_ids: list[int]
    num_prompt_tokens: int
    arrival: int = field(default_factory=arrival_order)   # when it arrived (request.arrival_order), for FCFS
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0               # tokens whose K/V are in the cache
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    beam_candidates: list[tuple[int, float]] | None = None   # beam search: (token, logprob)
    # While the step that sampled this sequence's last token is still running, that token
    # is a placeholder (PENDING) on the host, and the next step reads it on the device
    # from row `pending_row` of that step's sampled tokens.
    pending_row: int | None = None

    @property
    def num_pending(self) -> int:
        """Tokens to compute before the next token can be chosen (1 for a decode)."""
        return len(self.token_ids) - self.num_computed

    @property
    def num_outputs(self) -> int:
        """Output tokens sampled so far, the one still on its way from the device included."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:len(self.token_ids) - (self.pending_row is not None)]


@dataclass(eq=False)
class Request:
    """An engine's record of one request, from submit until its output is taken."""
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    beam_width: int = 0                 # > 0: beam search instead of sampling
    length_penalty: float = 1.0
    seqs: list[Sequence] = field(default_factory=list)        # live and finished completions
    beams_done: list[Sequence] = field(default_factory=list)  # beam search: finished hypotheses
    prefill_only: bool = False          # a prefill worker's: stop after the first token, keep the blocks
    num_streamed: int = 0               # output tokens already handed out by Engine.new_tokens
    error: Exception | None = None      # why it ended without its completions

    @property
    def finished(self) -> bool:
        return all(s.status == Status.FINISHED for s in self.seqs)

    @property
    def parked(self) -> bool:
        """Prefilled for another worker: its first token is out, its blocks kept for the handoff."""
        return self.prefill_only and self.finished and self.seqs[0].finish_reason is None
