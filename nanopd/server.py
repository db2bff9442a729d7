"""The OpenAI-compatible HTTP server: an LLM (llm.py builds it) behind the API that vLLM
and SGLang speak, so that OpenAI's client, a chat UI or a load tester can use it.

  python -m nanopd serve MODEL [--policy ...] [--host] [--port] [--api-key] [any LLM setting]

  EngineLoop   the LLM's driver (llm.py:Driver) beside the HTTP loop (a backend that steps
               the device on a thread of its own, a cluster polled on the HTTP loop): it
               takes submits and aborts, polls, and hands each request its updates, its
               tokens and their text as they come, then its output (Stream, an asyncio queue)
  make_app     FastAPI: /v1/completions and /v1/chat/completions (server-sent events with
               stream=true), /v1/models, /health and /metrics (Prometheus, vLLM's names)

The HTTP loop never waits on a step: a handler submits and awaits its request's events; an
engine's thread never waits on a client. The text comes decoded from the backend (the
driver's updates): the server decodes none. n > 1 is n requests of one sample each, sample
j seeded seed + j, as in LLM.generate, so that each streams. One rule for errors: whatever
a client sends wrong is a 4xx in OpenAI's error body naming the field at fault, a 5xx is the
server's own fault, and one request's failure never reaches another's stream. docs/server.md
says what is and is not served.
"""

import asyncio
import collections
import contextlib
import hmac
import itertools
import json
import queue
import re
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from nanopd.config import check_int, check_real
from nanopd.request import CompletionOutput, RequestOutput, SamplingParams, encode

# ----------------------------------------------------------------------------- the engine's thread


@dataclass(eq=False)
class Stream:
    """One request's events, from the engine loop to its handler, on the queue it shares
    with the other requests of the same HTTP call: (stream, update, None) as its tokens come
    (llm.py:Update: their ids, logprobs and text), then (stream, update, output) at its end
    (update: what its tokens had not shown; None if it failed). accepted resolves once the
    backend took it (or refused it: its exception)."""
    index: int                     # its choice in the response
    params: SamplingParams
    events: asyncio.Queue
    accepted: asyncio.Future
    streamed: bool = True          # its handler shows tokens as they come (else: its output alone)
    request_id: int | None = None
    first_token: bool = False      # a token came (it is running, not waiting)
    ended: bool = False


def settle(future: asyncio.Future, outcome) -> None:
    """On the HTTP loop: a submit's outcome (its request id, or the exception that refused
    it), unless its handler has gone meanwhile (the future was cancelled)."""
    if not future.done():
        if isinstance(outcome, Exception):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)


class Unavailable(Exception):
    """The server cannot take a request now: it holds max_pending requests, or it is
    shutting down. A 503, which a client may retry."""


TICK_S = 0.001       # a cluster is polled this often on the HTTP loop while it runs requests,
IDLE_TICK_S = 0.05   # and this often while it runs none (a submit brings the next poll forward)
HAND_OUT_SLICE = 32  # events handed to their handlers per turn of the HTTP loop (EngineLoop.hand_out)


class EngineLoop:
    """The LLM's driver (llm.py:Driver) beside the HTTP loop. A backend whose polls step
    the device (an Engine: driver.steps) runs on a thread of its own, taking commands
    (submit, abort, stop) from a queue between its polls. A cluster's only read its
    workers' reports, so it is polled on the HTTP loop itself every TICK_S (IDLE_TICK_S with
    nothing to run), and commands are carried out at once: no thread, no hand-over of the
    GIL between two threads on a request's way in and its tokens' way out. Each poll hands
    out the driver's updates: each running request's tokens, each ended one's output."""

    def __init__(self, driver, max_pending: int):
        self.driver, self.max_pending = driver, max_pending
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.streams: dict[int, Stream] = {}   # request id -> its stream, while it runs
        self.pending = 0                       # requests submitted or queued to submit, not ended
        self.lock = threading.Lock()           # pending is counted on both threads
        self.on_end = lambda out: None         # metrics (make_app)
        self.running = 0                       # of the streams, those with a token (read by /metrics)
        self.closed = False                    # shutting down: no request is taken
        self.loop = asyncio.get_running_loop()   # the HTTP loop (made in the app's lifespan)
        self.outbox: collections.deque = collections.deque()   # events not handed out yet
        self.handing_out = False
        self.threaded = driver.steps
        if self.threaded:
            self.thread = threading.Thread(target=self.run, name="nanopd-engine", daemon=True)
            self.thread.start()
        else:
            self.timer, self.idle = self.loop.call_soon(self.tick), False

    def reserve(self, count: int) -> None:
        """Take the places of count requests, all or none, before any of them is built:
        Unavailable if that would hold more than max_pending, or the server is shutting
        down. Called on the HTTP loop."""
        with self.lock:
            if self.closed:
                raise Unavailable("the server is shutting down")
            if self.pending + count > self.max_pending:
                raise Unavailable(f"the server holds {self.pending} requests and takes {self.max_pending} "
                                  f"at once (--max-pending): {count} more do not fit now")
            self.pending += count

    def submit(self, index: int, prompt: str | list[int], params: SamplingParams, events: asyncio.Queue,
               streamed: bool) -> Stream:
        """A stream for a new request whose place is reserved (its accepted future resolves
        once the backend took it). Called on the HTTP loop."""
        stream = Stream(index, params, events, self.loop.create_future(), streamed)
        self.command(("submit", prompt, stream))
        return stream

    def abort(self, stream: Stream) -> None:
        self.command(("abort", stream))

    def command(self, command: tuple) -> None:
        """Carry out command now (a cluster, on the HTTP loop), or queue it for the engine's thread."""
        if self.threaded:
            self.commands.put(command)
            return
        self.obey(command)
        if self.idle and self.streams:
            self.timer.cancel()
            self.poll_in(TICK_S)

    async def close(self) -> None:
        """Stop polling and take no more requests; those still running end with Unavailable
        (a stream: an error event, then [DONE]). Closing again changes nothing."""
        with self.lock:
            self.closed = True
        if self.threaded:
            self.commands.put(("stop",))
            await asyncio.to_thread(self.thread.join)
        else:
            self.timer.cancel()
            self.fail_all(Unavailable("the server is shutting down"))

    def can_serve(self) -> bool:
        """Whether a request could be served now: the loop runs, and (a cluster) a live
        worker takes prompts and one decodes."""
        if self.closed:
            return False
        return self.thread.is_alive() if self.threaded else self.driver.backend.can_serve()

    def tick(self) -> None:
        """One poll of a cluster, on the HTTP loop; the next one TICK_S later, or
        IDLE_TICK_S with nothing running."""
        try:
            self.serve_once(timeout=0.0)
        except Exception as e:  # noqa: BLE001 (a broken backend fails its requests; nothing hangs)
            self.fail_all(e)
        self.poll_in(TICK_S if self.streams else IDLE_TICK_S)

    def poll_in(self, seconds: float) -> None:
        self.timer, self.idle = asyncio.get_running_loop().call_later(seconds, self.tick), not self.streams

    def run(self) -> None:
        """The engine's thread: commands, then a step (or a short wait while idle)."""
        while True:
            try:   # wait for a command only while idle
                command = self.commands.get(timeout=0.0 if self.streams else 0.05)
                while True:
                    if not self.obey(command):
                        return self.fail_all(Unavailable("the server is shutting down"))
                    command = self.commands.get_nowait()
            except queue.Empty:
                pass
            if self.streams:
                try:
                    self.serve_once(timeout=0.002)
                except Exception as e:  # noqa: BLE001 (a broken backend fails its requests; nothing hangs)
                    self.fail_all(e)

    def obey(self, command: tuple) -> bool:
        """Carry out one command; False for stop."""
        match command:
            case ("submit", prompt, stream):
                try:
                    # every request watched: its first token counts it running (/metrics)
                    stream.request_id = self.driver.submit(prompt, stream.params, watch=True)
                    self.streams[stream.request_id] = stream
                    self.on_loop(settle, stream.accepted, stream.request_id)
                except Exception as e:  # noqa: BLE001 (a refused request: its handler answers it)
                    self.ended(stream)
                    self.on_loop(settle, stream.accepted, e)
            case ("abort", stream):
                if self.streams.pop(stream.request_id, None) is not None:
                    self.driver.abort([stream.request_id])
                    self.ended(stream)
            case ("stop",):
                return False
        return True

    def serve_once(self, timeout: float) -> None:
        """One poll of the driver: what came for each request, handed over in one call to
        the HTTP loop (one wake-up a step, not one per stream). First tokens go first: a
        first token is its request's TTFT, where the others add a little to a TPOT."""
        firsts, events = [], []
        for update in self.driver.poll(timeout):
            stream = self.streams.get(update.request_id)
            if stream is None:
                continue
            if update.output is None:
                self.running += not stream.first_token
                if stream.streamed:
                    (events if stream.first_token else firsts).append((stream, update, None))
                stream.first_token = True
                continue
            del self.streams[update.request_id]
            self.ended(stream)
            self.on_end(update.output)
            events.append((stream, update, update.output))
        if firsts or events:
            self.on_loop(self.hand_out, firsts, events)

    def on_loop(self, fn: Callable, *args) -> None:
        """fn(*args) on the HTTP loop: now on a cluster's poll (it runs there), handed over
        from an engine's thread."""
        if self.threaded:
            self.loop.call_soon_threadsafe(fn, *args)
        else:
            fn(*args)

    def hand_out(self, firsts: list[tuple], events: list[tuple]) -> None:
        """On the HTTP loop: first tokens ahead of every event waiting, the others behind
        them; then each event onto its stream's queue, HAND_OUT_SLICE per turn
        of the loop. Between slices the loop reads its sockets: a request arriving waits for
        a slice of a step's tokens to be written out, not for all 256 streams' of them."""
        self.outbox.extendleft(reversed(firsts))
        self.outbox.extend(events)
        if not self.handing_out:
            self.handing_out = True
            self.hand_out_slice()

    def hand_out_slice(self) -> None:
        for _ in range(min(HAND_OUT_SLICE, len(self.outbox))):
            event = self.outbox.popleft()
            event[0].events.put_nowait(event)
        self.handing_out = bool(self.outbox)
        if self.handing_out:   # the rest on the loop's next turn, after its sockets
            self.loop.call_soon(self.hand_out_slice)

    def ended(self, stream: Stream) -> None:
        """stream's request is over (ended, refused or aborted): it is no longer counted."""
        self.running -= stream.first_token
        with self.lock:
            self.pending -= 1

    def fail_all(self, error: Exception) -> None:
        """Every running request ends with error (its handler answers 500), and the backend
        is told to drop them, if it still can."""
        streams, self.streams = list(self.streams.values()), {}
        with contextlib.suppress(Exception):   # a backend that failed may fail again: nothing more to do
            self.driver.abort([s.request_id for s in streams])
        for stream in streams:
            self.ended(stream)
        ends = [(s, None, RequestOutput(s.request_id, None, [], [], None, error=error)) for s in streams]
        self.on_loop(self.hand_out, [], ends)


def kv_usage(llm) -> float:
    """The share of the KV cache's blocks in use now: the engine's, or the live workers'
    mean (their last heartbeats: a worker sends one at least every HEARTBEAT_S, idle too)."""
    cluster = llm.cluster
    if cluster is None:
        return 1.0 - llm.engine.bm.num_free_blocks / max(1, llm.engine.runner.num_blocks)
    live = [h for w, h in cluster.telemetry.status.items() if w not in cluster.dead]
    return sum(1.0 - h.free_blocks / max(1, h.num_blocks) for h in live) / max(1, len(live))


# ----------------------------------------------------------------------------- the API's bodies


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


class Sampling(BaseModel):
    """What both endpoints take: OpenAI's fields and vLLM's extras, by their names; fields it
    does not know are ignored, as vLLM does. Types are strict, as OpenAI's are: "3" is not a
    number, nor true a count, nor "yes" a bool (an int is a float). Values are checked by
    SamplingParams."""
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None   # JSON's keys are strings: SamplingParams reads "12" as 12
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16   # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=20)


class ChatRequest(Sampling):
    messages: list[dict] = Field(min_length=1)
    max_completion_tokens: int | None = None   # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    chat_template: str | None = None           # vLLM's: instead of the tokenizer's
    add_generation_prompt: bool = True


class BadRequest(Exception):
    """A request the server refuses: 400 (or status) with an OpenAI error body naming param."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 500: "internal_server_error",
               503: "service_unavailable"}
FIELDS = set(CompletionRequest.model_fields) | set(ChatRequest.model_fields)
FIRST_WORD = re.compile(r"[a-z_]+")


def param_of(error: ValueError, prompt_field: str = "prompt") -> str:
    """The request field a ValueError is about: the first word of its message where that is
    a field (SamplingParams', check_request's and render_chat's messages start with the field
    at fault), else the prompt (prompt_field: the endpoint's name for it)."""
    word = FIRST_WORD.match(str(error))
    name = word.group() if word else ""
    return name if name in FIELDS and name != "prompt" else prompt_field


def refusal(error: BaseException, prompt_field: str = "prompt") -> BadRequest:
    """How a request's error is answered: a ValueError (a bad request) a 400 naming the field
    at fault, Unavailable a 503, anything else the server's own fault, a 500."""
    if isinstance(error, BadRequest):
        return error
    if isinstance(error, Unavailable):
        return BadRequest(str(error), status=503)
    if isinstance(error, ValueError):
        return BadRequest(str(error), param_of(error, prompt_field))
    return BadRequest(f"{type(error).__name__}: {error}", status=500)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """OpenAI's error object (what its client raises from)."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "error"), "param": param,
                      "code": status}}


def sampling_params(body: Sampling, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """The request's SamplingParams, n samples (the handler splits them: samples); BadRequest
    naming the field for a bad value (SamplingParams' own check: its seed + n - 1 too)."""
    try:
        return SamplingParams(
            n=body.n, max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
            min_p=body.min_p, stop=body.stop, stop_token_ids=list(body.stop_token_ids or []),
            seed=body.seed, presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty, min_tokens=body.min_tokens,
            ignore_eos=body.ignore_eos, logit_bias=body.logit_bias,
            skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output, logprobs=logprobs)
    except ValueError as e:
        raise refusal(e) from None


def samples(params: SamplingParams) -> list[SamplingParams]:
    """params.n requests of one sample each: sample j seeded seed + j (LLM.generate's children)."""
    seed = params.seed
    return [replace(params, n=1, seed=None if seed is None else seed + j) for j in range(params.n)]


# ----------------------------------------------------------------------------- metrics


class Metrics:
    """The Prometheus metrics, vLLM's names where vLLM has one; on workers, each one's role
    and, under the adaptive policy, its configuration (token budget, decode SMs: 0 for the
    whole GPU) as nanopd's."""

    def __init__(self, loop: EngineLoop, llm):
        r, self.loop, self.llm = CollectorRegistry(), loop, llm
        self.registry = r
        self.running = Gauge("vllm:num_requests_running", "Requests running (a token came)", registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests without a token yet", registry=r)
        self.kv = Gauge("vllm:gpu_cache_usage_perc", "Share of the KV blocks in use (0-1)", registry=r)
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", buckets=buckets,
                              registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Time per output token after the first",
                              buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 1), registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end latency", buckets=buckets,
                             registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of ended requests", registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", registry=r)
        self.success = Counter("vllm:request_success", "Requests ended", ["finished_reason"], registry=r)
        self.token_budget = Gauge("nanopd:worker_token_budget", "A worker's tokens per step (adaptive)",
                                  ["worker"], registry=r)
        self.decode_sms = Gauge("nanopd:worker_decode_sms", "A worker's decode SMs, 0: the whole GPU",
                                ["worker"], registry=r)
        self.role = Gauge("nanopd:worker_role", "1 for each worker's role (the planner's regime)",
                          ["worker", "role"], registry=r)
        loop.on_end = self.ended

    def ended(self, out: RequestOutput) -> None:   # where the engine loop polls
        m, n = out.metrics, len(out.outputs[0].token_ids) if out.outputs else 0
        self.success.labels(finished_reason=out.outputs[0].finish_reason if out.outputs else "error").inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(n)
        if m is not None and m.finish_time is not None:
            self.e2e.observe(m.finish_time - m.arrival_time)
            if m.first_token_time is not None:
                self.ttft.observe(m.first_token_time - m.arrival_time)
                if n > 1:
                    self.tpot.observe((m.finish_time - m.first_token_time) / (n - 1))

    def text(self) -> bytes:
        """The metrics as they are now (the backend's KV usage and workers read at the scrape)."""
        loop = self.loop
        self.running.set(loop.running)
        self.waiting.set(max(0, loop.pending - loop.running))
        self.kv.set(kv_usage(self.llm))
        cluster = self.llm.cluster
        roles, configured = ({}, {}) if cluster is None else (cluster.roles.names(),
                                                              dict(cluster.telemetry.configured))
        self.role.clear()
        for w, role in roles.items():
            self.role.labels(worker=str(w), role=role).set(1)
        for w, c in configured.items():
            self.token_budget.labels(worker=str(w)).set(c.token_budget)
            self.decode_sms.labels(worker=str(w)).set(0 if c.sm_split is None else c.sm_split[1])
        return generate_latest(self.registry)


# ----------------------------------------------------------------------------- the app


@dataclass
class Served:
    """What the handlers share: the LLM, its engine loop (started with the app), the model's
    name, whether a request may bring its own chat template, and the ids of responses."""
    llm: object
    name: str
    trust_request_chat_template: bool = False
    loop: EngineLoop | None = None
    metrics: Metrics | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    ids: itertools.count = field(default_factory=itertools.count)

    @property
    def tokenizer(self):
        return self.llm.get_tokenizer()

    @property
    def max_model_len(self) -> int:
        return self.llm.backend.cfg.max_model_len

    def check_model(self, model: str) -> None:
        if model != self.name:
            raise BadRequest(f"the model `{model}` does not exist: this server serves `{self.name}`", "model")

    def chat_prompt(self, body: "ChatRequest") -> list[int]:
        """A conversation's prompt tokens (rendered by its template, then encoded); BadRequest
        naming the field at fault. Run off the HTTP loop: a template is a program, and
        messages may be long."""
        try:
            text = self.llm.render_chat(body.messages, body.chat_template, body.add_generation_prompt)
            return encode(text, self.tokenizer, add_special_tokens=False)
        except ValueError as e:
            raise refusal(e, "messages") from None


MAX_BODY_BYTES = 16 << 20   # past it a body is a 413, unread: parsing it would hold the HTTP loop


def check_serving(port: int = 0, api_key: str | None = None, max_pending: int = 1,
                  drain_s: float = 0.0) -> None:
    """A ValueError naming the first of serve's settings that cannot work, by its name and its flag."""
    check_int("port (--port)", port, low=0, high=65535)
    check_int("max_pending (--max-pending)", max_pending, low=1)
    check_real("drain_s (--drain-s)", drain_s, low=0.0)
    if api_key is not None and (not isinstance(api_key, str) or not api_key.strip()):
        raise ValueError(f"api_key (--api-key) must be a non-empty string (leave it out for no key), "
                         f"got {api_key!r}")


def make_app(llm, model_name: str | None = None, api_key: str | None = None,
             max_pending: int = 4096, trust_request_chat_template: bool = False) -> FastAPI:
    """The OpenAI-compatible app on llm (a nanopd.LLM, which the caller closes): the engine
    loop starts and stops with the app (its lifespan), every endpoint but /health wants
    `Authorization: Bearer api_key` when one is given, and a request's own chat_template is
    refused unless trust_request_chat_template (vLLM's flag)."""
    check_serving(api_key=api_key, max_pending=max_pending)
    served = Served(llm, model_name or llm.backend.cfg.model, trust_request_chat_template)

    async def lifespan(app: FastAPI):
        served.loop = EngineLoop(llm.driver, max_pending)
        served.metrics = Metrics(served.loop, llm)
        yield
        await served.loop.close()
    app = FastAPI(title="nanoPD", lifespan=lifespan)
    app.state.served = served
    add_error_handlers(app, api_key)

    @app.get("/health")
    async def health() -> Response:
        if served.loop.can_serve():
            return Response(status_code=200)
        return JSONResponse(error_body(503, "no worker can serve a request"), status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(served.metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": served.created,
                                            "owned_by": "nanopd", "max_model_len": served.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        served.check_model(body.model)
        prompts = prompt_list(body.prompt)
        params = sampling_params(body, body.max_tokens, body.logprobs)
        return await respond(served, request, body, prompts, params, COMPLETION)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        served.check_model(body.model)
        if body.chat_template is not None and not served.trust_request_chat_template:
            raise BadRequest("chat_template: a request's own chat template is refused (a template is a "
                             "program the server runs): start the server with --trust-request-chat-template "
                             "to take them", "chat_template")
        ids = await asyncio.to_thread(served.chat_prompt, body)
        given = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = given if given is not None else max(1, served.max_model_len - len(ids))
        params = sampling_params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
        return await respond(served, request, body, [ids], params, CHAT)
    return app


def add_error_handlers(app: FastAPI, api_key: str | None) -> None:
    """Every error as OpenAI's error body: a body that does not parse or validate is a 400
    naming the field, an unknown path a 404 (a known one with another method a 405), a body
    over MAX_BODY_BYTES a 413, BadRequest its own status, no key (when one is set) a 401, and
    any other exception the server's fault: a 500 (and its traceback in the log)."""
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        if first["type"] == "json_invalid":
            return JSONResponse(error_body(400, f"the body is not JSON: {first['ctx']['error']}"),
                                status_code=400)
        where = ".".join(str(part) for part in first["loc"][1:]) or None
        message = f"{where}: {first['msg']}" if where else first["msg"]
        return JSONResponse(error_body(400, message, where), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        cause, status = exc.__cause__, exc.status_code
        if status == 400 and cause is not None:   # FastAPI's "error parsing the body": bad UTF-8, nesting...
            message = f"the body is not JSON: {type(cause).__name__}: {cause}"
        elif status == 413:
            message = f"the body is larger than the server takes ({MAX_BODY_BYTES:,} bytes)"
        else:
            message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(error_body(status, message), status_code=status, headers=exc.headers)

    @app.exception_handler(BadRequest)
    async def refused(request: Request, exc: BadRequest) -> JSONResponse:
        return JSONResponse(error_body(exc.status, str(exc), exc.param), status_code=exc.status)

    @app.exception_handler(Exception)
    async def fault(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(500, f"{type(exc).__name__}: {exc}"), status_code=500)

    app.add_middleware(Door, api_key=api_key)


class Door:
    """What every HTTP request meets before the app. The API key, when one is set: every
    path but /health wants `Authorization: Bearer KEY` (the scheme in any case, as HTTP has
    it), else a 401. The body's size: over MAX_BODY_BYTES it is a 413, by its Content-Length
    before any of it is read, or as it comes (chunked). A plain ASGI middleware: it leaves
    the request's disconnect to the app (Starlette's BaseHTTPMiddleware would hide it from
    request.is_disconnected)."""

    def __init__(self, app, api_key: str | None):
        self.app, self.key = app, None if api_key is None else api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.key is not None and scope["path"] != "/health" \
                and not self.allowed(headers.get(b"authorization", b"")):
            refused = JSONResponse(error_body(401, "a valid API key is needed: Authorization: Bearer KEY"),
                                   status_code=401)
            return await refused(scope, receive, send)
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:
            too_large = JSONResponse(error_body(413, f"the body is larger than the server takes "
                                                     f"({MAX_BODY_BYTES:,} bytes)"), status_code=413)
            return await too_large(scope, receive, send)
        await self.app(scope, counted(receive), send)

    def allowed(self, header: bytes) -> bool:
        scheme, _, key = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), self.key)   # in constant time


def counted(receive: Callable) -> Callable:
    """receive, raising a 413 (FastAPI passes an HTTPException on) once the body's chunks
    come to more than MAX_BODY_BYTES."""
    seen = 0

    async def receive_counted() -> dict:
        nonlocal seen
        message = await receive()
        seen += len(message.get("body", b""))
        if seen > MAX_BODY_BYTES:
            raise HTTPException(413)
        return message
    return receive_counted


def prompt_list(prompt) -> list[str | list[int]]:
    """A completion's prompt as a list of prompts (a string, token ids, or a list of either)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise BadRequest("prompt must not be empty", "prompt")
    return list(prompt)


# ----------------------------------------------------------------------------- responses


@dataclass(frozen=True)
class Shape:
    """How an endpoint words its answer: its objects' names, a choice whole, a choice's
    streamed piece (first: the choice's first piece; finish: its finish reason, or None
    before its end) and a run of tokens' logprobs (at: the text offset of the first); and
    its request's name for the prompt (what an error about the prompt names)."""
    prompt_field: str
    prefix: str
    object: str
    chunk_object: str
    choice: Callable[[int, CompletionOutput, dict | None], dict]
    piece: Callable[[int, str, bool, str | None, dict | None], dict]
    logprobs: Callable[[list[int], list, object, int, int], dict]


def token_text(token: int, lp, tokenizer) -> str:
    return lp.decoded_token or tokenizer.decode([token])


def completion_logprobs(ids: list[int], entries: list, tokenizer, top: int, at: int = 0) -> dict:
    """/v1/completions' logprobs of a run of tokens: each one's text, logprob, top
    alternatives, and offset in the completion's text (the run's first at at)."""
    tokens, offsets = [], []
    for token, entry in zip(ids, entries):
        tokens.append(token_text(token, entry[token], tokenizer))
        offsets.append(at)
        at += len(tokens[-1])
    return {"tokens": tokens, "text_offset": offsets,
            "token_logprobs": [entry[t].logprob for t, entry in zip(ids, entries)],
            "top_logprobs": [{token_text(t, lp, tokenizer): lp.logprob for t, lp in entry.items()}
                             for entry in entries]}


def chat_logprobs(ids: list[int], entries: list, tokenizer, top: int, at: int = 0) -> dict:
    """/v1/chat/completions' logprobs of a run of tokens: per token its text, logprob, bytes
    and top alternatives."""
    def one(token: int, lp) -> dict:
        text = token_text(token, lp, tokenizer)
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}
    return {"content": [{**one(t, entry[t]), "top_logprobs": [one(a, lp) for a, lp in sorted(
        entry.items(), key=lambda kv: -kv[1].logprob)[:top]]} for t, entry in zip(ids, entries)]}


def completion_choice(index: int, c: CompletionOutput, logprobs: dict | None) -> dict:
    return {"index": index, "text": c.text, "finish_reason": c.finish_reason, "logprobs": logprobs}


def completion_piece(index: int, text: str, first: bool, finish: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}


def chat_choice(index: int, c: CompletionOutput, logprobs: dict | None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": c.text},
            "finish_reason": c.finish_reason, "logprobs": logprobs}


def chat_piece(index: int, text: str, first: bool, finish: str | None, logprobs: dict | None) -> dict:
    delta = {"role": "assistant"} if first else {}
    return {"index": index, "delta": {**delta, **({"content": text} if text or first else {})},
            "finish_reason": finish, "logprobs": logprobs}


COMPLETION = Shape("prompt", "cmpl", "text_completion", "text_completion", completion_choice,
                   completion_piece, completion_logprobs)
CHAT = Shape("messages", "chatcmpl", "chat.completion", "chat.completion.chunk", chat_choice, chat_piece,
             chat_logprobs)
DISCONNECT_CHECK_S = 0.5   # a waiting handler looks this often whether its client is still there


async def respond(served: Served, request: Request, body: Sampling, prompts: list, params: SamplingParams,
                  shape: Shape) -> Response:
    """Submit every prompt's n samples, then answer: whole, or as server-sent events."""
    events: asyncio.Queue = asyncio.Queue()
    streams = await start(served, prompts, params, events, body.stream, shape.prompt_field)
    head = {"id": f"{shape.prefix}-{next(served.ids)}", "created": int(time.time()), "model": served.name}
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(sse(served, streams, events, shape, head, usage, params.n),
                                 media_type="text/event-stream")
    outs = await wait_all(served, request, streams, events)
    if outs is None:   # the client went: nobody to answer
        return Response(status_code=499)
    failed = next((o.error for o in outs if o.error is not None), None)
    if failed is not None:
        raise refusal(failed, shape.prompt_field)
    def logprobs(params: SamplingParams, c: CompletionOutput) -> dict | None:
        if params.logprobs is None:
            return None
        return shape.logprobs(c.token_ids, c.logprobs, served.tokenizer, params.logprobs)
    choices = [shape.choice(s.index, out.outputs[0], logprobs(s.params, out.outputs[0]))
               for s, out in zip(streams, outs)]
    return JSONResponse({**head, "object": shape.object, "choices": choices,
                         "usage": usage_of(outs, params.n)})


async def start(served: Served, prompts: list, params: SamplingParams, events: asyncio.Queue, streamed: bool,
                prompt_field: str) -> list[Stream]:
    """Every prompt's params.n samples submitted and accepted, their places taken at once
    (all or none) before any is built; if any is refused, all are aborted and the refusal
    answered (refusal). More than the server ever holds is a 400 naming n (or the prompts)."""
    loop, count = served.loop, len(prompts) * params.n
    if count > loop.max_pending:
        raise BadRequest(f"{params.n} sample(s) of {len(prompts)} prompt(s) are {count} requests, more than "
                         f"the server holds at once ({loop.max_pending}, --max-pending)",
                         "n" if params.n > loop.max_pending or len(prompts) == 1 else prompt_field)
    try:
        loop.reserve(count)
    except Unavailable as e:
        raise refusal(e) from None
    per_sample, accepted = samples(params), False
    streams = [loop.submit(i * params.n + j, prompt, sample, events, streamed)
               for i, prompt in enumerate(prompts) for j, sample in enumerate(per_sample)]
    try:
        results = await asyncio.gather(*(s.accepted for s in streams), return_exceptions=True)
        error = next((r for r in results if isinstance(r, BaseException)), None)
        if error is not None:
            raise refusal(error, prompt_field)
        accepted = True
        return streams
    finally:   # refused, or the handler cancelled: none of them runs on
        if not accepted:
            for s in streams:
                loop.abort(s)


async def wait_all(served: Served, request: Request, streams: list[Stream], events: asyncio.Queue
                   ) -> list[RequestOutput] | None:
    """Every stream's output, in order; None if the client went first (all are aborted)."""
    outs, looked = {}, time.monotonic()
    try:
        while len(outs) < len(streams):
            with contextlib.suppress(TimeoutError):
                stream, _, out = await asyncio.wait_for(events.get(), DISCONNECT_CHECK_S)
                if out is not None:
                    stream.ended, outs[stream.index] = True, out
            if time.monotonic() - looked >= DISCONNECT_CHECK_S:   # tokens keep coming: look by the clock
                looked = time.monotonic()
                if await request.is_disconnected():
                    return None
        return [outs[s.index] for s in streams]
    finally:
        for s in streams:
            if not s.ended:
                served.loop.abort(s)


@dataclass
class StreamedChoice:
    """What a streamed choice has shown so far: whether a piece went out, and how many
    characters its tokens' logprobs' texts span (the next one's offset)."""
    started: bool = False
    at: int = 0


async def sse(served: Served, streams: list[Stream], events: asyncio.Queue, shape: Shape, head: dict,
              include_usage: bool, n: int) -> AsyncIterator[str]:
    """The answer as server-sent events: each choice's text as it comes (its updates') with
    its tokens' logprobs, its end with its finish reason (and what was not shown yet), the
    usage if asked (n samples a prompt), [DONE]. A request that fails sends its error as an
    event; a client that goes aborts them all."""
    choices = {s: StreamedChoice() for s in streams}
    outs = {}   # choice index -> its output

    def event(pieces: list[dict], **extra) -> str:
        return f"data: {json.dumps({**head, 'object': shape.chunk_object, 'choices': pieces, **extra})}\n\n"

    def piece(stream: Stream, update, finish: str | None) -> dict:
        """A choice's next piece: an update's text, and its tokens' logprobs."""
        shown, lp, tokenizer = choices[stream], None, served.tokenizer
        if stream.params.logprobs is not None:
            lp = shape.logprobs(update.ids, update.logprobs, tokenizer, stream.params.logprobs, shown.at)
            shown.at += sum(len(token_text(t, e[t], tokenizer)) for t, e in zip(update.ids, update.logprobs))
        first, shown.started = not shown.started, True
        return shape.piece(stream.index, update.text, first, finish, lp)
    try:
        while len(outs) < len(streams):
            stream, update, out = await events.get()
            if out is None:
                if update.text or not choices[stream].started or update.logprobs:
                    yield event([piece(stream, update, None)])
                continue
            stream.ended, outs[stream.index] = True, out
            if out.error is not None:
                error = refusal(out.error, shape.prompt_field)
                yield f"data: {json.dumps(error_body(error.status, str(error), error.param))}\n\n"
                continue
            yield event([piece(stream, update, out.outputs[0].finish_reason)])
        if include_usage:
            yield event([], usage=usage_of([outs[s.index] for s in streams], n))
        yield "data: [DONE]\n\n"
    finally:
        for s in streams:
            if not s.ended:
                served.loop.abort(s)


def usage_of(outs: list[RequestOutput], n: int) -> dict:
    """OpenAI's usage: each prompt's tokens once (not per sample), every completion's tokens;
    outs in the choices' order, n samples a prompt."""
    prompt = sum(len(o.prompt_token_ids) for o in outs[::max(1, n)])
    done = sum(len(o.outputs[0].token_ids) for o in outs if o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


DRAIN_END_S = 5.0   # once drain_s is over, how long the requests it ended have to send their last words


class Server(uvicorn.Server):
    """uvicorn's server, which drains on SIGTERM or Ctrl-C: it takes no new connection, the
    requests in flight have drain_s seconds to finish, then those still running end with a
    503 (a stream: an error event, then [DONE]) before their connections close. uvicorn
    alone would cancel them at its timeout, before the app's shutdown: cut mid-stream."""

    def __init__(self, app: FastAPI, drain_s: float, **config):
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=drain_s + DRAIN_END_S, **config))
        self.served, self.drain_s, self.ending = app.state.served, drain_s, None

    async def shutdown(self, sockets=None) -> None:
        def end_the_rest() -> None:
            if self.served.loop is not None:
                self.ending = asyncio.ensure_future(self.served.loop.close())
        deadline = asyncio.get_running_loop().call_later(self.drain_s, end_the_rest)
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()


def serve(llm, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          model_name: str | None = None, max_pending: int = 4096, drain_s: float = 30.0,
          trust_request_chat_template: bool = False) -> None:
    """Serve llm until SIGTERM or Ctrl-C, then drain (Server) and stop the engine loop (the
    caller closes llm). A setting that cannot work is a ValueError naming it, before anything starts."""
    check_serving(port=port, drain_s=drain_s)   # make_app checks the key and max_pending
    app = make_app(llm, model_name, api_key, max_pending, trust_request_chat_template)
    Server(app, drain_s, host=host, port=port, log_level="info").run()
