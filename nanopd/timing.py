"""Timing model steps of chosen shapes on an idle engine: the raw measurements the profiler
fits (profiler.py, through a worker's Measure message) and the micro-benchmarks report
(tools/microbench.py). A fake batch is a set of sequences with random token ids whose context
is "already in the cache" (its contents do not matter for timing), so any shape of step
can be run without serving real requests.
"""

import itertools
import statistics
import time
from typing import Self

import torch

from nanopd.request import Request, RequestMetrics, SamplingParams, Sequence
from nanopd.runner import StepOutput
from nanopd.sampler import Draw
from nanopd.scheduler import Batch

GREEDY = SamplingParams(temperature=0.0)   # greedy, whatever SamplingParams' defaults are


def fake_batch(engine, batch_size: int, context: int, num_new: int) -> Batch:
    """batch_size sequences with `context` tokens already in the cache (random ids; the KV
    contents do not matter for timing) and num_new tokens to compute."""
    req = Request(-1, None, [], GREEDY, RequestMetrics(0.0))
    seqs = []
    for _ in range(batch_size):
        ids = torch.randint(0, engine.model.config.vocab_size, (context + num_new,)).tolist()
        seq = Sequence(req, 0, ids, len(ids))
        room = engine.scheduler.allocate(ids)
        if room is None:
            raise ValueError(f"a fake batch of {batch_size} x {context + num_new} tokens does not fit in "
                             "the KV cache")
        seq.block_table, _ = room
        seq.num_computed = context
        seqs.append(seq)
    return Batch(seqs, [num_new] * batch_size)


def free_batch(engine, batch: Batch) -> None:
    for seq in batch.seqs:
        engine.scheduler.free(seq.block_table)


def run_step(engine, batch: Batch, params: SamplingParams = GREEDY, lane=None) -> StepOutput:
    """One model step on the batch, a token sampled with params for every sequence (its
    penalties, if any, reading the sequence's own token counts); on lane (runner.Lane: a
    split's prefill or decode lane; None: the whole GPU). Its output: on a GPU, its ready
    event ends the step on the lane's stream."""
    return engine.runner.run(batch, [Draw(i, params, None, seq) for i, seq in enumerate(batch.seqs)],
                             lane=lane)


def lane_sync(engine, lane=None):
    """A function waiting for lane's work (the whole device's for None; nothing on a CPU)."""
    if engine.model.device.type != "cuda":
        return lambda: None
    return lane.stream.synchronize if lane is not None and lane.stream is not None else torch.cuda.synchronize


def time_step_ms(engine, batch: Batch, reps: int = 10, params: SamplingParams = GREEDY, lane=None) -> float:
    """Median wall time of one model step (ModelRunner.run: inputs, graph replay or eager
    forward, logits, sampling), synchronised (with lane's stream only, if given: the other
    lane may be busy meanwhile)."""
    sync = lane_sync(engine, lane)
    times = []
    for i in range(reps + 2):
        sync()
        t = time.perf_counter()
        run_step(engine, batch, params, lane)
        sync()
        if i >= 2:
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def paced_step_ms(engine, batch: Batch, reps: int = 10, lane=None, between=lambda: None) -> float:
    """Median time of one model step as the engine paces them: back to back, each launched
    while the one before runs (Engine.step), timed on the GPU between the events that end
    consecutive steps, as a serving worker times its steps (workers.py:Worker._time_step);
    the first two are warm-ups. Synchronised (time_step_ms), a step also counts the host's
    launch and the wait for its end, which a serving engine hides behind the step before: a
    larger share of a short step than of a long one, so a profile timed so had the wrong
    shape, not only the wrong level. between() runs before each launch (BusyLane.top_up).
    On a CPU, whose steps run as they are called, the wall time of each."""
    if engine.model.device.type != "cuda":
        return time_step_ms(engine, batch, reps, lane=lane)
    sync = lane_sync(engine, lane)
    sync()
    ends = []
    for _ in range(reps + 2):
        between()
        ends.append(run_step(engine, batch, lane=lane).ready)
    sync()
    return statistics.median(a.elapsed_time(b) for a, b in itertools.pairwise(ends[1:]))


def measure_engine(engine, lengths: list[int], batches: list[int], chunks: list[int], context: int,
                   gamma_batch: int, long_context: int, kv_batches: list[int], reps: int = 5) -> dict:
    """Raw timings on an idle engine, each step paced as the engine runs them (paced_step_ms):
    prefill per length, decode step per batch size (at
    context and, for kv_batches, at long_context), and a decode batch of gamma_batch alone
    and with each chunk of prefill. Sizes beyond the engine's max_num_batched_tokens or seat limit
    are left out (it sized its memory for those)."""
    most, seats = engine.cfg.max_num_batched_tokens, engine.cfg.max_num_seqs   # a step's tokens, at most
    lengths = [n for n in lengths if n <= most] or [most // 2, most]
    batches = [b for b in batches if b <= seats] or [1, seats]
    chunks = [c for c in chunks if gamma_batch + c <= most] or [max(1, (most - gamma_batch) // 2)]

    def timed(make) -> float:
        batch = make()
        try:
            return paced_step_ms(engine, batch, reps)
        finally:
            free_batch(engine, batch)

    def with_chunk(c: int) -> Batch:
        dec, chunk = fake_batch(engine, gamma_batch, context, 1), fake_batch(engine, 1, 0, c)
        return Batch(dec.seqs + chunk.seqs, dec.num_new + chunk.num_new)
    prefill = [timed(lambda n=n: fake_batch(engine, 1, 0, n)) for n in lengths]
    decode = [timed(lambda b=b: fake_batch(engine, b, context, 1)) for b in batches]
    kv_batches = [b for b in kv_batches if b in batches]
    long = [timed(lambda b=b: fake_batch(engine, b, long_context, 1)) for b in kv_batches]
    alone = timed(lambda: fake_batch(engine, gamma_batch, context, 1))
    mixed = [timed(lambda c=c: with_chunk(c)) for c in chunks]
    out = {"lengths": lengths, "prefill_ms": prefill, "batches": batches, "decode_ms": decode,
           "context": context, "kv_batches": kv_batches, "long_context": long_context, "long_decode_ms": long,
           "chunks": chunks, "extra_ms": [m - alone for m in mixed]}
    splits = engine.runner.splits.values() if "sm_split" in engine.features else ()
    if any(decode.stream is not None for _, decode in splits):
        out["splits"] = measure_splits(engine, lengths, batches, context, gamma_batch, reps)
    return out


def measure_splits(engine, lengths: list[int], batches: list[int], context: int, beside_batch: int,
                   reps: int) -> dict[str, dict]:
    """Per split of the engine's menu ("P/D"): prefill per length on the prefill lane while
    the decode lane runs beside_batch steps, and decode steps per batch size on the decode
    lane while the prefill lane runs chunks of the longest length (the lanes share the
    memory bandwidth: each is measured with the other busy)."""
    out = {}
    for split, lanes in engine.runner.splits.items():
        beside, pre = fake_batch(engine, beside_batch, context, 1), fake_batch(engine, 1, 0, max(lengths))
        try:
            prefill = []
            for n in lengths:
                chunk = fake_batch(engine, 1, 0, n)
                prefill.append(statistics.median(prefill_beside_decode_ms(engine, lanes, beside, chunk)
                                                 for _ in range(2)))
                free_batch(engine, chunk)
            decode = []
            with BusyLane(engine, lanes[0], pre) as busy:   # its chunks end before pre's blocks are freed
                for b in batches:
                    dec = fake_batch(engine, b, context, 1)
                    decode.append(decode_beside_prefill_ms(engine, lanes[1], dec, busy, reps))
                    free_batch(engine, dec)   # its steps have ended (the decode lane was synchronised)
        finally:
            free_batch(engine, beside)
            free_batch(engine, pre)
        out[f"{split.prefill_sms}/{split.decode_sms}"] = {"prefill_ms": prefill, "decode_ms": decode}
    return out


# -- a split worker's lanes (smsplit.py): each alone, and beside the other lane busy


class BusyLane:
    """A split's prefill lane kept running chunks of pre while the decode lane is timed
    beside it: one chunk always queued behind the one running (top_up, called more often
    than a chunk lasts); as a context, leaving it waits for them. One BusyLane spans every batch a
    profile times beside it: a long prompt's chunk on part of the GPU lasts many decode
    steps, and waiting for the chunks after each batch size took most of a profile's time."""

    def __init__(self, engine, prefill_lane, pre: Batch):
        self.engine, self.lane, self.pre = engine, prefill_lane, pre
        self.ends: list[torch.cuda.Event] = []   # the chunks queued, in order

    def __enter__(self) -> Self:
        self.top_up()
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.synchronize()   # every chunk queued has ended

    def top_up(self) -> None:
        self.ends = [e for e in self.ends if not e.query()]
        while len(self.ends) < 2:
            self.ends.append(run_step(self.engine, self.pre, lane=self.lane).ready)


def decode_beside_prefill_ms(engine, decode_lane, dec: Batch, busy: BusyLane, reps: int) -> float:
    """Median decode step of dec on the decode lane, paced as the engine runs them
    (paced_step_ms), while busy keeps the prefill lane running chunks."""
    return paced_step_ms(engine, dec, reps, lane=decode_lane, between=busy.top_up)


def prefill_beside_decode_ms(engine, lanes, dec: Batch, pre: Batch) -> float:
    """A chunk of pre on the prefill lane while the decode lane runs steps of dec back to
    back, timed as a split worker times its chunks (lanes.py:PrefillLaneStep, what the
    router refits the lane on): from its launch until the host, between two decode steps,
    sees it done. The lane's next chunk could start no sooner."""
    prefill_lane, decode_lane = lanes
    sync, end = lane_sync(engine, decode_lane), torch.cuda.Event()
    torch.cuda.synchronize()
    t = time.perf_counter()
    run_step(engine, pre, lane=prefill_lane)
    end.record(prefill_lane.stream)
    while not end.query():
        run_step(engine, dec, lane=decode_lane)
        sync()
    ms = (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    return ms

