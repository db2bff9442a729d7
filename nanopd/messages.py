"""The messages between the central scheduler (cluster.py) and its workers (workers.py).

Each is a small dataclass, pickled across processes; the receiver dispatches on its type
with `match`. The central scheduler writes to each worker's inbox queue; a worker answers
on a pipe of its own with the list of reports of one round of its loop (a worker killed
mid-write can break only its own pipe; a queue shared by all could stay locked). Tensors
never travel here: KV caches are shared once at start-up (workers.py), so a handoff names
block ids only.

    central scheduler --Submit/Import/Release/Drop/Abort/SendKV/SetRole/Control/Measure/Stop--> worker
    central scheduler <--Ready/Heartbeat/Tokens/Handoff/Imported/Done/Configured/...-- worker
"""

from dataclasses import dataclass, field

from nanopd.request import Logprob, NewTokens, RequestOutput, SamplingParams

# ----------------------------------------------------------------------------- to a worker


@dataclass
class Submit:
    """Run a request: only its prefill (prefill_only, then park it for a handoff), or whole."""
    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    prefill_only: bool = False


@dataclass
class Import:
    """Pull a prefilled request's blocks from worker src's cache, then decode it."""
    request_id: int
    src: int
    src_blocks: list[int]
    token_ids: list[int]                # prompt + first token
    num_prompt_tokens: int
    params: SamplingParams
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    generator_state: bytes | None = None   # the random stream, where the prefill left it
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None   # the prefill's (prompt_logprobs)


@dataclass
class Release:
    """A decode worker has the request's KV (or never will): free its parked blocks."""
    request_id: int


@dataclass
class Drop:
    """Forget this request: its path broke (its source died) and it is retried elsewhere."""
    request_id: int


@dataclass
class Abort:
    """End this request here and forget it, wherever it is (the caller gave up on it)."""
    request_id: int


@dataclass
class SendKV:
    """To the worker a request was prefilled on, under a two-sided transport (distributed):
    send these runs (first block, length) of its cache to worker dst, in this order, the
    order dst posted its receives in."""
    request_id: int
    dst: int
    runs: list[tuple[int, int]]


@dataclass(frozen=True)
class SetRole:
    """This worker's part of the regime from now on (roles.py): its role and, for a split
    worker (the disaggregated policy's on one device), the SMs its prefills and its decodes
    run on (a split engine's set_split; None: unsplit). Frozen: the cluster's role map holds these."""
    role: str
    sm_split: tuple[int, int] | None = None


@dataclass
class Control:
    """Choose this worker's configuration (SM split, prompt budget per step) from now on with a
    controller of its own (controller.py), its step model the one params give (the profile, or
    the router's refit of it: sent again as it refits), for the SLO (ttft_s, tpot_s) if any."""
    params: object   # a costmodel.HardwareParams (not imported: the file map has costmodel.py after this)
    slo: tuple[float, float] | None = None


@dataclass
class Measure:
    """Run timing.measure_engine(**spec) on the idle engine and report the timings."""
    spec: dict


@dataclass
class Stop:
    """Leave the loop and exit."""


# ----------------------------------------------------------------------------- from a worker


@dataclass
class Ready:
    """The engine is built and the peer caches are in hand."""
    num_blocks: int
    watermark_blocks: int
    kv_bytes_per_token: int
    device: str = ""                    # where it runs (a remote worker: host/device)


@dataclass
class Failed:
    """The worker raised (at start-up or later) and is about to exit."""
    traceback: str


@dataclass
class Heartbeat:
    """Sent with every round that did anything, and at least every HEARTBEAT_S: what the
    router reads, and the sign of life the central scheduler's worker timeout waits for."""
    free_blocks: int
    num_blocks: int


@dataclass
class StepTimed:
    """A step the engine ran (adaptive policy): its shape and how long its decodes waited
    (a split worker's prompt chunk, decodes 0: how long it took its lane)."""
    decodes: int
    context_tokens: int
    prefill_tokens: int
    ms: float
    sm_split: tuple[int, int] | None = None   # it ran on a lane of this split (None: the whole GPU)


@dataclass
class Configured:
    """A worker's controller changed its configuration: it runs on this SM split (None: the
    whole GPU) with at most token_budget tokens per step (decodes and prompt chunks
    together); step_error is its step model's mean relative error so far."""
    sm_split: tuple[int, int] | None
    token_budget: int
    step_error: float


@dataclass
class Measured:
    timings: dict                       # timing.measure_engine's result


@dataclass
class Tokens:
    """New output tokens of the requests running here, since the last report."""
    new: dict[int, NewTokens]
    time: float


@dataclass
class Handoff:
    """A request is prefilled and parked here: the Import a decode worker needs."""
    imp: Import
    first_scheduled_time: float
    first_token_time: float


@dataclass
class Imported:
    """A decode worker has a request's KV and decodes it."""
    request_id: int
    time: float
    nbytes: int                         # KV copied
    copy_seconds: float                 # the copy itself
    seat_wait: float                    # seconds the Import waited here for a seat and blocks


@dataclass
class PullFailed:
    """A decode worker's copy of a request's KV ended in an error (its source went away, or
    stayed silent too long): the blocks it copied into are freed, the request is not here."""
    request_id: int
    src: int                            # the worker it was copied from
    error: str


@dataclass
class ToWorker:
    """A message for another worker, which the central scheduler forwards (a worker's only
    channel is to the central scheduler)."""
    worker: int
    msg: object


@dataclass
class Done:
    request_id: int
    output: RequestOutput               # its metrics as this worker saw them


@dataclass
class Rejected:
    """The worker could not serve the request: its own validation rejected it (invalid,
    e.g. a smaller cache), or serving it raised (the request ends; the worker serves on)."""
    request_id: int
    error: str
    invalid: bool = True                # a ValueError: the request is bad, not the worker


@dataclass
class Expired:
    """A parked request nobody pulled within the handoff timeout: its blocks are freed."""
    request_id: int
