"""The central scheduler: serves requests on worker processes (workers.py), one per device,
under a policy. A policy only writes the regime, each worker's role (roles.py):

  collocated     every worker both (prefills and decodes); a request goes to the least loaded
  disaggregated  num_prefill workers prefill, the others decode; a prefilled request's
                 KV moves to the decode worker with the least work
  adaptive       every worker both at first; the Planner (planner.py) rewrites the roles as
                 the arrivals change (on two or more workers: one has one regime), each
                 worker's controller (controller.py) chooses its prompt budget and SM split,
                 and per request the Router (router.py) picks the prefill and the decode
                 worker the roles allow by predicted cost (the same one: collocated), and
                 learns from what each request and step really cost

Dispatch reads the roles, never the policy. The CentralScheduler is wiring between its
parts, each with one job: Liveness (below: which workers are alive), Telemetry
(telemetry.py: their load), RequestLedger (lifecycle.py: each request's record and ending),
the RoleMap (roles.py: the regime). Its settings are one ClusterConfig (below).

It offers the interface the single Engine offers (submit, poll, output), so the offline
LLM (llm.py) drives either with one loop. A worker that dies: the requests it held
(prefilling, decoding, or with KV parked on it for a transfer) start again from their
prompt on live workers, once; if no live worker can take them, or they fail a second
time, they end with a RuntimeError in RequestOutput.error. Nothing waits on a dead
worker. close() (also run at exit and when the object is collected) stops every worker.
"""

import collections
import dataclasses
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from tqdm import tqdm

from nanopd.config import EngineConfig, check_device, check_int, check_real
from nanopd.costmodel import HISTORY, WorkerLoad
from nanopd.hosts import RemoteWorkers, parse_address
from nanopd.kv_cache import cdiv
from nanopd.lifecycle import RequestLedger, RequestRecord
from nanopd.messages import (
    Abort,
    Configured,
    Control,
    Done,
    Drop,
    Expired,
    Failed,
    Handoff,
    Heartbeat,
    Imported,
    Measure,
    Measured,
    PullFailed,
    Ready,
    Rejected,
    Release,
    SetRole,
    StepTimed,
    Submit,
    Tokens,
    ToWorker,
)
from nanopd.model import Detokenizer, eos_ids, load_config, load_tokenizer
from nanopd.planner import PLAN_INTERVAL_S, Planner, regimes
from nanopd.request import NewTokens, RequestMetrics, RequestOutput, SamplingParams, check_request, tokenize
from nanopd.roles import ROLES, RoleMap
from nanopd.router import Observation, Router
from nanopd.smsplit import default_menu, num_sms
from nanopd.telemetry import Telemetry
from nanopd.transport import TRANSPORTS
from nanopd.workers import HEARTBEAT_S, WorkerProcesses, exit_in_order_on_sigterm

log = logging.getLogger("nanopd")


@dataclass(frozen=True)
class Policy:
    """What a policy fixes at start-up: the role it gives each worker first, and whether it
    steers the roles after (the planner rewrites them as the arrivals change, and the
    router picks each request's path: any worker may then hand off to any other)."""
    roles: Callable[[int, int], list[str]]   # (workers, num_prefill) -> a role per worker
    steered: bool = False


POLICIES = {
    "collocated": Policy(lambda n, k: ["both"] * n),
    # On one device: one split worker, its prefill and decode lanes on the fixed split.
    "disaggregated": Policy(lambda n, k: ["split"] if n == 1
                            else ["prefill" if w < k else "decode" for w in range(n)]),
    "adaptive": Policy(lambda n, k: ["both"] * n, steered=True),
}


@dataclass
class ConfigChange:
    """A worker's controller changed its configuration (messages.py:Configured): when, in
    seconds since the cluster started (the clock of the planner's log, from its start), and to what."""
    time_s: float
    worker: int
    sm_split: tuple[int, int] | None
    token_budget: int


@dataclass(frozen=True)
class ClusterConfig:
    """The cluster's settings (each one a keyword of nanopd.LLM); the engine's are one
    EngineConfig (config.py), shared by every worker."""
    policy: str                                 # one of POLICIES
    devices: list[str] | None = None            # a worker per entry; None: every GPU, or two CPU workers
    num_prefill: int = 1                        # disaggregated: the first num_prefill workers prefill
    transport: str = "p2p"                      # how the KV moves (transport.py); joined workers: distributed
    worker_timeout_s: float = 60.0              # a worker silent this long is dead (Liveness)
    slo: tuple[float, float] | None = None      # adaptive: (ttft_s, tpot_s), to route and plan for goodput
    time_steps: bool = False                    # every worker reports its timed steps (adaptive's always do)
    # HOST:PORT: serve workers torchrun starts on their hosts (hosts.py)
    join: str | None = None

    def resolved(self) -> "ClusterConfig":
        """These settings with the defaults that depend on the others filled in: workers that
        join from their hosts bring their own devices and take the distributed transport
        (unless another is named); otherwise devices None is default_devices()."""
        if self.join is not None:
            return replace(self, transport="distributed") if self.transport == "p2p" else self
        return replace(self, devices=default_devices()) if self.devices is None else self

    def validate(self) -> None:
        """Raise a ValueError naming the first bad setting, before any worker starts."""
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r} is not one of {', '.join(POLICIES)}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport {self.transport!r} is not one of {', '.join(TRANSPORTS)}")
        devices = self.devices
        if self.join is not None:   # the workers are on their hosts, torchrun's: their devices are theirs
            parse_address(self.join)
            if devices is not None or self.transport != "distributed":
                raise ValueError("join (workers on other hosts) takes transport='distributed' and no devices")
            devices = ["cpu"]
        if not isinstance(devices, list | tuple) or not devices:
            raise ValueError(f"devices must be a non-empty list of device names, got {devices!r}")
        check_int("num_prefill", self.num_prefill, low=0)
        check_real("worker_timeout_s", self.worker_timeout_s)
        if self.worker_timeout_s <= 2 * HEARTBEAT_S:
            raise ValueError(f"worker_timeout_s must be above {2 * HEARTBEAT_S:g} s (the workers' heartbeat "
                             f"is {HEARTBEAT_S:g} s), got {self.worker_timeout_s}")
        if self.slo is not None:
            self._check_slo()
        if len({check_device(d).type for d in devices}) > 1:   # the KV handoff shares caches of one kind
            raise ValueError(f"devices {list(devices)} mix cpu and cuda")
        if (self.transport == "distributed" and str(devices[0]).startswith("cuda")
                and len(set(map(str, devices))) < len(devices)):
            raise ValueError(f"the distributed transport (NCCL) needs a GPU of its own per worker, "
                             f"got {list(devices)}")

    def _check_slo(self) -> None:
        if not POLICIES[self.policy].steered:
            raise ValueError(f"slo applies to the adaptive policy (it steers its router), not to "
                             f"{self.policy}")
        if not isinstance(self.slo, list | tuple) or len(self.slo) != 2:
            raise ValueError(f"slo must be (ttft_s, tpot_s), got {self.slo!r}")
        for name, value in zip(("slo's ttft_s", "slo's tpot_s"), self.slo):
            check_real(name, value)
            if value <= 0:
                raise ValueError(f"{name} must be above 0, got {value}")


def default_devices() -> list[str]:
    """Every GPU, or two CPU workers."""
    return [f"cuda:{i}" for i in range(torch.cuda.device_count())] or ["cpu", "cpu"]


class Liveness:
    """Which workers are alive. A live worker reports at least every workers.HEARTBEAT_S,
    busy or idle; one whose process ended, or one silent for timeout_s (stopped, hung, or
    starved: it is killed), is dead, with why. Also the workers' names (their devices)."""

    def __init__(self, workers: WorkerProcesses | RemoteWorkers, devices: list[str], timeout_s: float):
        self.workers, self.devices, self.timeout_s = workers, devices, timeout_s
        self.dead: dict[int, str] = {}        # worker -> why
        self.errors: dict[int, str] = {}      # worker -> the traceback it reported
        self.heard: dict[int, float] = {}     # worker -> when its last reports came

    def wait_ready(self, timeout_s: float) -> dict[int, Ready]:
        """Block until every worker reports Ready; each one's Ready. A worker that ends
        first, or the timeout, raises (start_error)."""
        readies, deadline = {}, time.monotonic() + timeout_s
        with tqdm(total=len(self.devices), desc="starting workers", leave=False, disable=None) as bar:
            while len(readies) < len(self.devices):
                for w, reports in self.workers.receive(0.5, skip=set()):
                    for msg in reports:
                        if isinstance(msg, Ready):
                            readies[w], self.devices[w] = msg, msg.device or self.devices[w]
                            bar.update()
                        elif isinstance(msg, Failed):
                            self.errors[w] = msg.traceback
                failed = self.exited()
                if failed or time.monotonic() > deadline:
                    raise self.start_error(failed[0] if failed else None, timeout_s)
        self.heard = dict.fromkeys(range(len(self.devices)), time.monotonic())
        return readies

    def exited(self) -> list[int]:
        """The workers whose process ended, and those that reported a failure (they exit
        next; a worker on another host cannot be watched, so its report is all we see)."""
        return sorted(set(self.workers.exited()) | set(self.errors))

    def start_error(self, w: int | None, timeout_s: float) -> Exception:
        """Why the cluster could not start: a worker's own ValueError (a setting its device
        cannot meet) as a ValueError, anything else as a RuntimeError naming the worker."""
        if w is None:
            return RuntimeError(f"a worker was not ready after {timeout_s:.0f} s")
        last = (self.errors.get(w, "").strip().splitlines() or [""])[-1]
        if last.startswith("ValueError: "):
            return ValueError(f"worker {w} ({self.devices[w]}): {last.removeprefix('ValueError: ')}")
        if not last:   # it died before it could say why: most often in the spawn bootstrap
            last = (f"{self.workers.why(w)}, before it ran (a script that starts "
                    "workers must do so under `if __name__ == \"__main__\":`)")
        return RuntimeError(f"worker {w} ({self.devices[w]}) did not start: {last}")

    def receive(self, timeout: float) -> list[tuple[int, list]]:
        """(worker, its reports of one round) for every round the live workers sent,
        waiting up to timeout for the first; each worker heard from is alive now."""
        got = self.workers.receive(timeout, skip=set(self.dead))
        for w, _ in got:
            self.heard[w] = time.monotonic()
        return got

    def check(self) -> list[int]:
        """The workers found dead since the last check, now marked dead with why: those
        whose process ended or that reported a failure (why: the last line of their
        traceback, or their exit), and
        those silent for timeout_s, which are killed (so that they cannot come back and
        serve requests moved elsewhere)."""
        found, now = [], time.monotonic()
        for w in self.exited():
            if w not in self.dead:
                self.dead[w] = (self.errors.get(w, "").strip().splitlines()[-1:] or [self.workers.why(w)])[0]
                found.append(w)
        for w, heard in self.heard.items():
            if w not in self.dead and now - heard > self.timeout_s:
                self.workers.kill(w)
                self.dead[w] = f"no report for {now - heard:.0f} s (worker_timeout_s={self.timeout_s:g})"
                found.append(w)
        return found

    def live(self) -> list[int]:
        return [w for w in range(len(self.devices)) if w not in self.dead]

    def summary(self) -> str:
        return ", ".join(f"worker {w} ({self.devices[w]}): {why}" for w, why in self.dead.items()) or "none"


def configs_held(log: collections.deque[ConfigChange], w: int, start: float, end: float, routed: WorkerLoad
                 ) -> list[tuple[float, tuple[int, int] | None, int | None]]:
    """The configurations (SM split, token budget) worker w held from start to end (s since
    the cluster started), each with its share of that time: the one a request was routed
    under (routed), then w's changes in the log after start (in time order: read back from
    its end, so a long log costs only what changed meanwhile)."""
    changes = []
    for c in reversed(log):
        if c.time_s <= start:
            break
        if c.worker == w and c.time_s <= end:
            changes.append(c)
    held = [(start, routed.sm_split, routed.token_budget)] + [(c.time_s, c.sm_split, c.token_budget)
                                                              for c in reversed(changes)]
    span = max(end - start, 1e-9)
    return [((until - at) / span, split, token_budget)
            for (at, split, token_budget), until in zip(held, [h[0] for h in held[1:]] + [end])]


def worker_config(cfg: EngineConfig, steered: bool, device: str, role: str) -> EngineConfig:
    """A worker's engine config: the cluster's, on its device. A worker whose role only
    ever prefills (a fixed policy's prefill worker) gets no drafter: drafts are made where
    a request decodes, and a handoff moves the target's K/V only (a draft model's cache
    catches up on the decode worker), so a draft model there would only take memory.
    Workers on other hosts (hosts.py) build theirs from the cluster's config, drafter
    and all."""
    prefills_only = not steered and not ROLES[role].decodes
    return replace(cfg, device=device, **({"speculative_config": None} if prefills_only else {}))


def set_split_menu(cfg: EngineConfig, cluster: "ClusterConfig", steered: bool, devices: list[str],
                   roles: list[str]) -> None:
    """The SM splits the workers' engines are built for, set in cfg (their decode graphs are captured
    at start-up): a steered policy's controllers may choose any of the default menu
    (smsplit.default_menu); a fixed split worker runs on sm_split (default: the menu's
    second, 3/8 of the SMs for decode: 84/48 on an H200). Speculative decoding and a split
    exclude each other (config.py): a steered policy with speculation gets no menu, so its
    controllers never split, and a fixed split worker with speculation is refused here,
    before any worker starts."""
    menu = default_menu(num_sms(torch.device(devices[0])) if str(devices[0]).startswith("cuda") else 0)
    speculates = cfg.speculative_config is not None
    if any(ROLES[r].splits_sms for r in roles) and cfg.sm_split is None:
        if speculates:
            raise ValueError(f"speculative_config with {cluster.policy} on {len(devices)} "
                             "device(s): its worker would be a split worker, whose lanes do not "
                             "speculate; use collocated or adaptive, or more devices")
        cfg.sm_split = tuple(menu[1])
    if steered and not cfg.split_menu and not speculates:
        cfg.split_menu = tuple(tuple(s) for s in menu)


def kv_sources(roles: RoleMap, n: int, steered: bool, transport: str) -> list[list[int]]:
    """Whose KV cache each worker reads: under a steered policy every other worker's (the
    roles change, and the router may move any request); else, if its role takes
    handoffs, those of the workers whose role hands off."""
    if not TRANSPORTS[transport].shares_caches:   # two-sided: nothing is shared
        return [[] for _ in range(n)]
    role = roles.role
    return [[j for j in range(n)
             if j != i and (steered or (role(i).takes_handoffs and role(j).hands_off))]
            for i in range(n)]


class CentralScheduler:
    """Serves requests on one worker process per entry of devices, under a policy (see the
    module's docstring). Under adaptive, `router` must be set before the first submit
    (nanopd.LLM does it, from the profiler's measurements)."""

    def __init__(self, cfg: EngineConfig, cluster: ClusterConfig, startup_timeout_s: float = 600.0):
        cluster.validate()
        self.cluster_cfg, self.cfg = cluster, replace(cfg)   # a copy: the cluster fills in its own limits
        self.cfg.validate()
        config = load_config(self.cfg.model)
        self.cfg.max_model_len = min(self.cfg.max_model_len, config.max_position_embeddings)
        self.vocab_size, self.eos_ids = config.vocab_size, eos_ids(config)
        self.tokenizer = load_tokenizer(self.cfg.tokenizer or self.cfg.model)
        self.steered = POLICIES[cluster.policy].steered
        # Workers time every step for the router under a steered policy, and where asked (bench.py).
        self.times_steps = self.steered or cluster.time_steps
        self._start_workers(startup_timeout_s)
        self.requests = RequestLedger()
        self.measured: dict[int, dict] = {}
        self._router: Router | None = None
        self.controlled_at = -1e9   # when the workers' controllers were last sent the router's parameters
        # the last HISTORY of each (a window: a server that runs for days keeps no more)
        self.config_log: collections.deque[ConfigChange] = collections.deque(maxlen=HISTORY)
        self.step_log: collections.deque[tuple[float, int, StepTimed]] = collections.deque(maxlen=HISTORY)
        # (s since start, worker, step): every step timed (times_steps)
        # Under a steered policy the planner decides the roles, replanned as the arrivals change,
        # where the workers have more than one regime to choose from (one worker has one: both).
        n = len(self.devices)
        self.planner = Planner(list(range(n)), cluster.slo) if self.steered and len(regimes(n)) > 1 else None
        try:
            readies = self.liveness.wait_ready(startup_timeout_s)
        except (ValueError, RuntimeError):
            self.close()
            raise
        self.room = min(r.num_blocks - r.watermark_blocks for r in readies.values())
        self.telemetry = Telemetry(len(self.devices), self.room, self.cfg.max_num_seqs, time.perf_counter())
        for w, r in readies.items():
            self.telemetry.heartbeat(w, Heartbeat(r.num_blocks, r.num_blocks))
        self.told = {w: SetRole(part.role) for w, part in self.roles.parts.items()}   # as each worker starts
        self._tell_workers()
        self.started = time.perf_counter()

    def _start_workers(self, startup_timeout_s: float) -> None:
        """Spawn a worker per device on this host, or listen at `join` for workers torchrun
        starts on their hosts (hosts.py); their roles under the policy."""
        exit_in_order_on_sigterm()   # a SIGTERM then stops the workers too, as any exit does
        cluster, devices = self.cluster_cfg, self.cluster_cfg.devices
        if cluster.join is not None:
            self.workers = RemoteWorkers(cluster.join, self.cfg, self.transport, self.times_steps,
                                         startup_timeout_s)
            self._close = weakref.finalize(self, self.workers.close)
            devices = [f"worker {w}" for w in range(self.workers.count)]   # named by their Ready
        n = len(devices)
        roles = POLICIES[cluster.policy].roles(n, cluster.num_prefill)
        set_split_menu(self.cfg, cluster, self.steered, devices, roles)
        self.roles = RoleMap(roles, {w: self.cfg.sm_split for w, r in enumerate(roles)
                                     if ROLES[r].splits_sms})
        if not self.roles.takers(list(range(n))) or not self.roles.decoders(list(range(n))):
            raise ValueError(f"{cluster.policy} needs 1 <= num_prefill < the number of workers, "
                             f"got num_prefill={cluster.num_prefill} with {n} workers")
        if cluster.join is None:
            configs = [worker_config(self.cfg, self.steered, d, role) for d, role in zip(devices, roles)]
            sources = kv_sources(self.roles, n, self.steered, self.transport)
            self.workers = WorkerProcesses(configs, sources, self.transport, self.times_steps,
                                           [f"nanopd-{self.roles.name(w)}-{w}" for w in range(n)])
            self._close = weakref.finalize(self, self.workers.close)   # it holds the workers, not this object
        self.liveness = Liveness(self.workers, list(devices), cluster.worker_timeout_s)

    def close(self) -> None:
        self._close()

    # -- what the parts hold, as the callers (llm.py, profiler.py) read it

    @property
    def transport(self) -> str:
        return self.cluster_cfg.transport

    @property
    def devices(self) -> list[str]:
        return self.liveness.devices

    @property
    def dead(self) -> dict[int, str]:
        return self.liveness.dead

    @property
    def active(self) -> dict[int, RequestRecord]:
        return self.requests.active

    @property
    def done(self) -> dict[int, RequestRecord]:
        return self.requests.done

    @property
    def router(self) -> Router | None:
        return self._router

    @router.setter
    def router(self, router: Router | None) -> None:
        """The adaptive policy's router (set after the profile): each worker then controls its
        own configuration from the router's parameters (messages.py:Control)."""
        self._router = router
        if router is not None:
            self._tell_controllers(time.perf_counter())

    def _tell_controllers(self, now: float) -> None:
        """Send each live worker the router's parameters as they are now (its controller's
        step model's prior), every PLAN_INTERVAL_S: the router refits them as it serves."""
        self.controlled_at = now
        for w in self.liveness.live():
            self.workers.send(w, Control(dataclasses.replace(self.router.cost.p), self.cluster_cfg.slo))

    # -- the regime

    def set_roles(self, roles: dict[int, str]) -> None:
        """Write roles into the role map, which dispatch reads from now on; tell each live
        worker whose part changed."""
        self.roles.write(roles)
        self._tell_workers()

    def _tell_workers(self) -> None:
        for w in self.liveness.live():
            part = self.roles.parts[w]
            if self.told[w] != part:
                self.workers.send(w, part)   # the map's entry is the SetRole message itself
                self.told[w] = part

    def _replan(self) -> None:
        """Let the planner replan the regime (every planner.PLAN_INTERVAL_S); write what it
        decided into the role map."""
        now = time.perf_counter()
        if not self.planner.time_to_plan(now):   # the loads pass over every active request: not on every poll
            return
        if self.planner.plan(self.router.cost, self.worker_loads(self.liveness.live()), self.cfg.max_num_seqs,
                             now):
            self.set_roles(self.planner.roles)
            log.info("regime %s, roles %s", self.planner.regime, self.planner.roles)

    def worker_loads(self, workers: list[int]) -> dict[int, WorkerLoad]:
        """What the router weighs, per worker (telemetry.py:Telemetry.loads)."""
        return self.telemetry.loads(workers, self.requests.active.values(), self.roles, time.perf_counter())

    def _least_loaded(self, workers: list[int]) -> int:
        return self.telemetry.least_loaded(workers, self.requests.active.values(), self.roles,
                                           time.perf_counter())

    def can_serve(self) -> bool:
        """Whether a request could be served now: a live worker takes prompts, and one decodes."""
        live = self.liveness.live()
        return bool(self.roles.takers(live) and self.roles.decoders(live))

    # -- requests

    def submit(self, prompt: str | list[int], params: SamplingParams) -> int:
        """Validate (ValueError, as the single engine) and dispatch a request; its id."""
        text, ids = tokenize(prompt, self.tokenizer)
        ids, params = check_request(ids, params, self.vocab_size, self.tokenizer, self.cfg, self.room)
        t = self.requests.track(text, ids, params)
        self.telemetry.arrived(time.perf_counter(), len(ids))
        if self.planner is not None and self.router is not None:
            predicted = self.router.predictor.predict(len(ids), params.max_tokens).mean
            self.planner.arrived(time.perf_counter(), len(ids), predicted)
        # n > 1 runs on one engine (its samples fork off one prefill) unless it may be handed
        # off: an Import carries one sequence, so each sample is then a request of its own.
        may_move = self.steered or any(self.roles.role(w).hands_off for w in self.roles.parts)
        for r in (self.requests.split_samples(t) if may_move and params.n > 1 else [t]):
            self._dispatch(r)
        return t.request_id

    def _dispatch(self, t: RequestRecord, path: tuple[int, int] | None = None) -> None:
        """Send t to its prefill (or whole-request) worker: path's, the router's pick, or the
        least loaded of the live workers whose role takes prompts; t fails if no live worker
        can take it, or none could decode it."""
        live = self.liveness.live()
        takers, decoders = self.roles.takers(live), self.roles.decoders(live)
        if not takers or not decoders:
            return self.requests.fail(t, RuntimeError(f"no live worker can serve it "
                                                      f"(dead: {self.liveness.summary()})"))
        if path is not None:
            w, t.decode_worker = path
        elif self.router is not None:
            loads = self.worker_loads(live)
            blocks = cdiv(len(t.prompt_token_ids) + t.params.max_tokens, self.cfg.block_size)
            w, t.decode_worker, predicted = self.router.route(len(t.prompt_token_ids), t.params.max_tokens,
                                                               loads, blocks, takers, decoders)
            t.metrics.routed = (predicted, loads[w], loads[t.decode_worker])
        else:
            w = self._least_loaded(takers)
            t.decode_worker = None if self.roles.role(w).hands_off else w
        t.worker = t.prefill_worker = w
        t.phase = "prefill"
        self.workers.send(w, Submit(t.request_id, t.prompt_token_ids, t.params,
                                    prefill_only=t.decode_worker != w))

    # -- reports from the workers

    def poll(self, timeout: float = 0.05) -> list[int]:
        """Handle what the workers reported, waiting up to timeout for it; the ids of the
        requests that ended since the last poll (submit's ids), wherever they ended."""
        for w, reports in self.liveness.receive(timeout):
            for msg in reports:
                self._on_report(w, msg)
        for w in self.liveness.check():
            self._worker_died(w)
        if self.router is not None:
            if self.planner is not None:
                self._replan()
            if time.perf_counter() - self.controlled_at >= PLAN_INTERVAL_S:
                self._tell_controllers(time.perf_counter())
        return self.requests.take_ended()

    def _on_report(self, w: int, msg) -> None:
        """Handle one report of worker w."""
        current = self.requests.current
        match msg:
            case Failed():
                self.liveness.errors[w] = msg.traceback
            case Heartbeat():
                self.telemetry.heartbeat(w, msg)
            case StepTimed():   # the router refits its step model; prefill tokens count toward the rate
                if self.router is not None:
                    self.router.observe_step(msg.decodes, msg.context_tokens, msg.prefill_tokens, msg.ms,
                                             msg.sm_split)
                self.telemetry.stepped(time.perf_counter(), msg)
                self.step_log.append((time.perf_counter() - self.started, w, msg))
            case Measured():
                self.measured[w] = msg.timings
            case Configured():
                self.telemetry.configured[w] = msg
                self.config_log.append(ConfigChange(time.perf_counter() - self.started, w, msg.sm_split,
                                                    msg.token_budget))
            case Tokens():
                for request_id, new in msg.new.items():
                    t = current(w, request_id)
                    if t is not None:
                        t.tokens += new.ids
                        t.logprobs += new.logprobs or []
                        t.metrics.first_token_time = t.metrics.first_token_time or msg.time
            case Handoff():
                self._on_handoff(w, msg)
            case Imported():
                self._on_imported(w, msg)
            case Done() if (t := current(w, msg.request_id)):
                self.requests.finish(t, w, msg.output)
                if self.router is not None and t.metrics.routed is not None:
                    self._teach_router(t, w)
            case ToWorker() if msg.worker not in self.dead:
                self.workers.send(msg.worker, msg.msg)
            case Rejected() if current(w, msg.request_id):
                self.requests.fail(self.active[msg.request_id],
                                   (ValueError if msg.invalid else RuntimeError)(msg.error))
            case PullFailed() if (t := current(w, msg.request_id)) and t.prefill_worker == msg.src:
                if msg.src not in self.dead:
                    self.workers.send(msg.src, Release(t.request_id))   # nobody will pull it now
                self._retry(t, f"its KV copy from worker {msg.src} to worker {w} failed: {msg.error}")
            case Expired() if current(w, msg.request_id, prefill_side=True):
                t = self.active[msg.request_id]
                if t.phase == "transfer":   # the decode worker must not pull the freed blocks now
                    self.workers.send(t.worker, Drop(t.request_id))
                    self.requests.fail(t, RuntimeError(f"its KV was never pulled from worker {w}"))

    def _on_handoff(self, w: int, msg: Handoff) -> None:
        """Forward the prefill worker's Import to a live worker whose role takes handoffs:
        its planned decode worker, else the least loaded. That may be w itself (under
        adaptive, if its planned decode worker died, say): the Import then keeps the
        blocks where they are."""
        t = self.requests.current(w, msg.imp.request_id)
        if t is None:
            return
        imp = msg.imp
        t.metrics.first_scheduled_time, t.metrics.first_token_time = (msg.first_scheduled_time,
                                                                      msg.first_token_time)
        t.tokens, t.logprobs = imp.token_ids[imp.num_prompt_tokens:], list(imp.logprobs)
        decoders = self.roles.decoders(self.liveness.live())
        if not decoders:
            self.workers.send(w, Release(t.request_id))
            return self.requests.fail(t, RuntimeError(f"no live decode worker "
                                                      f"(dead: {self.liveness.summary()})"))
        d = t.decode_worker if t.decode_worker in decoders else self._least_loaded(decoders)
        t.worker, t.phase = d, "transfer"
        self.workers.send(d, imp)

    def _on_imported(self, w: int, msg: Imported) -> None:
        t = self.requests.current(w, msg.request_id)
        if t is None:
            return
        m = t.metrics
        m.imported_time, m.kv_bytes_moved, m.kv_copy_time, m.seat_wait = msg.time, msg.nbytes, \
            msg.copy_seconds, msg.seat_wait
        t.phase = "decode"
        self.workers.send(t.prefill_worker, Release(t.request_id))

    def _teach_router(self, t: RequestRecord, w: int) -> None:
        """Feed the router what this request's path really cost, and under what it ran."""
        phases, (predicted, load_p, load_d) = t.metrics.phases(), t.metrics.routed
        ran = configs_held(self.config_log, t.prefill_worker, t.metrics.arrival_time - self.started,
                           time.perf_counter() - self.started, load_p)
        self.router.observe(Observation(
            len(t.prompt_token_ids), len(t.output.outputs[0].token_ids), t.prefill_worker, w, load_p, load_d,
            (phases["queued"] + phases["prefill"]) * 1e3, phases["transfer"] * 1e3,
            (phases["seat_wait"] + phases["decode"]) * 1e3, predicted, t.params.max_tokens, ran))

    # -- endings

    def _worker_died(self, w: int) -> None:
        """Every request w held starts again from its prompt on a live worker, or fails. A
        steered policy's planner first makes every live worker both: its regime may have
        lost the only worker of a role."""
        why = self.dead[w]
        if self.planner is not None:
            self.planner.reset(self.liveness.live(), time.perf_counter())
            self.set_roles(self.planner.roles)
        for t in list(self.active.values()):
            if t.samples or t.phase == "done":
                continue
            if t.phase == "transfer" and t.prefill_worker == w and t.worker != w:
                # its source is gone: discard the copy
                self.workers.send(t.worker, Drop(t.request_id))
            elif t.phase == "transfer" and t.worker == w and t.prefill_worker not in self.dead:
                self.workers.send(t.prefill_worker, Release(t.request_id))   # nobody will pull it now
            if t.worker == w or (t.phase == "transfer" and t.prefill_worker == w):
                self._retry(t, f"worker {w} ({self.devices[w]}) died: {why}")

    def _retry(self, t: RequestRecord, why: str) -> None:
        """Start the request again from its prompt on a live worker, once; the second time
        its path breaks it fails, with why."""
        if self.requests.restart(t):
            self._dispatch(t)
        else:
            self.requests.fail(t, RuntimeError(why))

    def new_tokens(self, text: bool = False) -> dict[int, NewTokens]:
        """Output tokens of the running single-completion requests since the last call, with
        their logprobs if asked, and with text=True each one's text so far (decoded here as
        they come), as Engine.new_tokens gives them (n > 1 reports its completions when
        done): what a stream shows. A request restarted elsewhere shows tokens again
        past those it showed."""
        new = {}
        for t in self.requests.active.values():
            if not (t.params.n > 1 or t.samples) and len(t.tokens) > t.shown:
                ids, skip = t.tokens[t.shown:], t.params.skip_special_tokens
                logprobs = None if t.params.logprobs is None else t.logprobs[t.shown:]
                if text:
                    t.text = t.text or Detokenizer(self.tokenizer, skip_special_tokens=skip)
                    for token in ids:
                        t.text.add(token)
                so_far = t.text.text if text else None
                new[t.request_id], t.shown = NewTokens(ids, logprobs, so_far), len(t.tokens)
        return new

    def output(self, request_id: int) -> RequestOutput:
        """An ended request's output; the cluster forgets it."""
        return self.requests.output(request_id)

    def abort(self, request_ids: list[int]) -> None:
        """End these requests now and forget them: every worker that may hold one (its
        worker, and the prefill worker where its KV may be parked) is told to drop it."""
        for request_id in request_ids:
            t = self.requests.forget(request_id)
            if t is None:
                continue
            self.abort(t.samples)
            for w in {t.worker, t.prefill_worker} - {None} - set(self.dead):
                self.workers.send(w, Abort(request_id))

    # -- for the profiler

    def measure(self, w: int, spec: dict, timeout_s: float = 600.0) -> dict:
        """Run timing.measure_engine(**spec) on idle worker w; its timings."""
        self.measured.pop(w, None)
        self.workers.send(w, Measure(spec))
        deadline = time.monotonic() + timeout_s
        while w not in self.measured:
            self._poll_keeping_others(0.05)
            if w in self.dead or time.monotonic() > deadline:
                raise RuntimeError(f"worker {w} did not finish measuring: {self.dead.get(w, 'timed out')}")
        return self.measured.pop(w)

    def run_on_path(self, prompt_ids: list[int], path: tuple[int, int],
                    max_tokens: int = 2) -> RequestMetrics:
        """Serve one request on a given (prefill worker, decode worker); its metrics."""
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        t = self.requests.track(None, prompt_ids, params)
        self._dispatch(t, path)
        while t.request_id not in self.done:
            self._poll_keeping_others(0.05)
        self.requests.ended.remove(t.request_id)
        return self.output(t.request_id).metrics

    def _poll_keeping_others(self, timeout: float) -> None:
        """Poll, leaving the ids it ends for the caller's next poll."""
        self.requests.ended = self.poll(timeout)

