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
import difflib
import functools
import inspect
import itertools
import numbers
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Self

import jinja2
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
    here (VLLM_KEYWORDS: trust_remote_code, tensor_parallel_size=1, ...) are taken."""

    def __init__(self, model: str = "tiny", policy: str | None = None, *,
                 profile: "HardwareParams | bool | None" = None, **settings):
        settings = without_vllm_keywords(settings)
        check_settings(settings)
        self.closed = False
        self.request_counter = itertools.count()   # names each request, as vLLM's LLM does
        # One caller at a time drives the backend (see _run); reentrant, so that a close() on
        # the thread that holds it (an exit mid-call) does not wait on itself.
        self.lock = threading.RLock()
        # how many calls are between their first submit and their last output: a poll hands the
        # lock on only when another one waits (time.sleep(0) sleeps for Linux's timer slack,
        # 50 us by default, and after a step that drafts the GPU waits through it)
        self.callers, self.callers_lock = 0, threading.Lock()
        self.ended: dict[int, RequestOutput] = {}   # outputs polled for another caller's requests
        self.profile_s = 0.0   # the seconds adaptive's profile took at start-up (measured, or read back)
        engine_settings = {k: v for k, v in settings.items() if k in ENGINE_SETTINGS}
        cluster_settings = {k: v for k, v in settings.items() if k not in ENGINE_SETTINGS}
        if policy is None:
            given = [k for k, v in cluster_settings.items() if v != cluster_defaults()[k]]
            given += ["profile"] if profile is not None else []
            if given:
                raise ValueError(f"{', '.join(given)} only apply with a policy (collocated, disaggregated, "
                                 "adaptive); without one, LLM is a single engine on `device`")
            self.backend: Engine | CentralScheduler = make_engine(EngineConfig(model=model,
                                                                               **engine_settings))
            return
        self._start_cluster(EngineConfig(model=model, **engine_settings), policy, cluster_settings, profile)

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
        return self._run([(p, sp, {}) for p, sp in zip(prompts, per_prompt)], use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """generate on conversations ([{"role": ..., "content": ...}, ...], or a list of them)
        rendered by the tokenizer's chat template (or chat_template, a Jinja template), as
        vLLM's LLM.chat: the rendered text is the prompt, tokenized without special tokens."""
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
        (conversation,) = checked_conversations([conversation])
        tokenizer = self.get_tokenizer()
        if (chat_template or getattr(tokenizer, "chat_template", None)) is None:
            raise ValueError(f"the tokenizer of {self.backend.cfg.model} has no chat template: pass "
                             "chat_template=... (a Jinja template, as in the tokenizer_config.json of chat "
                             "models)")
        try:   # transformers' templates are Jinja: its errors are a bad template, or messages it refuses
            return tokenizer.apply_chat_template(conversation, chat_template=chat_template, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
        except jinja2.TemplateError as e:
            at_fault = "chat_template" if chat_template is not None else "messages: the chat template failed"
            raise ValueError(f"{at_fault}: {type(e).__name__}: {e}") from None

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
        tokenizer = self.get_tokenizer()
        prompts = [tokenize(p, tokenizer)[1] for p in as_prompt_list(prompts)]
        def generate(token_prompts: list[list[int]], step: SamplingParams) -> list[RequestOutput]:
            return self._run([(p, step, {}) for p in token_prompts], use_tqdm=False)
        return beams.search(generate, prompts, params, self.backend.eos_ids, tokenizer,
                            self.backend.cfg.max_model_len)

    def _run(self, work: list[tuple], use_tqdm: bool) -> list[RequestOutput]:
        """Submit every (prompt, params, extra), then poll until each has ended. A bad
        request (a ValueError at submit) fails the call with a ValueError naming its prompt,
        as in vLLM; any other error at submit (a dead cluster) is that request's .error. If
        this call fails or is interrupted at any point (Ctrl-C), every request it submitted
        that is still running is aborted: the engine is left empty and usable. Several threads may call it at
        once: each submits and polls under the lock, and whoever polls keeps the outputs
        for the call that asked (self.ended)."""
        if self.closed:
            raise RuntimeError("this LLM is closed: create a new LLM(...) to generate again")
        outputs, ids = [None] * len(work), {}
        names = [str(next(self.request_counter)) for _ in work]
        # a Ctrl-C lands between submits and steps, never inside one
        with self.calling(), interrupts_held() as safe_point:
            try:
                for i, (prompt, params, extra) in enumerate(work):
                    with self.lock:   # an id is recorded once it exists
                        try:
                            ids[self.backend.submit(prompt, params, **extra)] = i
                        except ValueError as e:   # a bad request: the call fails, as in vLLM
                            raise ValueError(f"prompt {i}: {e}") from e
                        except Exception as e:  # noqa: BLE001 (this request fails, alone)
                            outputs[i] = failed_output(prompt, e)
                    safe_point()
                self._wait(ids, outputs, use_tqdm, safe_point)
                for out, name in zip(outputs, names):   # the backend's own ids stay inside it
                    out.request_id = name
            except BaseException:
                if self.closed:   # close() released everything
                    raise
                with self.lock:
                    mine = [r for r in ids if outputs[ids[r]] is None]
                    self.backend.abort(mine)
                    for r in mine:
                        self.ended.pop(r, None)
                raise
        return outputs

    def _wait(self, ids: dict[int, int], outputs: list, use_tqdm: bool,
              safe_point: Callable[[], None]) -> None:
        """Poll until every request of ids (request id -> index) has its output; a held
        Ctrl-C is taken at safe_point, between steps (interrupts_held)."""
        pending = set(ids)
        # disable=None: the bar shows only on a terminal
        with tqdm(total=len(ids), desc="generating",
                  disable=True if not use_tqdm or len(ids) < 2 else None) as bar:
            while pending:
                with self.lock:
                    if self.closed:
                        raise RuntimeError(f"this LLM was closed (close() on another thread) while "
                                           f"{len(pending)} of this call's requests ran")
                    for request_id in self.backend.poll(0.05):
                        self.ended[request_id] = self.output_of(request_id)
                    done = pending & self.ended.keys()
                    for request_id in done:
                        outputs[ids[request_id]] = self.ended.pop(request_id)
                pending -= done
                bar.update(len(done))
                safe_point()
                if self.callers > 1:
                    time.sleep(0)   # let a thread waiting for the lock have it

    @contextlib.contextmanager
    def calling(self) -> Iterator[None]:
        """Counts a call of _run while it runs (self.callers)."""
        with self.callers_lock:
            self.callers += 1
        try:
            yield
        finally:
            with self.callers_lock:
                self.callers -= 1

    def output_of(self, request_id: int) -> RequestOutput:
        """The backend's output of an ended request; one it cannot build ends with that error."""
        try:
            return self.backend.output(request_id)
        except Exception as e:  # noqa: BLE001 (this request fails, alone)
            return failed_output(None, e)


def checked_conversations(messages) -> list[list[dict]]:
    """chat's messages as a list of conversations, each message {"role": str, "content": str}
    (content given as OpenAI's text parts, [{"type": "text", "text": ...}], joined by
    newlines, as vLLM does); or a ValueError naming the conversation and the message."""
    if not isinstance(messages, list | tuple) or not messages:
        raise ValueError("messages must be a non-empty list of messages or of conversations, "
                         f"got {messages!r}")
    conversations = [messages] if isinstance(messages[0], dict) else messages
    out = []
    for c, conversation in enumerate(conversations):
        if not isinstance(conversation, list | tuple) or not conversation:
            raise ValueError(f"conversation {c} must be a non-empty list of messages, got {conversation!r}")
        out.append([checked_message(m, f"conversation {c}, message {i}") for i, m in enumerate(conversation)])
    return out


def checked_message(message, where: str) -> dict:
    """One chat message as {"role", "content"} strings (chat's check, checked_conversations)."""
    if not isinstance(message, dict):
        raise ValueError(f"{where} must be a dict with 'role' and 'content', got {type(message).__name__}")
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not role:
        raise ValueError(f"{where} needs a 'role' (a non-empty string such as 'user'), got {role!r}")
    if isinstance(content, list | tuple):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ValueError(f"{where}: content parts must be {{'type': 'text', 'text': str}} "
                             "(the model takes text only)")
        content = "\n".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ValueError(f"{where} needs a 'content' string (or a list of text parts), got {content!r}")
    return {**message, "content": content}


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


# vLLM's LLM keywords that change nothing here: each one's values that nanoPD serves as vLLM
# would, and (for a value it cannot serve) what it lacks.
VLLM_KEYWORDS = {
    "trust_remote_code": ((False, True), "runs no code from a checkpoint: Qwen3 is built in"),
    "disable_log_stats": ((False, True), "logs no stats"),
    "tensor_parallel_size": ((1,), ("has no tensor parallelism: a model runs whole on each device "
                                    "(policy=... with devices=[...] serves on several)")),
    "pipeline_parallel_size": ((1,), "has no pipeline parallelism: a model runs whole on each device"),
    "enable_chunked_prefill": ((True,), "always chunks prefills (max_num_batched_tokens a step)"),
    "quantization": ((None,), "has no quantized weights"),
    "kv_cache_dtype": (("auto",), "keeps the KV cache in the model's dtype"),
}


def without_vllm_keywords(settings: dict) -> dict:
    """settings less VLLM_KEYWORDS, each checked: a value nanoPD cannot serve is a ValueError
    naming it and what nanoPD lacks."""
    for name, (allowed, lacks) in VLLM_KEYWORDS.items():
        value = settings.get(name, allowed[0])
        if value not in allowed or type(value) not in {type(a) for a in allowed}:   # True is not 1 here
            raise ValueError(f"{name}={value!r}: nanoPD {lacks} (it takes {' or '.join(map(repr, allowed))})")
    return {k: v for k, v in settings.items() if k not in VLLM_KEYWORDS}


ENGINE_SETTINGS = [f.name for f in dataclasses.fields(EngineConfig) if f.name != "model"]


@functools.cache
def cluster_defaults() -> dict:
    """Each cluster setting (ClusterConfig's fields) and its default, read only where a
    setting is not the engine's: a plain LLM loads none of the cluster's modules."""
    from nanopd.cluster import ClusterConfig
    return {f.name: f.default for f in dataclasses.fields(ClusterConfig) if f.name != "policy"}


def check_settings(settings: dict) -> None:
    """A ValueError for a keyword LLM does not take, naming the nearest one it does."""
    for name in settings:
        if name not in ENGINE_SETTINGS and name not in cluster_defaults():
            keywords = [k for k in inspect.signature(LLM).parameters if k not in ("model", "settings")]
            near = difflib.get_close_matches(name, ENGINE_SETTINGS + list(cluster_defaults()) + keywords, n=1,
                                             cutoff=0.5)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ValueError(f"LLM() got an unknown setting {name!r}{hint} (the settings are LLM's keywords, "
                             f"ClusterConfig's fields: {', '.join(cluster_defaults())}, and EngineConfig's: "
                             f"{', '.join(ENGINE_SETTINGS)})")


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
