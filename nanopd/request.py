"""Requests: what a user asks for (SamplingParams) and gets back (RequestOutput, with its
RequestMetrics), the record an engine keeps of each request (Request) and the token
streams it becomes (Sequence), and check_request, the one validation every request goes
through before any engine or worker sees it.
"""

import copy
import dataclasses
import itertools
import numbers
from dataclasses import dataclass, field
from enum import Enum
from typing import TypedDict

import torch

from nanopd.config import EngineConfig, check_int, check_real
from nanopd.kv_cache import cdiv
from nanopd.model import Detokenizer

# ----------------------------------------------------------------------------- what a user asks for and gets

LOGIT_BIAS_MAX = 100   # OpenAI's bound on a logit_bias value, either sign


@dataclass
class SamplingParams:
    """How to sample a request's completions: vLLM's SamplingParams, with its names and
    defaults (temperature 1.0: pass temperature=0 for greedy decoding). A bad value is a
    ValueError naming the field here, at construction, as in vLLM; a field changed later is
    checked again when a request takes a copy (normalized)."""
    n: int = 1                         # completions per prompt
    temperature: float = 1.0           # 0 (or below SAMPLING_EPS): greedy
    top_p: float = 1.0
    top_k: int = -1                    # -1 or 0: no limit
    seed: int | None = None            # same seed, same tokens, whatever else is in the batch
    max_tokens: int = 16
    min_tokens: int = 0                # no EOS, stop token or stop string before this many tokens
    stop: str | list[str] | None = None   # stop strings, matched on the text as it grows
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    repetition_penalty: float = 1.0    # > 1 discourages every token of the prompt and output
    presence_penalty: float = 0.0      # subtracted once from each token already in the output
    frequency_penalty: float = 0.0     # subtracted per occurrence in the output
    logprobs: int | None = None        # also return this many top alternatives per token
    prompt_logprobs: int | None = None   # ... and per prompt token (the first has none)
    min_p: float = 0.0                 # drop tokens less likely than min_p x the most likely one
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit before sampling
    allowed_token_ids: list[int] | None = None   # sample only among these
    bad_words: list[str] | None = None   # words never generated (their last token is banned after the rest)
    skip_special_tokens: bool = True   # leave special tokens out of the output's text
    truncate_prompt_tokens: int | None = None   # keep only the prompt's last this many tokens
    # bad_words as token id sequences (vLLM's _bad_words_token_ids), set at submit from the
    # engine's tokenizer (check_request): they travel with the params, to any worker
    _bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise a ValueError naming the first field that is of the wrong type or out of range."""
        check_int("n", self.n, low=1)
        check_real("temperature", self.temperature, low=0.0)
        check_real("top_p", self.top_p, low=0.0)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        check_int("top_k", self.top_k, low=-1)
        if self.seed is not None:   # child j draws from seed + j, a 64-bit generator seed
            check_int("seed", self.seed, low=0, high=2 ** 63 - self.n)
        check_int("max_tokens", self.max_tokens, low=1)
        check_int("min_tokens", self.min_tokens, low=0, high=self.max_tokens)
        if not isinstance(self.stop, str | list | tuple | None) or \
                not all(isinstance(s, str) and s for s in stop_strings(self.stop)):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list | tuple):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        for t in self.stop_token_ids:
            check_int("stop_token_ids", t)
        for name in ("include_stop_str_in_output", "ignore_eos"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        check_real("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be above 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            check_real(name, getattr(self, name))
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), low=0)
        check_real("min_p", self.min_p, low=0.0)
        if self.min_p > 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
            for t, bias in self.logit_bias.items():
                digits = isinstance(t, str) and t.isascii() and t.isdigit()   # "12": a JSON key
                check_int("logit_bias's token ids", int(t) if digits else t)
                check_real(f"logit_bias[{t!r}]", bias)
                if not -LOGIT_BIAS_MAX <= bias <= LOGIT_BIAS_MAX:   # past it, float32 logits overflow
                    raise ValueError(f"logit_bias[{t!r}] must be in [-{LOGIT_BIAS_MAX}, {LOGIT_BIAS_MAX}] "
                                     f"(OpenAI's bounds), got {bias}")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list | tuple) or not self.allowed_token_ids:
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, "
                                 f"got {self.allowed_token_ids!r}")
            for t in self.allowed_token_ids:
                check_int("allowed_token_ids", t)
        if self.bad_words is not None and (not isinstance(self.bad_words, list | tuple) or not all(
                isinstance(w, str) and w.strip() for w in self.bad_words)):
            raise ValueError(f"bad_words must be a list of non-blank strings, got {self.bad_words!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(f"skip_special_tokens must be True or False, got {self.skip_special_tokens!r}")
        if self.truncate_prompt_tokens is not None:
            check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, low=1)

    def normalized(self) -> "SamplingParams":
        """A validated copy in plain Python values (a numpy integer becomes an int, stop a
        list): what a request keeps from submit on, so the caller may change or reuse its
        SamplingParams meanwhile, and nothing downstream meets an unexpected type."""
        self.validate()
        as_int = {name: int(getattr(self, name)) for name in ("n", "top_k", "max_tokens", "min_tokens")}
        as_float = {name: float(getattr(self, name)) for name in
                    ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty")}
        as_int["top_k"] = as_int["top_k"] or -1   # 0 is vLLM's other "no limit"
        as_int |= {name: None if getattr(self, name) is None else int(getattr(self, name))
                   for name in ("seed", "logprobs", "prompt_logprobs", "truncate_prompt_tokens")}
        return dataclasses.replace(
            self, **as_int, **as_float, min_p=float(self.min_p), stop=stop_strings(self.stop),
            stop_token_ids=[int(t) for t in self.stop_token_ids],
            logit_bias=None if self.logit_bias is None else
            {int(t): float(b) for t, b in self.logit_bias.items()},
            allowed_token_ids=None if self.allowed_token_ids is None else
            [int(t) for t in self.allowed_token_ids],
            bad_words=None if self.bad_words is None else list(self.bad_words))

    def clone(self) -> "SamplingParams":
        """A deep copy (vLLM's clone)."""
        return copy.deepcopy(self)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        return self._bad_words_token_ids

    @property
    def adjusts(self) -> bool:
        """Whether anything changes the logits before sampling: penalties, min_tokens bans,
        logit_bias, allowed_token_ids, bad_words (runner.py:ModelRunner._adjust)."""
        return (self.penalized or self.min_tokens > 0 or bool(self.logit_bias) or bool(self.bad_words)
                or self.allowed_token_ids is not None)

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits (sampler.TokenCounts keeps what they read)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


# Temperatures below this sample greedily, as in vLLM: dividing by one would overflow.
SAMPLING_EPS = 1e-5


def stop_strings(stop: str | list[str] | None) -> list[str]:
    """SamplingParams.stop as a list."""
    return [] if stop is None else [stop] if isinstance(stop, str) else list(stop)


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams, for LLM.beam_search: keep the beam_width most likely
    continuations (by summed logprob) at every step; rank the finished ones by summed
    logprob / length ** length_penalty. A bad value is a ValueError naming the field."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0           # vLLM's only value (beams are chosen by likelihood)
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False   # taken, as vLLM's; beam search has no stop strings

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        check_int("beam_width", self.beam_width, low=1)
        check_int("max_tokens", self.max_tokens, low=1)
        check_real("temperature", self.temperature, low=0.0)
        if self.temperature != 0:
            raise ValueError(f"BeamSearchParams' temperature must be 0 (beams are the most likely "
                             f"continuations, nothing is sampled), got {self.temperature}")
        check_real("length_penalty", self.length_penalty)
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")


@dataclass
class Logprob:
    """A token's logprob (of the model's distribution), its rank in it (1: the most likely)
    and its text, as vLLM reports them in CompletionOutput.logprobs and prompt_logprobs."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


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
    spec_draft_tokens: int = 0          # speculative decoding: tokens drafted for its sequences, checked
    spec_accepted_tokens: int = 0       # ... and those the model agreed with (kept)
    spec_steps: int = 0                 # ... in how many checks (each round of a drafting step: speculate.py)

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
    logprobs: list[dict[int, Logprob]] | None = None
    stop_reason: int | str | None = None   # the stop token or string that ended it (None: EOS, length)


@dataclass
class NewTokens:
    """A running request's output tokens since they were last handed out (Engine.new_tokens):
    what a stream shows, with their logprobs entries if the request asked for logprobs, and
    when asked its whole text so far (the stream shows what it adds: llm.py:Driver)."""
    ids: list[int]
    logprobs: list[dict[int, Logprob]] | None = None
    text: str | None = None


@dataclass
class RequestOutput:
    request_id: int | str              # LLM's: "0", "1", ... in submission order (vLLM's); an engine's int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    finished: bool = True
    error: Exception | None = None     # why it failed (ValueError: rejected); outputs is then empty
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None   # per prompt token; the first None


@dataclass
class BeamSearchSequence:
    """One beam of LLM.beam_search, as vLLM's: its tokens (the prompt's, then the output's),
    per output token the logprobs of the step's 2 x beam_width candidates, their sum along
    the beam, and tokenizer.decode(tokens) (prompt and output, special tokens kept)."""
    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None   # "stop" (ended in EOS) or "length"
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's beams, best first (vLLM's); error: why it has none (as RequestOutput.error)."""
    sequences: list[BeamSearchSequence]
    error: Exception | None = None


class TextPrompt(TypedDict):
    """vLLM's prompt dict of a text."""
    prompt: str


class TokensPrompt(TypedDict):
    """vLLM's prompt dict of token ids."""
    prompt_token_ids: list[int]


def prompt_of(prompt):
    """A prompt as a string or a list of token ids: a TextPrompt's or TokensPrompt's one
    entry; a dict with another key (multi_modal_data, ...) is a ValueError naming it."""
    if not isinstance(prompt, dict):
        return prompt
    kinds = {"prompt": str, "prompt_token_ids": list | tuple}   # TextPrompt's and TokensPrompt's keys
    unknown = [k for k in prompt if k not in kinds]
    if unknown:
        raise ValueError(f"a prompt dict's {unknown[0]!r} is not taken: nanoPD takes text only, "
                         "{'prompt': str} (TextPrompt) or {'prompt_token_ids': [int, ...]} (TokensPrompt)")
    if len(prompt) != 1:
        raise ValueError(f"a prompt dict holds 'prompt' (TextPrompt) or 'prompt_token_ids' (TokensPrompt), "
                         f"one of them, got {sorted(prompt) or 'neither'}")
    (key, value), = prompt.items()
    if not isinstance(value, kinds[key]):
        what = "a string" if key == "prompt" else "a list of token ids"
        raise ValueError(f"a prompt dict's {key!r} must be {what}, got {type(value).__name__}")
    return value


def encode(text: str, tokenizer, add_special_tokens: bool = True) -> list[int]:
    """text's token ids; a ValueError naming the prompt for a string that is not Unicode
    text (a lone surrogate, as JSON's "\\ud800" gives), which no tokenizer takes."""
    try:
        text.encode()
    except UnicodeEncodeError as e:
        raise ValueError(f"prompt: not valid Unicode text ({e})") from None
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def tokenize(prompt, tokenizer) -> tuple[str | None, list[int]]:
    """(the text, or None, and the token ids) of a prompt: a string, a list of token ids, or
    vLLM's dict of either (TextPrompt, TokensPrompt)."""
    prompt = prompt_of(prompt)
    if isinstance(prompt, str):
        return prompt, encode(prompt, tokenizer)
    if isinstance(prompt, list | tuple):
        if all(type(t) is int for t in prompt):   # the common case, without an ABC check per token
            return None, list(prompt)
        for t in prompt:   # numpy's or torch's integers are ints too; a bool or a float is not
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise ValueError(f"a prompt's token ids must be integers, got {t!r}")
        return None, [int(t) for t in prompt]
    raise ValueError(f"a prompt is a string, a list of token ids, or a dict of either (TextPrompt, "
                     f"TokensPrompt), got {type(prompt).__name__}")


def bad_words_token_ids(words: list[str], tokenizer) -> list[list[int]]:
    """vLLM's tokenization of bad_words (SamplingParams.update_from_tokenizer): each word
    lstripped, and again after a space (a word in mid-text) when that gives as many tokens
    and another first token."""
    ids = []
    for word in words:
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        ids += [alone] + ([spaced] if len(spaced) == len(alone) and spaced[0] != alone[0] else [])
    return [t for t in ids if t]


def check_token_ids(params: SamplingParams, vocab: int) -> None:
    """A ValueError naming the field whose token ids fall outside the vocabulary [0, vocab)."""
    fields = {"stop_token_ids": params.stop_token_ids, "logit_bias": list(params.logit_bias or ()),
              "allowed_token_ids": params.allowed_token_ids or [],
              "bad_words": [t for word in params.bad_words_token_ids or () for t in word]}
    for name, ids in fields.items():
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab})")


def check_request(ids: list[int], params: SamplingParams, vocab: int, tokenizer, cfg: EngineConfig,
                  room_blocks: int) -> tuple[list[int], SamplingParams]:
    """The request's prompt (its last truncate_prompt_tokens, if set) and its own copy of
    params (SamplingParams.normalized, with bad_words tokenized by tokenizer), or a
    ValueError naming what is wrong with them; room_blocks is the KV cache's size less its
    watermark (the most one request may ever hold)."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    params = params.normalized()
    params._bad_words_token_ids = bad_words_token_ids(params.bad_words or [], tokenizer) or None
    if params.truncate_prompt_tokens is not None:
        ids = ids[-params.truncate_prompt_tokens:]
    if not ids:
        raise ValueError("the prompt is empty")
    if min(ids) < 0 or max(ids) >= vocab:
        bad = next(t for t in ids if not 0 <= t < vocab)
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
    if len(ids) >= cfg.max_model_len:   # each message starts with the field at fault (server.py: param)
        raise ValueError(f"prompt ({len(ids)} tokens) leaves no room for an output under max_model_len "
                         f"({cfg.max_model_len})")
    if len(ids) + params.max_tokens > cfg.max_model_len:
        raise ValueError(f"max_tokens ({params.max_tokens}) + the prompt ({len(ids)} tokens) exceeds "
                         f"max_model_len ({cfg.max_model_len})")
    check_token_ids(params, vocab)
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(params, name) is not None and getattr(params, name) > vocab:
            raise ValueError(f"{name}={getattr(params, name)} exceeds the vocabulary size ({vocab})")
    if params.n > cfg.max_num_seqs:
        raise ValueError(f"n={params.n} exceeds max_num_seqs ({cfg.max_num_seqs})")
    # Samples of n > 1 progress independently: one must fit.
    bs = cfg.block_size
    need = cdiv(len(ids) + params.max_tokens, bs)
    if need > room_blocks:
        at_fault = "prompt" if cdiv(len(ids) + 1, bs) > room_blocks else "max_tokens"
        raise ValueError(f"{at_fault}: the request needs {need} KV blocks, more than the whole cache holds "
                         f"({room_blocks})")
    return ids, params


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
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None   # the stop token id or stop string that finished it
    detokenizer: Detokenizer | None = None   # its output's text, kept for stop strings or a stream
    text_end: int | None = None         # stopped by a stop string: where its text ends
    generator: torch.Generator | None = None
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


def seeded_generator(params: SamplingParams, index: int, device: torch.device) -> torch.Generator | None:
    """Completion `index` of a seeded request draws from its own generator, seeded seed + index."""
    if params.seed is None:
        return None
    return torch.Generator(device).manual_seed(params.seed + index)


@dataclass(eq=False)
class Request:
    """An engine's record of one request, from submit until its output is taken."""
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[Sequence] = field(default_factory=list)        # live and finished completions
    prefill_only: bool = False          # a prefill worker's: stop after the first token, keep the blocks
    num_streamed: int = 0               # output tokens already handed out by Engine.new_tokens
    error: Exception | None = None      # why it ended without its completions
    arrival: int = field(default_factory=arrival_order)   # its first sequence's: its place in the queue
    # prompt_logprobs asked: one entry per prompt token scored so far (the first, None, has
    # no position before it). One per request: its samples (n > 1) share the prompt.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Set once, so that a step's sampling skips all of it for the requests that use none:
    adjusts: bool = field(init=False)   # its logits change before sampling (SamplingParams.adjusts)
    # prompt positions whose next token a launched step scores (the host records them a
    # step later): a recomputed prompt (preemption) scores none twice
    num_prompt_scored: int = field(init=False)

    def __post_init__(self):
        self.adjusts = self.params.adjusts
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]
        self.num_prompt_scored = len(self.prompt_logprobs) - 1 if self.prompt_logprobs else 0

    @property
    def scores_prompt(self) -> bool:
        """Whether prompt positions are still to be scored (prompt_logprobs): until then the
        prompt reads no prefix cache, so every position is computed (as vLLM)."""
        return self.prompt_logprobs is not None and self.num_prompt_scored < len(self.prompt_token_ids) - 1

    @property
    def finished(self) -> bool:
        return all(s.status == Status.FINISHED for s in self.seqs)

    @property
    def parked(self) -> bool:
        """Prefilled for another worker: its first token is out, its blocks kept for the handoff."""
        return self.prefill_only and self.finished and self.seqs[0].finish_reason is None
