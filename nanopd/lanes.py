"""The split worker: one engine whose prefill and decode run at once, on disjoint SMs of one
GPU (smsplit.py), over one KV cache. Its runner (SplitRunner, a ModelRunner) has two lanes
per split of its menu, and decode graphs for each split's decode lane; a SplitEngine is an
Engine (engine.py) that keeps a step on the device on each lane:

  prefill lane: once its chunk's tokens have landed, take them (the prompts done join the
                decodes: their KV is in their blocks already) and launch the next chunk;
  decode lane:  a step of the decodes alone (launch N+1, finish N), as the Engine's.

The split is an entry of the engine's split menu, or None (the whole GPU: the Engine's own
step). It changes between steps only (set_split): the steps in flight finish first.
"""

import collections
import contextlib
import itertools
import time
from dataclasses import dataclass

import torch

from nanopd.config import EngineConfig
from nanopd.engine import Engine, LaunchedStep, StepShape
from nanopd.kv_cache import cdiv
from nanopd.model import CausalLM
from nanopd.request import Request, SamplingParams, Sequence
from nanopd.runner import Lane, ModelRunner
from nanopd.scheduler import Batch
from nanopd.smsplit import Split, load_kernels_at_start, make_lanes, num_sms

# Decode graphs of a split's decode lane: coarser than the whole GPU's, one set per split.
SPLIT_GRAPH_SIZES = [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256, 384, 512, 768, 1024]


@dataclass
class SplitLane(Lane):
    """A lane of a split: a prefill lane runs eagerly (graphs captured on all SMs would use
    all SMs, and its chunks are big enough to keep its SMs busy without them); a decode
    lane has decode graphs of its own and tells cuBLAS how many SMs it has (carveout: the
    SMs it lacks): cuBLAS sizes a GEMM's grid for the SMs it expects, and a grid cut for
    132 SMs runs in two waves on 112, the second nearly empty."""
    carveout: int | None = None   # SMs of the device this lane's GEMMs leave out (None: all are its)
    split: Split | None = None    # the split it is a lane of (None: the whole GPU)

    @contextlib.contextmanager
    def running(self):
        """Launch (or capture) on this lane: its stream, and cuBLAS aimed at its SMs."""
        with super().running():
            if self.carveout is None:
                yield
                return
            blas = torch.backends.cuda.preferred_blas_library()
            torch.backends.cuda.preferred_blas_library("cublaslt")   # the library that reads the target
            torch._C._set_sm_carveout_experimental(self.carveout)
            try:
                yield
            finally:
                torch._C._set_sm_carveout_experimental(None)
                torch.backends.cuda.preferred_blas_library(blas)


class SplitRunner(ModelRunner):
    """A ModelRunner with the lanes of each split of the menu (cfg.sm_split and
    cfg.split_menu: two streams on disjoint SMs each, smsplit.py) beside the whole GPU's,
    and the whole GPU without graphs (full_gpu_eager: prompts with nothing to decode)."""

    def __init__(self, model: CausalLM, cfg: EngineConfig):
        self.menu = [tuple(s) for s in dict.fromkeys([cfg.sm_split, *cfg.split_menu]) if s]   # as asked
        # (these keep the driver's objects)
        self.split_lanes = [make_lanes(model.device, Split(*s)) for s in self.menu]
        super().__init__(model, cfg)

    def _set_up_steps(self) -> None:
        """Each split of the menu, under the SM counts the driver gave: its prefill lane and
        its decode lane; then the whole GPU's (ModelRunner's). The eager lane runs on the
        whole GPU's stream, with its buffers."""
        self.splits: dict[Split, tuple[SplitLane, SplitLane]] = {}
        total = num_sms(self.device)
        for lanes, asked in zip(self.split_lanes, self.menu):
            if (lanes.prefill is not None
                    and tuple(asked) != (lanes.split.prefill_sms, lanes.split.decode_sms)):
                raise ValueError(f"split {tuple(asked)}: the decode lane gets its SMs in multiples the "
                                 f"driver allows and the prefill lane the rest, here "
                                 f"{lanes.split.prefill_sms} + {lanes.split.decode_sms}: pass "
                                 f"({lanes.split.prefill_sms}, {lanes.split.decode_sms})")
            # Only the decode lane's GEMMs are aimed at its SMs: a prompt's GEMMs keep cuBLAS's
            # own choice, which runs the prefill lane's chunks faster (docs/split.md).
            self.splits[lanes.split] = (SplitLane(lanes.prefill, split=lanes.split),
                                        SplitLane(lanes.decode, carveout=total - lanes.split.decode_sms
                                                  if lanes.decode else None, split=lanes.split))
        super()._set_up_steps()
        full = self.full_gpu   # the eager lane runs on its stream: its buffers (split None: the whole GPU)
        self.full_gpu_eager = SplitLane(uploads=full.uploads, downloads=full.downloads)

    def lanes(self) -> list[Lane]:
        return [self.full_gpu, *(lane for pair in self.splits.values() for lane in pair)]

    def _capture_lane_graphs(self, pool) -> None:
        """A graph keeps the SMs of the stream it was captured on: each split's decode lane
        gets graphs of its own (all in the one pool: only one decode lane runs at a time)."""
        max_bs = self.cfg.max_num_seqs
        for split, (_, decode) in self.splits.items():
            if decode.stream is not None:
                decode.stream.wait_stream(torch.cuda.current_stream())
                with decode.running():
                    pool = self._capture_decode_graphs(
                        [b for b in SPLIT_GRAPH_SIZES if b < max_bs] + [max_bs], pool, decode.stream,
                        decode, f" on {split}")

    def _other_streams_reserve(self, peak: int, sampling: int) -> int:
        """Per split a prefill lane's biggest step (up to the whole peak) and a decode lane's
        (the logits and sampling of every seat)."""
        return sum(lanes.prefill is not None for lanes in self.split_lanes) * (peak + sampling)


@dataclass
class PrefillLaneStep:
    """A prompt chunk done on the prefill lane: what it computed, where (split: None is the
    whole GPU), and the ms its lane was taken by it, from its launch until the host saw its
    tokens (the lane's next chunk starts only then)."""
    shape: StepShape
    split: Split | None
    ms: float


def sequences_of(step: LaunchedStep | None) -> set[Sequence]:
    """The sequences a lane's step in flight computes (none if no step)."""
    return step.sequences() if step is not None else set()


def wait_for(lane: Lane, step: LaunchedStep | None) -> None:
    """lane's next work starts on the device only once step (another lane's) has ended."""
    if step is not None and step.output.ready is not None:
        (lane.stream or torch.cuda.current_stream()).wait_event(step.output.ready)


class SplitEngine(Engine):
    """An Engine whose steps run on the two lanes of an SM split (None: the whole GPU).
    Its in_flight is the decode lane's step; prefill_in_flight the prefill lane's."""
    features = ("sm_split",)
    runner_class = SplitRunner

    def __init__(self, cfg: EngineConfig):
        load_kernels_at_start()   # before anything asks CUDA about the device (validate does)
        self.split: Split | None = None                  # the SM split steps run on (None: the whole GPU)
        self.prefill_in_flight: LaunchedStep | None = None
        # the decode lane's next step waits for the prefill lane's
        self.decode_waits_for_prefill = False
        self.ended_while_switching: list[int] = []       # requests that finished while the split changed
        # Done since a worker last took them (bounded: an offline engine has nobody taking them).
        self.prefill_lane_steps: collections.deque[PrefillLaneStep] = collections.deque(maxlen=1024)
        super().__init__(cfg)   # warms the whole GPU up
        if self.model.device.type == "cuda":
            for split in self.runner.splits:   # and every split of the menu
                self.set_split(split)
                self._warm_up()
            self.prefill_lane_steps.clear()   # the warm-up's chunks: no work anyone sent
        self.set_split(cfg.sm_split)

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
        self.ended_while_switching += [r.request_id for r in self._drain()]
        self.split = key

    def _drain(self) -> list[Request]:
        """Finish the steps in flight, on the device and on the host; the requests that finished."""
        finished = []
        for step in (self.prefill_in_flight, self.in_flight):
            if step is not None:
                finished += self._finish(step)
        self.prefill_in_flight = self.in_flight = None
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        return finished

    def take_prefill_lane_steps(self) -> list[PrefillLaneStep]:
        """The prompt chunks done on the prefill lane since the last call (workers.py reports them)."""
        steps = list(self.prefill_lane_steps)
        self.prefill_lane_steps.clear()
        return steps

    def has_unfinished(self) -> bool:
        """Work left, a chunk in flight, or requests a split change finished that the next
        step returns."""
        return (super().has_unfinished() or self.prefill_in_flight is not None
                or bool(self.ended_while_switching))

    def _serve_warm_up(self, ids: list[int], names: itertools.count) -> None:
        """On a split, its two lanes too (a lane is taken only while the other has work):
        short requests in every seat decode on the decode lane beside the biggest prompt
        chunk on the prefill lane, so that each lane's stream has run its biggest step and
        keeps the memory for it. A stream that allocates from the driver mid-serve waits
        for the whole device: a decode step, for the chunk beside it."""
        if self.split is not None:
            n, bs = self._warm_up_len(), self.cfg.block_size
            # blocks left
            room = self.bm.num_blocks - self.bm.watermark_blocks - len(ids) * cdiv(n + 2, bs)
            chunk = max(1, min(self.cfg.max_num_batched_tokens, room // 2 * bs))
            longest = self.cfg.max_model_len - 1
            # the chunk, in prompts that fit
            prompts = [min(longest, chunk - i) for i in range(0, chunk, longest)]
            blocks = sum(cdiv(p + 1, bs) for p in prompts)
            seats = max(0, min(self.cfg.max_num_seqs - len(ids) - len(prompts),
                               (room - blocks) // cdiv(n + 3, bs)))
            short = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0)
            ids = ids + [self.submit([0] * n, short, request_id=next(names)) for _ in range(seats)]
            self.step()   # their prompts, on the whole GPU (nothing decodes yet)
            # prompts no cache has seen
            first = 1 + list(self.runner.splits).index(self.split) * len(prompts)
            ids += [self.submit([first + j] * p, SamplingParams(max_tokens=1), request_id=next(names))
                    for j, p in enumerate(prompts)]
        super()._serve_warm_up(ids, names)

    # -- a step on the two lanes

    def step(self) -> list[int]:
        """The Engine's step on the whole GPU, else a step on the split's two lanes; with
        the requests that finished while the split last changed."""
        ended, self.ended_while_switching = self.ended_while_switching, []
        return ended + (super().step() if self.split is None else self._step_lanes())

    def _step_lanes(self) -> list[int]:
        """A step on the split: each lane keeps a step on the device. Only while both have
        work are they split: the decodes step on the whole GPU's graphs while no prompt is
        in flight, and prompts prefill on the whole GPU while nothing decodes (a lane apart
        from the other has nothing to gain from fewer SMs). Both batches are scheduled
        first, then the decode step is launched before the chunk: a call in a launch that
        waits for the whole device (the driver allocating memory, loading a module) then
        waits for a decode step, never for a chunk just launched. The host waits on the
        prefill lane only when there is nothing to decode. The lanes leave each other's
        sequences alone (busy)."""
        idle = self.in_flight is None and self.prefill_in_flight is None   # nothing will land that frees room
        finished, batches, launched = [], [], None
        try:
            finished += self._take_landed_chunk()
            prompts = self.scheduler.schedule(decodes=False, busy=sequences_of(self.in_flight)) \
                if self.prefill_in_flight is None else Batch()
            decodes = self.scheduler.schedule(prompts=False,
                                              busy=sequences_of(self.prefill_in_flight) | set(prompts.seqs))
            batches = [prompts, decodes]
            # the decode step the chunk waits for: it may write blocks freed since
            written_by = self.in_flight
            launched = self._launch_decodes(decodes, prompts) if decodes.seqs else None
            if prompts.seqs:
                self._launch_prompts(prompts, written_by)
            finished += self._finish(self.in_flight) if self.in_flight else []
            self.in_flight = launched
        except Exception as e:  # noqa: BLE001 (the requests end with it; nothing else is lost)
            return self._fail_step(batches, e, launched)
        if self.in_flight is None and self.prefill_in_flight is not None:   # nothing to decode meanwhile
            self.prefill_in_flight.output.wait()
        ended = [r.request_id for r in finished]
        if idle and sum(len(b.seqs) for b in batches) == 0:
            ended += self._end_unschedulable()
        return ended

    def _take_landed_chunk(self) -> list[Request]:
        """The prefill lane's chunk, if its tokens have landed: taken (and timed); the
        requests it finished."""
        step = self.prefill_in_flight
        if step is None or not step.output.done():
            return []
        self.prefill_in_flight = None
        self.prefill_lane_steps.append(PrefillLaneStep(step.shape, step.lane.split,
                                                       (time.perf_counter() - step.launched_at) * 1e3))
        return self._finish(step)

    def _launch_decodes(self, decodes: Batch, prompts: Batch) -> LaunchedStep:
        """The decode lane's next step (on the whole GPU while no prompt is in flight or
        launched beside it). After an abort of a sequence the prefill lane computes it
        waits for that lane's step on the device (the blocks it freed)."""
        _, decode_lane = self.runner.splits[self.split]
        lane = decode_lane if self.prefill_in_flight is not None or prompts.seqs else self.runner.full_gpu
        if self.decode_waits_for_prefill:
            wait_for(lane, self.prefill_in_flight)
            self.decode_waits_for_prefill = False
        return self._launch(decodes, lane, self.in_flight)

    def _launch_prompts(self, prompts: Batch, written_by: LaunchedStep | None) -> None:
        """The prefill lane's next chunk (on the whole GPU, eagerly, while nothing decodes).
        The decode step in flight (written_by) may still write blocks the host has freed (a
        sequence that just stopped): the chunk waits for it on the device before it starts."""
        prefill_lane, _ = self.runner.splits[self.split]
        lane = prefill_lane if self._decoding() else self.runner.full_gpu_eager
        wait_for(lane, written_by)
        self.prefill_in_flight = self._launch(prompts, lane, None)

    def _decoding(self) -> bool:
        """Whether a decode step is in flight or a running sequence is past its prompt."""
        return self.in_flight is not None or any(s.num_computed >= s.num_prompt_tokens
                                                 for s in self.scheduler.running)

    def _launch(self, batch: Batch, lane: Lane, previous: LaunchedStep | None) -> LaunchedStep:
        """The Engine's launch; a step that reads the tokens of a step on another stream
        (previous) waits for it there."""
        if previous is not None and previous.lane is not lane:
            wait_for(lane, previous)
            if previous.output.tokens is not None and previous.output.tokens.is_cuda:
                previous.output.tokens.record_stream(lane.stream or torch.cuda.current_stream())
        return super()._launch(batch, lane, previous)

    # -- requests that end early

    def abort(self, request_ids: list[int]) -> None:
        """The Engine's abort; on a split, the decode lane's step in flight stays (the
        prefill lane's next chunk waits for it), and an abort of a sequence the prefill lane
        computes makes the decode lane's next step wait for that chunk."""
        prefilling = sequences_of(self.prefill_in_flight)
        aborted = [self.requests[r] for r in request_ids if r in self.requests]
        self.decode_waits_for_prefill |= any(s in prefilling for req in aborted for s in req.seqs)
        decode_step = self.in_flight
        self.ended_while_switching = [r for r in self.ended_while_switching if r not in request_ids]
        super().abort(request_ids)
        if self.split is not None:
            self.in_flight = decode_step

    def _fail_step(self, batches: list[Batch], error: Exception, *launched: LaunchedStep | None) -> list[int]:
        prefill, self.prefill_in_flight = self.prefill_in_flight, None
        return super()._fail_step(batches, error, prefill, *launched)
