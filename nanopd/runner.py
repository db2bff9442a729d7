"""The model runner: one device's model and KV cache; the device half of every step.

ModelRunner.run builds the step's tensors (token ids, positions, slot mapping, block
tables, lengths), uploads them in one copy, runs the model, samples on the device
(sampler.py) and starts copying the tokens (and logprobs) to the host; the engine gets
back a StepOutput whose event says when they have arrived. CUDA graphs captured at
start-up replace the hundreds of kernel launches of a step, which cost the host more time
than a small step takes on the GPU:
  - pure-decode steps replay a graph of the whole model for a padded batch size;
  - steps with prefill tokens, up to 1024 tokens (PIECE_TOKENS), replay graphs of the pieces
    between attentions (CausalLM.piece) for a padded token count, and launch each layer's
    attention themselves, since its grid depends on the batch's sequences ("piecewise"
    graphs, as vLLM does); bigger steps keep the GPU busy long enough to run eagerly.
A token the host has not received yet (PENDING, see engine.py) is read on the device from
the previous step's sampled tokens.
"""

import contextlib
import gc
import itertools
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from nanopd import gpu_kernels as kernels
from nanopd.config import EngineConfig
from nanopd.kv_cache import allocate_kv_cache, blocks_for_memory, cdiv, kv_bytes_per_block
from nanopd.model import AttentionMetadata, CausalLM
from nanopd.request import SamplingParams
from nanopd.sampler import Draw, TokenCounts, adjust_logits, sample, token_logprobs
from nanopd.scheduler import Batch

# Token counts of the piecewise graphs: a step is padded to the next one. Below ~128 tokens
# a step's time hardly depends on its size (it reads every weight once); from there the
# GEMMs turn from reading their weights to computing (a 4096 x 24576 product at 256 rows
# takes about as long to compute as to read), so padding costs time and the sizes are finer.
PIECE_TOKENS = [8, 16, 32, 64, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024]

# ----------------------------------------------------------------------------- model runner

# The struct codes of the dtypes uploaded from flat lists (pack, host_tensor).
STRUCT_CODES = {torch.int32: "i", torch.int64: "q", torch.float32: "f"}


def pack(data: list, code: str = "i") -> bytes:
    """A flat list of numbers as the bytes of a C array of them (code: struct's, "i" int32).
    struct's C loop converts faster than array.array's and several times faster than
    torch.tensor's: a decode step's block tables are tens of thousands of ints."""
    return struct.pack(f"{len(data)}{code}", *data)


def host_tensor(data: list, dtype: torch.dtype) -> torch.Tensor:
    """A host list as a CPU tensor: a flat one through pack, anything else torch.tensor."""
    code = STRUCT_CODES.get(dtype)
    if code is None or not data or isinstance(data[0], (list, tuple)):
        return torch.tensor(data, dtype=dtype)
    return torch.frombuffer(bytearray(pack(data, code)), dtype=dtype)


class PinnedRing:
    """Pinned host buffers used in turn for asynchronous host <-> device copies.

    Allocating pinned memory, as torch does for every pin_memory=True tensor or
    non-blocking copy to the host, synchronizes with the device, and that would stall the
    overlap of steps. A few reused buffers never allocate. A buffer is reused only after
    its last copy has finished, and 32 copies later: a step makes at most nine (tokens,
    four of logprobs, four of prompt logprobs), and the host reads a step's downloads
    within two steps of its lane (each lane has rings of its own, Lane). The buffers are
    allocated up front, the uploads' for the largest step (ModelRunner.largest_upload_bytes);
    one grows only if a copy is bigger still."""

    def __init__(self, slots: int = 32, initial_bytes: int = 1 << 16):
        self.buffers = [torch.empty(initial_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(slots)]
        self.copied: list[torch.cuda.Event | None] = [None] * slots
        self.next = 0

    def _take(self, like: torch.Tensor) -> tuple[int, torch.Tensor]:
        i, self.next = self.next, (self.next + 1) % len(self.buffers)
        if self.copied[i] is not None:
            self.copied[i].synchronize()
        if self.buffers[i].numel() < like.nbytes:
            self.buffers[i] = torch.empty(2 * like.nbytes, dtype=torch.uint8, pin_memory=True)
        return i, self.buffers[i][:like.nbytes].view(like.dtype).view(like.shape)

    def _record(self, i: int) -> None:
        self.copied[i] = torch.cuda.Event()
        self.copied[i].record()

    def to_device(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        i, pinned = self._take(t)
        pinned.copy_(t)
        out = torch.empty_like(t, device=device).copy_(pinned, non_blocking=True)
        self._record(i)
        return out

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        i, pinned = self._take(t)
        pinned.copy_(t, non_blocking=True)
        self._record(i)
        return pinned


@dataclass
class PromptScore:
    """Prompt logprobs a step computes (prompt_logprobs): the new tokens of batch row `row`
    from index `first` of its chunk on, one per target, each scored against the prompt
    token after it (targets), with its k most likely alternatives."""
    row: int                            # index into Batch.seqs
    first: int
    targets: list[int]
    k: int


@dataclass
class Lane:
    """Where a step runs: a stream (None: the current one) and the decode graphs captured on
    it. The whole GPU's lane also has the piece graphs for mixed steps. (A feature's runner
    may have lanes of part of the GPU each.)"""
    stream: torch.cuda.Stream | None = None
    # batch -> graph
    graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = field(default_factory=dict)
    sizes: list[int] = field(default_factory=list)   # sorted(graphs)
    pieces: bool = False
    # Pinned buffers, up and down (CUDA), one pair per stream: a copy never waits for the
    # step of another stream to end (a prompt chunk's tokens land only after the whole chunk).
    uploads: PinnedRing | None = None
    downloads: PinnedRing | None = None
    # id(block table) -> (a copy of it, its bytes): the tables of its last step (pack_tables)
    packed: dict[int, tuple[list[int], bytes]] = field(default_factory=dict)

    @contextlib.contextmanager
    def running(self):
        """Launch (or capture) on this lane: its stream."""
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            yield

    def pack_tables(self, tables: list[list[int]]) -> bytes:
        """The block tables as the bytes of one int32 array [len(tables), width], each padded
        with zeros to the longest. A decode's table gains a block only once in block_size
        steps, so each table's bytes are kept from the step before and reused while the table
        still equals the copy kept beside them (in packed, by the list's id): comparing
        two lists is a C loop over pointers, and packing 256 tables of 64 ints anew every step
        was most of prepare's time."""
        width = max(map(len, tables))
        kept, fresh = self.packed, {}
        rows = []
        for t in tables:   # a table may come twice (a row a token ahead): kept or just packed
            copy, packed = fresh.get(id(t)) or kept.get(id(t)) or (None, b"")
            if copy != t:
                copy, packed = list(t), pack(t)
            fresh[id(t)] = copy, packed
            rows += (packed, bytes(4 * (width - len(t))))
        self.packed = fresh
        return b"".join(rows)


@dataclass
class StepOutput:
    """What a step hands the engine: its sampled tokens, copying to the host."""
    tokens: torch.Tensor | None = None   # [draws] on the device: the next step's PENDING ids come from here
    host: list[torch.Tensor] = field(default_factory=list)   # tokens, then logprobs (see collect)
    logprob_draws: list[int] = field(default_factory=list)    # draws that report logprobs
    prompt_host: list[torch.Tensor] = field(default_factory=list)   # prompt logprobs (see scored)
    ready: torch.cuda.Event | None = None   # the host copies have landed
    more: torch.Tensor | None = None        # on the host: what run's `after` sent home

    def done(self) -> bool:
        """Whether the copies have landed (collect would not wait)."""
        return self.ready is None or self.ready.query()

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()

    def collect(self) -> tuple[list[int], dict[int, tuple[float, list[float], list[int]]]]:
        """Wait for the copies: the sampled tokens, and per logprob draw (the token's logprob,
        the top logprobs, their token ids)."""
        if self.ready is not None:
            self.ready.synchronize()
        tokens, *logprobs = [t.tolist() for t in self.host] or [[]]
        return tokens, dict(zip(self.logprob_draws, zip(*logprobs)))

    def scored(self) -> list[tuple[float, int, list[float], list[int]]]:
        """Wait for the copies: per prompt position scored (the run's PromptScores' targets,
        in order), as collect's logprobs."""
        self.wait()
        return list(zip(*[t.tolist() for t in self.prompt_host]))


class ModelRunner:
    """Owns the model and its KV cache; turns a Batch into sampled tokens."""

    def __init__(self, model: CausalLM, cfg: EngineConfig):
        self.model, self.cfg, self.device = model, cfg, model.device
        if self.device.type == "cuda":   # the streams, graphs and memory queries below mean this device
            torch.cuda.set_device(self.device)
        self.max_blocks_per_seq = cdiv(cfg.max_model_len, cfg.block_size)
        try:
            self.num_blocks = self._check_fits(cfg.num_kv_blocks or self._blocks_that_fit())
            self.caches = self._allocate_caches()
            self.kv_cache = self.caches[0]
            self._set_up_steps()
        except torch.OutOfMemoryError as e:
            raise ValueError(f"these engine settings need more memory than {self.device} has "
                             f"({str(e).splitlines()[0]}): lower max_num_seqs, max_num_batched_tokens or "
                             "num_kv_blocks, or raise gpu_memory_utilization") from None

    def _allocate_caches(self) -> list[torch.Tensor]:
        """The KV caches, all under the same block ids: the model's (here the only one)."""
        m, cfg = self.model, self.cfg
        return [allocate_kv_cache(self.num_blocks, m.num_layers, m.num_kv_heads, cfg.block_size, m.head_dim,
                                  m.dtype, self.device)]

    def _set_up_steps(self) -> None:
        """The pinned buffers, the penalties' token counts and (unless enforce_eager) the
        CUDA graphs of the steps."""
        self.token_counts = TokenCounts(self.model.config.vocab_size, self.device)
        self.full_gpu = Lane(pieces=True)   # the whole GPU, on the current stream
        self.piece_graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}   # mixed: tokens -> one per piece
        self.piece_sizes: list[int] = []
        self.lane = self.full_gpu   # the lane of the step being launched (run): its buffers are used
        if self.device.type == "cuda":
            largest = self.largest_upload_bytes()
            for lane in self.lanes():
                lane.uploads, lane.downloads = PinnedRing(initial_bytes=largest), PinnedRing()
        if self.device.type == "cuda" and not self.cfg.enforce_eager:
            self._capture_all_graphs()

    def lanes(self) -> list[Lane]:
        """The lanes that launch on streams of their own, each with its own pinned buffers:
        here the whole GPU's."""
        return [self.full_gpu]

    def largest_upload_bytes(self) -> int:
        """What the biggest step uploads at most (prepare's one copy: ids, positions, slots,
        query and context starts, copy pairs and fills for every token and sequence, and a
        block table of max_model_len for each sequence), so that a lane's buffers never grow
        while it serves: growing one allocates pinned memory, which waits for every stream,
        a split's decode step then for the prompt chunk beside it."""
        tokens, seqs = self.cfg.max_num_batched_tokens, self.cfg.max_num_seqs
        return 4 * (6 * (tokens + seqs + 1) + seqs * self.max_blocks_per_seq)

    def upload(self, data: list, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        """A host list as a tensor on the device, without waiting for the device (see PinnedRing)."""
        return self._to_device(host_tensor(data, dtype))

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return self.lane.uploads.to_device(t, self.device) if self.device.type == "cuda" else t

    def _upload_many(self, *parts: list[int] | bytes) -> list[torch.Tensor]:
        """Integer lists, or their bytes (pack), -> int32 tensors on the device, all in one copy."""
        chunks = [p if isinstance(p, bytes) else pack(p) for p in parts]
        t = self._to_device(torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.int32))
        return list(t.split([len(c) // 4 for c in chunks]))


    def prepare(self, batch: Batch, prev_tokens: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Token ids, positions [num_tokens] and the attention metadata, on the device.
        A PENDING token id is taken, on the device, from prev_tokens (the sampled tokens of
        the step still running), so the host never waits for it."""
        ids, positions, slots, tables, q_lens, ctx, fills = [], [], [], [], [], [], []
        bs, ahead = self.cfg.block_size, batch.ahead
        for seq, n in zip(batch.seqs, batch.num_new):
            start, last = seq.num_computed, len(seq.token_ids) - 1
            if seq.pending_row is not None and start <= last < start + n:
                fills += (len(ids) + last - start, seq.pending_row)
            if n == 1:   # a decode, most rows of most steps: no slices to build
                ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(seq.block_table[start // bs] * bs + start % bs)
            else:
                ids += (seq.token_ids[start:] + ahead[seq])[:n] if seq in ahead else \
                    seq.token_ids[start:start + n]
                positions += range(start, start + n)
                slots += [seq.block_table[p // bs] * bs + p % bs for p in range(start, start + n)]
            if ahead and seq in ahead:   # a row a token, each attending up to its own position
                tables += [seq.block_table] * n
                q_lens += [1] * n
                ctx += range(start, start + n)
            else:
                tables.append(seq.block_table)
                q_lens.append(n)
                ctx.append(start)
        cu = list(itertools.accumulate(q_lens, initial=0))
        ids, positions, slots, cu, ctx, flat_tables, fills = self._upload_many(
            ids, positions, slots, cu, ctx, self.lane.pack_tables(tables), fills)
        if len(fills):
            dst, src = fills.view(-1, 2).unbind(1)
            ids[dst] = prev_tokens[src].to(ids.dtype)
        num_decodes = next((i for i, n in enumerate(q_lens) if n > 1), len(q_lens))
        max_kv_len = max(s.num_computed + n for s, n in zip(batch.seqs, batch.num_new))
        meta = AttentionMetadata(
            slot_mapping=slots, block_tables=flat_tables.view(len(tables), -1), cu_q_lens=cu, ctx_lens=ctx,
            max_q_len=max(q_lens), num_decodes=num_decodes,
            num_splits=kernels.choose_num_splits(num_decodes, self.model.num_kv_heads, 1, max_kv_len,
                                                 self.device))
        return ids, positions, meta

    @torch.inference_mode()
    def run(self, batch: Batch, draws: list[Draw], prev_tokens: torch.Tensor | None = None,
            lane: Lane | None = None, scores: list[PromptScore] = (),
            after: Callable[[StepOutput], None] | None = None) -> StepOutput:
        """Run the model on the batch and sample: a token per draw; the prompt logprobs of
        scores. prev_tokens: the running step's sampled tokens (see prepare). lane: where
        (the whole GPU unless a split's lane); everything the step allocates is that
        stream's. after: more work on the step's output, launched before its copies are
        marked landed (it may send a tensor home in out.more)."""
        self.lane = lane = lane or self.full_gpu
        with lane.running():
            out = self._run(batch, draws, prev_tokens, lane, scores)
            if after is not None:
                after(out)
            if self.device.type == "cuda":
                out.ready = torch.cuda.Event(enable_timing=True)   # timing: workers.py times steps by it
                out.ready.record()
            return out

    def _run(self, batch: Batch, draws: list[Draw], prev_tokens: torch.Tensor | None, lane: Lane,
             scores: list[PromptScore]) -> StepOutput:
        hidden = self._forward(batch, prev_tokens, lane)   # launched: the host's work below overlaps it
        # (row, position): the logits computed are those of the tokens sampled after and of
        # the prompt positions scored, only (a prompt chunk's others are never needed)
        scored = [(s.row, s.first + i) for s in scores for i in range(len(s.targets))]
        wanted = sorted({(d.row, d.position) for d in draws} | set(scored))
        # [len(wanted), vocab]
        logits = self.model.compute_logits(self._hidden_of(batch, hidden, wanted))
        at = {w: i for i, w in enumerate(wanted)}
        out = StepOutput()
        if scores:
            self._score_prompts(logits, [at[w] for w in scored], scores, out)
        if draws:
            self._sample(logits, [at[d.row, d.position] for d in draws], draws, out, prev_tokens)
        return out

    def _sample(self, logits: torch.Tensor, src: list[int], draws: list[Draw], out: StepOutput,
                prev_tokens: torch.Tensor | None) -> None:
        """Sample draw k from logits row src[k] (after its penalties and bans); logprobs,
        of the model's own logits, where asked; start the copies home."""
        row_logits = logits if src == list(range(len(logits))) else logits[self.upload(src)]
        x, counted = adjust_logits(row_logits, draws, prev_tokens, self.upload, self.token_counts)
        out.tokens = sample(x, [d.params for d in draws], [d.generator for d in draws], self.upload,
                            [(k, d.noise_of) for k, d in enumerate(draws) if d.noise_of >= 0])
        if counted is not None:   # the penalised sequences' own new tokens join their counts
            self.token_counts.count(counted[1], out.tokens[counted[0]])
        host = [out.tokens]
        out.logprob_draws = [k for k, d in enumerate(draws) if d.params.logprobs is not None]
        if out.logprob_draws:
            want = self.upload(out.logprob_draws, torch.int64)
            k = max(draws[i].params.logprobs for i in out.logprob_draws)
            host += token_logprobs(row_logits[want], out.tokens[want], k)
        out.host = [self.to_host(t) for t in host]

    def _score_prompts(self, logits: torch.Tensor, src: list[int], scores: list[PromptScore],
                       out: StepOutput) -> None:
        """Prompt logprobs: logits row src[i] scored against the i-th target of scores, as a
        draw's logprobs (token_logprobs, of the model's own logits); start the copies home."""
        rows, targets = self._upload_many(src, [t for s in scores for t in s.targets])
        values = token_logprobs(logits[rows.long()], targets.long(), max(s.k for s in scores))
        out.prompt_host = [self.to_host(t) for t in values]

    def _forward(self, batch: Batch, prev_tokens: torch.Tensor | None, lane: Lane) -> torch.Tensor:
        """Hidden states [tokens, hidden] after the batch's new tokens (a decode graph's: after
        each row's, the tokens ahead included)."""
        self.copy_blocks(batch.copies)
        num_tokens = sum(batch.num_new)
        one_token_rows = max(batch.num_new) == 1 or all(n == 1 or s in batch.ahead
                                                        for s, n in zip(batch.seqs, batch.num_new))
        graph_bs = next((b for b in lane.sizes if b >= num_tokens), None)
        # decodes, and the tokens ahead of them (Batch.ahead): a token a row
        if graph_bs is not None and one_token_rows:
            return self._replay(batch, lane.graphs[graph_bs], prev_tokens)
        ids, positions, meta = self.prepare(batch, prev_tokens)
        padded = next((t for t in self.piece_sizes if t >= num_tokens), None) if lane.pieces else None
        if padded is None:
            return self.model(ids, positions, self.kv_cache, meta)
        return self._replay_pieces(ids, positions, meta, padded)

    def _hidden_of(self, batch: Batch, hidden: torch.Tensor, wanted: list[tuple[int, int]]) -> torch.Tensor:
        """The rows of hidden [tokens, hidden] after the new tokens wanted: (row, position),
        the position-th new token of batch.seqs[row] (-1: its last). A decode step wants
        every row: hidden itself, no gather."""
        starts = list(itertools.accumulate(batch.num_new, initial=0))
        tokens = [starts[r] + (batch.num_new[r] - 1 if p < 0 else p) for r, p in wanted]
        if tokens == list(range(len(hidden))):
            return hidden
        return hidden[self.upload(tokens)]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: block src to dst for each pair (src, dst), in every cache; a step's
        before its model runs."""
        if not copies:
            return
        pairs = self.upload([b for pair in copies for b in pair]).view(-1, 2)
        for cache in self.caches:
            kernels.copy_blocks(cache, pairs)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """Start copying t to the host; the result is valid once the device reaches this point."""
        return self.lane.downloads.to_host(t) if t.is_cuda else t

    # -- CUDA graphs, all in one memory pool: decode steps whole, mixed steps piecewise

    def _capture_all_graphs(self) -> None:
        """Decode graphs at batch sizes 1, 2, 4, 8, then every 16 up to 256 and every 64
        beyond; piece graphs at PIECE_TOKENS, capped at max_num_batched_tokens. The model body
        only: logits are computed afterwards, for the rows needed."""
        max_bs = self.cfg.max_num_seqs
        sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(320, max_bs + 64, 64))
        sizes = [b for b in sizes if b < max_bs] + [max_bs]
        pieces = sorted({min(t, self.cfg.max_num_batched_tokens) for t in PIECE_TOKENS})
        m, dev, n = self.model, self.device, max(sizes + pieces)
        self.static = {   # the graphs' inputs and the tensors passed between pieces
            "ids": torch.zeros(n, dtype=torch.long, device=dev),
            "pos": torch.zeros(n, dtype=torch.long, device=dev),
            "slots": torch.full((n,), -1, dtype=torch.int32, device=dev),
            "tables": torch.zeros(n, self.max_blocks_per_seq, dtype=torch.int32, device=dev),
            "cu": torch.arange(n + 1, dtype=torch.int32, device=dev),
            "ctx": torch.zeros(n, dtype=torch.int32, device=dev),
            "qkv": torch.zeros(n, m.config.num_attention_heads + 2 * m.num_kv_heads, m.head_dim,
                               dtype=m.dtype, device=dev),
            "o": torch.zeros(n, m.config.num_attention_heads, m.head_dim, dtype=m.dtype, device=dev),
            "residual": torch.zeros(n, m.config.hidden_size, dtype=m.dtype, device=dev),
            "hidden": torch.zeros(n, m.config.hidden_size, dtype=m.dtype, device=dev)}
        # Warm up and capture on one side stream, with the garbage collector off: a
        # collection mid-capture can free CUDA objects (events of pinned buffers, old
        # graphs), which invalidates the capture.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        gc.collect()
        gc.disable()
        try:
            with torch.cuda.stream(stream):
                self._compile_split_variants()
                pool = self._capture_decode_graphs(sizes, None, stream, self.full_gpu)
                pool = self._capture_piece_graphs(pieces, pool, stream)
            self._capture_lane_graphs(pool)
        finally:
            gc.enable()
        torch.cuda.current_stream().wait_stream(stream)
        self.piece_sizes = sorted(self.piece_graphs)
        torch.cuda.synchronize()

    def _capture_lane_graphs(self, pool) -> None:
        """The graphs of lanes beside the whole GPU's, in pool (none here)."""


    def _compile_split_variants(self) -> None:
        """Run the model once at batch 1 with every split-K factor a step may choose (powers
        of two, see kernels.choose_num_splits), so that none compiles mid-run: mixed steps
        launch their decodes' attention outside any graph, with the factor of the moment."""
        st, most = self.static, kernels.choose_num_splits(1, self.model.num_kv_heads, 1,
                                                           self.cfg.max_model_len, self.device)
        for splits in (1 << i for i in range(most.bit_length())):
            meta = AttentionMetadata(slot_mapping=st["slots"][:1], block_tables=st["tables"][:1],
                                     cu_q_lens=st["cu"][:2], ctx_lens=st["ctx"][:1], max_q_len=1,
                                     num_decodes=1, num_splits=splits)
            self.model(st["ids"][:1], st["pos"][:1], self.kv_cache, meta)

    def _capture_decode_graphs(self, sizes: list[int], pool, stream: torch.cuda.Stream, lane: Lane,
                               where: str = ""):
        """Decode graphs at these batch sizes into lane, all sharing pool; the pool."""
        st = self.static
        for bs in tqdm(sorted(sizes, reverse=True), desc=f"capturing decode CUDA graphs{where}", leave=False,
                       disable=None):
            meta = AttentionMetadata(
                slot_mapping=st["slots"][:bs], block_tables=st["tables"][:bs], cu_q_lens=st["cu"][:bs + 1],
                ctx_lens=st["ctx"][:bs], max_q_len=1, num_decodes=bs,
                num_splits=kernels.choose_num_splits(bs, self.model.num_kv_heads, 1, self.cfg.max_model_len,
                                                     self.device))
            graph, hidden = capture(
                lambda bs=bs, meta=meta: self.model(st["ids"][:bs], st["pos"][:bs], self.kv_cache, meta),
                pool, stream)
            pool = graph.pool()
            lane.graphs[bs] = (graph, hidden)
        lane.sizes = sorted(lane.graphs)
        return pool

    def _capture_piece_graphs(self, sizes: list[int], pool, stream: torch.cuda.Stream):
        """For each token count t, one graph per CausalLM.piece: it reads its input (token ids, or
        the attention output "o") and "residual" from the static buffers and writes its
        results back to them ("qkv" and "residual", or "hidden"), so every piece of every size
        shares those buffers and the pool holds only the biggest piece's temporaries."""
        st, m = self.static, self.model

        def piece(i: int, t: int) -> None:
            x = st["ids"][:t] if i == 0 else st["o"][:t]
            out, residual = m.piece(i, x, st["residual"][:t] if i else None, st["pos"][:t], self.kv_cache,
                                    st["slots"][:t])
            if residual is None:
                st["hidden"][:t].copy_(out)
            else:
                st["qkv"][:t].copy_(out)
                st["residual"][:t].copy_(residual)

        for t in tqdm(sorted(sizes, reverse=True), desc="capturing piecewise CUDA graphs", leave=False,
                      disable=None):
            graphs = []
            for i in range(m.num_layers + 1):
                graph, _ = capture(lambda i=i, t=t: piece(i, t), pool, stream)
                pool = graph.pool()
                graphs.append(graph)
            self.piece_graphs[t] = graphs
        return pool

    def _replay(self, batch: Batch, captured: tuple[torch.cuda.CUDAGraph, torch.Tensor],
                prev_tokens: torch.Tensor | None) -> torch.Tensor:
        """Copy the step's inputs into the graph's static buffers (padding the batch to the
        graph's size with sequences of no tokens and no cache writes), then replay it."""
        (graph, hidden), st = captured, self.static
        bs = len(hidden)
        ids, positions, meta = self.prepare(batch, prev_tokens)
        n = len(ids)   # rows: the tokens ahead of a sequence are rows of their own (Batch.ahead)
        width = meta.block_tables.shape[1]
        self._stage_tokens(ids, positions, meta.slot_mapping, bs)
        st["tables"][:n, :width].copy_(meta.block_tables)
        st["cu"][:n + 1].copy_(meta.cu_q_lens)
        st["cu"][n + 1:bs + 1].fill_(n)
        st["ctx"][:n].copy_(meta.ctx_lens)
        graph.replay()
        return hidden[:n]

    def _replay_pieces(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       padded: int) -> torch.Tensor:
        """A mixed step on the piece graphs of `padded` tokens: the padding tokens write no
        cache slots and no attention reads them; each layer's attention runs eagerly on the
        real tokens, into the next piece's input."""
        n = len(ids)
        self._stage_tokens(ids, positions, meta.slot_mapping, padded)
        # every layer's q, k, v land in the same buffer: its views, taken once a step
        (q, k, v), o = self.model.layers[0].self_attn.heads(self.static["qkv"][:n]), self.static["o"][:n]
        graphs = self.piece_graphs[padded]
        graphs[0].replay()
        for layer, graph in zip(self.model.layers, graphs[1:]):
            layer.self_attn.attend(q, k, v, self.kv_cache, meta, out=o)
            graph.replay()
        return self.static["hidden"][:n]

    def _stage_tokens(self, ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                      padded: int) -> None:
        """The step's tokens into the graphs' static inputs; padded - len(ids) padding
        tokens after them write no cache slot."""
        st, n = self.static, len(ids)
        st["ids"][:n].copy_(ids)
        st["pos"][:n].copy_(positions)
        st["slots"][:padded].fill_(-1)
        st["slots"][:n].copy_(slot_mapping)

    # -- KV cache sizing

    def _bytes_per_block(self) -> int:
        """A block's K/V in every cache (here the model's only)."""
        m = self.model
        return kv_bytes_per_block(m.num_layers, m.num_kv_heads, self.cfg.block_size, m.head_dim, m.dtype)

    def _check_fits(self, num_blocks: int) -> int:
        """num_blocks, or a ValueError naming num_kv_blocks if a cache that size cannot fit in
        the device's free memory (on a CPU, the machine's available memory)."""
        need, free = num_blocks * self._bytes_per_block(), free_memory(self.device)
        if free is not None and need > free:
            raise ValueError(f"num_kv_blocks={num_blocks} needs {need / 2**30:.1f} GiB of KV cache; "
                             f"{self.device} has {free / 2**30:.1f} GiB free")
        return num_blocks

    def _other_streams_reserve(self, peak: int, sampling: int) -> int:
        """The bytes the streams of other lanes keep for their biggest steps (none here): peak,
        a whole step's; sampling, the logits and sampling of every seat."""
        return 0

    def _blocks_that_fit(self) -> int:
        """On a GPU, the blocks that what gpu_memory_utilization leaves after the largest step
        holds; on a CPU, a fixed 256 MiB's (enough for tests and demos)."""
        cfg, per_block = self.cfg, self._bytes_per_block()
        if self.device.type != "cuda":
            return max(blocks_for_memory(1 << 28, per_block), self.max_blocks_per_seq + 1)
        peak, sampling = largest_step_bytes(self.model, cfg)
        free, total = torch.cuda.mem_get_info()
        # Each stream keeps the memory of its biggest step for itself (the caching allocator
        # pools per stream): the whole GPU's, and any other lanes' (a split runner's).
        reserve = peak + self._other_streams_reserve(peak, sampling)
        num = blocks_for_memory(int(cfg.gpu_memory_utilization * total - (total - free) - reserve), per_block)
        if num < self.max_blocks_per_seq:
            raise ValueError(f"only {num} KV blocks fit in gpu_memory_utilization="
                             f"{cfg.gpu_memory_utilization}; one max_model_len sequence needs "
                             f"{self.max_blocks_per_seq}")
        return num


def free_memory(device: torch.device) -> int | None:
    """The bytes free on the device (on a CPU, the machine's available memory; None: unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if hasattr(os, "sysconf") and "SC_AVPHYS_PAGES" in os.sysconf_names:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return None


@torch.inference_mode()
def largest_step_bytes(m: CausalLM, cfg: EngineConfig) -> tuple[int, int]:
    """The GPU memory the largest step takes beside the weights: (a full token budget's
    prefill, or the logits and sampling of every seat after it, whichever is more; the
    latter alone), measured by running them once."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before, n, dev = torch.cuda.memory_allocated(), cfg.max_num_batched_tokens, m.device
    scratch = allocate_kv_cache(cdiv(n, cfg.block_size), m.num_layers, m.num_kv_heads, cfg.block_size,
                                m.head_dim, m.dtype, dev)
    ids = torch.zeros(n, dtype=torch.long, device=dev)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, dtype=torch.int32, device=dev),
        block_tables=torch.arange(scratch.shape[0], dtype=torch.int32, device=dev)[None],
        cu_q_lens=torch.tensor([0, n], dtype=torch.int32, device=dev),
        ctx_lens=torch.zeros(1, dtype=torch.int32, device=dev), max_q_len=n)
    hidden = m(ids, ids, scratch, meta)
    peak = torch.cuda.max_memory_allocated() - before - scratch.nbytes
    torch.cuda.reset_peak_memory_stats()
    rows, held = min(cfg.max_num_seqs, n), torch.cuda.memory_allocated()
    logits = m.compute_logits(hidden[:1].expand(rows, -1))
    sample(logits, [SamplingParams(temperature=1.0, top_p=0.9)] * rows, [None] * rows)
    sampling = torch.cuda.max_memory_allocated() - held   # logits and sampling for every seat
    peak = max(peak, held - before - scratch.nbytes + sampling)
    del scratch, hidden, logits
    torch.cuda.empty_cache()
    return peak, sampling


def capture(fn: Callable[[], object], pool, stream: torch.cuda.Stream):
    """(graph, fn's output) of fn, run once first to compile and warm up outside the
    capture, and replayed once after it: a graph's first launch also uploads it to the
    device, a cost for start-up rather than for the first step that replays it."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool, stream=stream, capture_error_mode="thread_local"):
        out = fn()
    graph.replay()
    return graph, out
