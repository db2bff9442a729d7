"""nanoPD's front: the offline LLM API (the command line is __main__.py).

    from nanopd import LLM, SamplingParams
    outs = LLM("tiny").generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
    outs = LLM("qwen3-8b", policy="disaggregated", devices=["cuda:0", "cuda:1"]).generate(...)

The calls are vLLM's: generate(prompts, sampling_params), chat(messages, sampling_params),
beam_search(prompts, BeamSearchParams(...)), get_tokenizer(), with SamplingParams of vLLM's
fields and defaults (request.py); a prompt is a string, a list of token ids, or vLLM's dict
of either (TextPrompt, TokensPrompt).

Without a policy, LLM runs one Engine (engine.py) in this process. With one, a
CentralScheduler (cluster.py) starts a worker process per device (workers.py) and routes
requests: collocated, disaggregated (prefill workers hand their KV to decode workers), or
adaptive (a router fitted to the hardware picks each request's path; router.py,
profiler.py). Both offer submit / poll / output, and LLM drives either with one loop.
"""

import contextlib
import dataclasses
import inspect
import itertools
import numbers
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Self

from tqdm import tqdm

from nanopd.config import EngineConfig
from nanopd.engine import Engine, make_engine
from nanopd.request import (
    BeamSearchOutput,
    BeamSearchParams,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    encode,
    prompt_of,
    tokenize,
)

if TYPE_CHECKING:   # a plain LLM loads none of the cluster's modules: they load with a policy
    from nanopd.cluster import CentralScheduler
    from nanopd.costmodel import HardwareParams


class LLM:
    """The offline API: LLM(model, policy, **settings).generate(prompts, params), where the
    settings are EngineConfig's fields (config.py) and, with a policy, ClusterConfig's
    (cluster.py).

    Without a policy it is one engine in this process. With policy="collocated",
    "disaggregated" or "adaptive" it serves the same calls on worker processes, one per
    entry of devices (a CentralScheduler); close() stops them (so does exiting, or
    `with LLM(...)`). Under adaptive, profile gives the router's starting parameters
    (HardwareParams), or None to measure them (profiler.py), or False for no router, and
    slo=(ttft_s, tpot_s) makes it route and plan for goodput (requests meeting both)
    rather than latency (docs/planner.md). A worker silent for worker_timeout_s is treated
    as dead (docs/workers.md). join="HOST:PORT" serves on workers torchrun starts on other
    hosts (hosts.py), over the distributed transport. vLLM's keywords that change nothing
    here (keywords.py: trust_remote_code, tensor_parallel_size=1, ...) are taken."""

    def __init__(self, model: str = "tiny", policy: str | None = None, *,
                 profile: "HardwareParams | bool | None" = None, **settings):
        engine_settings = {k: v for k, v in settings.items() if k in ENGINE_SETTINGS}
        cluster_settings = {}   # a plain LLM (an engine's settings alone) loads none of keywords.py
        if policy is not None or profile is not None or len(engine_settings) < len(settings):
            from nanopd.keywords import cluster_settings as checked
            keywords = [k for k in inspect.signature(LLM).parameters if k not in ("model", "settings")]
            cluster_settings = checked(settings, ENGINE_SETTINGS, keywords, policy, profile)
        self.closed = False
        self.request_counter = itertools.count()   # names each request, as vLLM's LLM does
        # One caller at a time drives the backend (see updates); reentrant, so that a close()
        # on the thread that holds it (an exit mid-call) does not wait on itself.
        self.lock = threading.RLock()
        # how many calls are between their first submit and their last output: a poll hands the
        # lock on only when another one waits (time.sleep(0) sleeps for Linux's timer slack,
        # 50 us by default, and after a step that drafts the GPU waits through it)
        self.callers, self.callers_lock = 0, threading.Lock()
        self.held: dict[int, list[Update]] = {}   # updates polled for another caller's requests
        self.profile_s = 0.0   # the seconds adaptive's profile took at start-up (measured, or read back)
        if policy is None:
            self.backend: Engine | CentralScheduler = make_engine(EngineConfig(model=model,
                                                                               **engine_settings))
        else:
            cfg = EngineConfig(model=model, **engine_settings)
            self._start_cluster(cfg, policy, cluster_settings, profile)
        self.driver = Driver(self.backend, steps=policy is None)

    def _start_cluster(self, cfg: EngineConfig, policy: str, settings: dict,
                       profile: "HardwareParams | bool | None") -> None:
        """A CentralScheduler under policy (its modules load here, not with LLM); under
        adaptive, its router's parameters: profile's, or measured on the workers (profiler.py)."""
        from nanopd.cluster import CentralScheduler, ClusterConfig
        from nanopd.costmodel import HardwareParams
        from nanopd.profiler import profile_cluster
        from nanopd.router import Router
        cluster_cfg = ClusterConfig(policy, **settings).resolved()
        self.backend = CentralScheduler(cfg, cluster_cfg)
        if policy == "adaptive" and profile is not False:
            begun = time.perf_counter()
            try:
                params = (profile if isinstance(profile, HardwareParams)
                          else profile_cluster(self.backend).params)
            except BaseException:
                self.backend.close()
                raise
            self.profile_s = time.perf_counter() - begun
            self.backend.router = Router(dataclasses.replace(params), slo=cluster_cfg.slo)

    @property
    def engine(self) -> Engine | None:
        return self.backend if isinstance(self.backend, Engine) else None

    @property
    def cluster(self) -> "CentralScheduler | None":
        return None if isinstance(self.backend, Engine) else self.backend

    def close(self) -> None:
        """Stop the workers and release everything. A generate running on another thread
        ends at its next poll with an error saying so."""
        self.closed = True
        with self.lock:   # between a caller's polls: none is cut in half
            if self.cluster is not None:
                self.cluster.close()

    def get_tokenizer(self):
        """The tokenizer prompts are encoded with: LLM(tokenizer=FOLDER)'s, else the
        checkpoint's own (an HF tokenizer), else UTF-8 bytes (model.py:ByteTokenizer) for a
        preset or a folder without one."""
        return self.backend.tokenizer

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: str | list[int] | dict | list[str | list[int] | dict],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Outputs in the order of prompts (each a string, a list of token ids, or vLLM's
        {"prompt": text} or {"prompt_token_ids": ids}), their request_id "0", "1", ... in
        submission order (vLLM's). sampling_params: one for every prompt, or a list of one
        per prompt; None is SamplingParams() (vLLM's defaults). A prompt that fails
        validation is a ValueError naming it (what the call had submitted is aborted), as in
        vLLM; an error that only a running request meets (its worker died) is its output's
        .error. Each request keeps its own copy of its params."""
        prompts = as_prompt_list(prompts)
        per_prompt = params_per_prompt(sampling_params, len(prompts))
        return self._run(list(zip(prompts, per_prompt)), use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """generate on conversations ([{"role": ..., "content": ...}, ...], or a list of them)
        rendered by the tokenizer's chat template (or chat_template, a Jinja template), as
        vLLM's LLM.chat: the rendered text is the prompt, tokenized without special tokens."""
        from nanopd.chat import checked_conversations
        texts = [self.render_chat(c, chat_template, add_generation_prompt)
                 for c in checked_conversations(messages)]
        tokenizer = self.get_tokenizer()
        outs = self.generate([encode(t, tokenizer, add_special_tokens=False) for t in texts], sampling_params,
                             use_tqdm)
        for out, text in zip(outs, texts):
            out.prompt = text
        return outs

    def render_chat(self, conversation: list[dict], chat_template: str | None = None,
                    add_generation_prompt: bool = True) -> str:
        """One conversation's prompt text, by the tokenizer's chat template (or chat_template):
        what chat and the server's /v1/chat/completions prompt with. A ValueError names a bad
        message or template (its first word the field at fault), or says that there is no template."""
        from nanopd.chat import render  # the templates' module loads with the first chat, not with LLM
        return render(conversation, self.get_tokenizer(), self.backend.cfg.model, chat_template,
                      add_generation_prompt)

    def beam_search(self, prompts: list, params: BeamSearchParams, *,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's beam search: per prompt (a TextPrompt or TokensPrompt dict, a string or a
        list of ids), the params.beam_width best beams (score: summed logprob / output length
        ** length_penalty, HF's), best first. A prompt it could not serve has none and the
        error (BeamSearchOutput.error)."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        params.validate()
        from nanopd import beams  # loaded by the first beam search, not by LLM
        tokenizer, ids = self.get_tokenizer(), []
        for i, p in enumerate(as_prompt_list(prompts)):
            try:
                ids.append(tokenize(p, tokenizer)[1])
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from e

        def generate(token_prompts: list[list[int]], step: SamplingParams) -> list[RequestOutput]:
            return self._run([(p, step) for p in token_prompts], use_tqdm=False)
        return beams.search(generate, ids, params, self.backend.eos_ids, tokenizer,
                            self.backend.cfg.max_model_len)

    def _run(self, work: list[tuple], use_tqdm: bool) -> list[RequestOutput]:
        """Each (prompt, params) of work's output, in work's order (updates)."""
        outputs = [None] * len(work)
        # disable=None: the bar shows only on a terminal
        with tqdm(total=len(work), desc="generating",
                  disable=True if not use_tqdm or len(work) < 2 else None) as bar:
            for i, update in self.updates(work):
                outputs[i] = update.output
                bar.update()
        return outputs

    def updates(self, work: list[tuple], watch: bool = False) -> Iterator[tuple[int, "Update"]]:
        """Submit every (prompt, params) of work, then yield (its index, an update) as
        they come until each has ended (Driver): its output, and with watch its tokens and
        text as they come. A bad request (a ValueError at submit) fails the call with a
        ValueError naming its prompt, as in vLLM; any other error at submit (a dead cluster)
        is that request's .error. Outputs are named "0", "1", ... in submission order. If the
        call fails, is interrupted (Ctrl-C) or left by its consumer, every request it
        submitted that still runs is aborted: the backend is left empty and usable. Several
        threads may call it at once: each submits and polls under the lock, and whoever polls
        keeps the updates of the others' requests for them (self.held)."""
        if self.closed:
            raise RuntimeError("this LLM is closed: create a new LLM(...) to generate again")
        ids, names, failed = {}, [str(next(self.request_counter)) for _ in work], []
        # a Ctrl-C lands between submits and steps, never inside one
        with self.calling(), interrupts_held() as safe_point:
            try:
                for i, (prompt, params) in enumerate(work):
                    with self.lock:   # an id is recorded once it exists
                        try:
                            ids[self.driver.submit(prompt, params, watch)] = i
                        except ValueError as e:   # a bad request: the call fails, as in vLLM
                            raise ValueError(f"prompt {i}: {e}") from e
                        except Exception as e:  # noqa: BLE001 (this request fails, alone)
                            failed.append((i, Update(-1, output=failed_output(prompt, e))))
                    safe_point()
                for i, update in itertools.chain(failed, self._wait(ids, safe_point)):
                    if update.output is not None:   # the backend's own ids stay inside it
                        update.output.request_id = names[i]
                    yield i, update
            except BaseException:
                if self.closed:   # close() released everything
                    raise
                with self.lock:
                    self.driver.abort(list(ids))
                    for r in ids:
                        self.held.pop(r, None)
                raise

    def _wait(self, ids: dict[int, int], safe_point: Callable[[], None]) -> Iterator[tuple[int, "Update"]]:
        """Poll until every request of ids (request id -> index) has ended and left ids,
        yielding (index, update) for theirs; a held Ctrl-C is taken at safe_point."""
        while ids:
            with self.lock:
                if self.closed:
                    raise RuntimeError(f"this LLM was closed (close() on another thread) while "
                                       f"{len(ids)} of this call's requests ran")
                mine = [u for r in [r for r in self.held if r in ids] for u in self.held.pop(r)]
                for update in self.driver.poll(0.05):
                    if update.request_id in ids:
                        mine.append(update)
                    else:
                        self.held.setdefault(update.request_id, []).append(update)
            for update in mine:
                i = ids[update.request_id] if update.output is None else ids.pop(update.request_id)
                yield i, update
            safe_point()
            if self.callers > 1:
                time.sleep(0)   # let a thread waiting for the lock have it

    @contextlib.contextmanager
    def calling(self) -> Iterator[None]:
        """Counts a call of updates while it runs (self.callers)."""
        with self.callers_lock:
            self.callers += 1
        try:
            yield
        finally:
            with self.callers_lock:
                self.callers -= 1


@dataclass
class Update:
    """What a poll brought one request (Driver.poll): a watched request's tokens since its
    last update, their logprobs entries (if it asked for them) and the text they add; its
    last update has its output (and what of it the others had not shown)."""
    request_id: int
    ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    text: str = ""
    output: RequestOutput | None = None


@dataclass
class Shown:
    """What a watched request's updates have shown: tokens, and characters of its text.
    While it runs, its last `hold` characters wait (the longest stop string's length less
    one: a stop string may be starting there, and its output is cut before one)."""
    hold: int
    tokens: int = 0
    chars: int = 0

    def update(self, request_id: int, ids: list[int], logprobs: list | None, text: str, end: int,
               output: RequestOutput | None = None) -> Update:
        """An update of ids, their logprobs, and text[:end] (of the request's so far) past what was shown."""
        update = Update(request_id, ids, logprobs, text[self.chars:end], output)
        self.tokens, self.chars = self.tokens + len(ids), max(self.chars, end)
        return update


class Driver:
    """The one way to run a backend (an Engine, or a cluster's CentralScheduler: both take
    submit, poll, new_tokens, output and abort) and receive each request's updates as they
    come, for LLM's calls, the server (server.py:EngineLoop) and the benchmark (bench.py).
    A watched request's text is the backend's (new_tokens), held back where a stop string
    may start, as vLLM's. steps: whether a poll steps the device (an engine: the server
    gives it a thread of its own) or only reads the workers' reports."""

    def __init__(self, backend: "Engine | CentralScheduler", steps: bool):
        self.backend, self.steps = backend, steps
        self.watched: dict[int, Shown] = {}

    def submit(self, prompt: str | list[int] | dict, params: SamplingParams, watch: bool = False) -> int:
        """A new request's id; watched (a request of one completion), it has an update
        whenever tokens come, not only at its end."""
        request_id = self.backend.submit(prompt, params)
        if watch:
            stops = [params.stop] if isinstance(params.stop, str) else params.stop or []
            self.watched[request_id] = Shown(max(map(len, stops), default=1) - 1)
        return request_id

    def abort(self, request_ids: list[int]) -> None:
        self.backend.abort(request_ids)
        for request_id in request_ids:
            self.watched.pop(request_id, None)

    def poll(self, timeout: float) -> list[Update]:
        """Poll the backend once (an engine steps; an idle one waits timeout): the watched
        requests' new tokens, then each ended request's last update (one whose output the
        backend cannot build ends with that error)."""
        ended, updates = self.backend.poll(timeout), []
        if self.watched:
            done = set(ended)
            for request_id, new in self.backend.new_tokens(text=True).items():
                shown = self.watched.get(request_id)
                if shown is not None and request_id not in done:   # an ended one's output shows it all
                    updates.append(shown.update(request_id, new.ids, new.logprobs, new.text,
                                                len(new.text) - shown.hold))
        for request_id in ended:
            try:
                out = self.backend.output(request_id)
            except Exception as e:  # noqa: BLE001 (this request fails, alone)
                out = failed_output(None, e)
            shown, c = self.watched.pop(request_id, None), out.outputs[0] if out.outputs else None
            updates.append(Update(request_id, output=out) if shown is None or c is None else
                           shown.update(request_id, c.token_ids[shown.tokens:],
                                        c.logprobs and c.logprobs[shown.tokens:], c.text, len(c.text), out))
        return updates




def failed_output(prompt, error: Exception) -> RequestOutput:
    """The output of a request that ended before it ran: no completions, the error."""
    prompt = prompt_of(prompt)
    return RequestOutput(-1, prompt if isinstance(prompt, str) else None,
                         prompt if isinstance(prompt, list) else [],
                         [], RequestMetrics(time.perf_counter()), error=error)


@contextlib.contextmanager
def interrupts_held():
    """Hold every Ctrl-C that arrives inside the block: the signal only records itself, and
    the block takes it at its safe points (the function it yields: between one submit or
    engine step and the next), so that no submit (registering a request and returning its
    id) and no step (whose scheduler moves blocks between sequences) is cut in half, and no
    KeyboardInterrupt is raised inside whatever Python runs at that instant (a garbage
    collector's callback swallows it). One still held at the end is taken there. Only the
    main thread receives signals; elsewhere this holds nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda *args: caught.append(args))

    def take() -> None:   # the held Ctrl-C goes to the handler it would have reached
        if caught:
            args = caught.pop(0)
            if callable(previous):
                previous(*args)
            elif previous == signal.SIG_DFL:
                signal.signal(signal.SIGINT, previous)
                signal.raise_signal(signal.SIGINT)
    try:
        yield take
    finally:
        signal.signal(signal.SIGINT, previous)
        take()


ENGINE_SETTINGS = [f.name for f in dataclasses.fields(EngineConfig) if f.name != "model"]




def params_per_prompt(sampling_params, n: int) -> list:
    """generate's sampling_params as one per prompt (each is checked when its prompt is submitted)."""
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, list | tuple):
        if len(sampling_params) != n:
            raise ValueError(f"sampling_params is a list of {len(sampling_params)}, for {n} prompts: "
                             "give one SamplingParams, or one per prompt")
        return list(sampling_params)
    return [sampling_params] * n


def as_prompt_list(prompts) -> list:
    """generate's prompts as a list: one prompt (a string, a list of token ids, or a dict of
    either: TextPrompt, TokensPrompt) or a list of them. Each prompt is checked when it is
    submitted (request.tokenize)."""
    if isinstance(prompts, str | dict) or (isinstance(prompts, list | tuple) and prompts
                                    and all(isinstance(t, numbers.Integral) for t in prompts)):
        return [prompts]
    if isinstance(prompts, list | tuple):
        return list(prompts)
    raise ValueError(f"prompts must be a string, a list of token ids, a prompt dict, or a list of those; "
                     f"got {type(prompts).__name__}")
