"""GPU kernels for nanoPD, written in Triton, each with a plain-torch twin.

The jobs:
  paged_attention  attention for a mixed batch (decodes and prefill chunks) whose
                   K/V live in non-contiguous cache blocks; split-K for long decodes;
                   long chunks read their own keys whole from the step's K/V
  copy_rows        move whole cache blocks by id: copy-on-write inside a cache
                   (copy_blocks, timed by bench.py kernels); the KV handoff between
                   devices is the transports' (transport.py)
  linear           a batch of 1-16 rows times a weight matrix (decode): the weights
                   streamed closer to HBM bandwidth than cuBLAS gets there (on CUDA
                   only; its kernel, small_m_linear, also runs under the interpreter)
  rms_norm, qk_norm_rope_store_kv, silu_mul
                   the model's elementwise chains, one kernel each instead of the
                   five to ten small torch ops they take unfused (at batch 1 a decode
                   step is mostly launches of small kernels otherwise); the q/k one
                   (its norm optional: Qwen3 has it, Qwen2 and Llama not) also writes
                   this step's new K/V rows into the paged cache

Each public function runs the Triton kernel on CUDA tensors, and also on CPU tensors
when TRITON_INTERPRET=1 (that is how CI tests the kernels themselves). Otherwise, on
CPU, it runs the `*_torch` twin, which has the same signature and semantics.

Cache layout (see kv_cache.py): one layer's K (or V) is a strided view
[num_blocks, num_kv_heads, block_size, head_dim]. A token's slot is
block_id * block_size + offset; slot -1 marks padding.
"""

import functools
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or INTERPRET


# Programmatic dependent launch (Hopper and later): a decode step is hundreds of small
# kernels, and between two of them the GPU would otherwise sit idle while the next one
# launches. Launched with launch_pdl=True, a kernel's programs start while the previous
# kernel is still running and wait for it to finish (gdc_wait) before they touch memory;
# the previous kernel's results are visible after the wait, so ordering is as before.


@functools.cache
def _hopper(device: torch.device) -> bool:
    """Hopper or later: PDL launches and the copy engine's tensor descriptors."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


@functools.cache   # asked at every launch
def _pdl(device: torch.device) -> dict:
    """Launch options: PDL where the GPU has it; the kernels take the PDL flag."""
    return {"PDL": True, "launch_pdl": True} if _hopper(device) else {"PDL": False}


@triton.jit
def _wait_for_previous_kernel(PDL: tl.constexpr):
    if PDL:
        gdc_wait()                # the previous kernel has finished and its writes are visible
        gdc_launch_dependents()   # the next kernel may start launching


# ----------------------------------------------------------------------------- paged attention
#
# The batch is a list of sequences; sequence s has q_len[s] new tokens (1 for a decode,
# a chunk for a prefill) at positions ctx_len[s] .. ctx_len[s] + q_len[s] - 1, and its
# K/V for all ctx_len + q_len positions are already in the cache (written by qk_norm_rope_store_kv).
# New tokens attend causally: the token at position p sees keys 0..p.
#
# One program owns one tile of queries of one sequence and one kv head: BLOCK_Q tokens
# x the G query heads that share that kv head (grouped-query attention), flattened to
# BLOCK_M = BLOCK_Q * G_PAD rows. Packing a GQA group into the rows makes every K/V tile
# serve G heads at once, and gives decode (1 token) enough rows for tl.dot.
# The third grid axis also splits the key range into NUM_SPLITS parts (split-K, "flash
# decoding"); each part writes a partial result and its log-sum-exp, merged afterwards.


@triton.jit
def _softmax_step(s, v, acc, m, l, qk_scale, DOT_PRECISION: tl.constexpr):
    # One key tile of the online softmax, in base 2 (qk_scale folds in log2 e); scaled
    # inside the exponent (one fused multiply-add) rather than scaling s first.
    m_new = tl.maximum(m, tl.max(s, 1) * qk_scale)
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l


@triton.jit
def _attn_tile(q, acc, m, l, k_base, v_base, table_ptr, tile_lo, tile_hi, q_pos, kv_len,
               stride_cb, stride_cs, qk_scale,
               MASKED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
               HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # Key tiles [tile_lo, tile_hi) gathered from the paged cache through the block table.
    n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    for tile in range(tile_lo, tile_hi):
        key = tile * BLOCK_N + n
        if MASKED:   # only the tiles that cross the causal diagonal or the end of the keys
            block = tl.load(table_ptr + key // BLOCK_SIZE, mask=key < kv_len, other=0).to(tl.int64)
            offs = block[:, None] * stride_cb + (key % BLOCK_SIZE)[:, None] * stride_cs + d[None, :]
            k = tl.load(k_base + offs, mask=(key < kv_len)[:, None], other=0.0)
            v = tl.load(v_base + offs, mask=(key < kv_len)[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            s = tl.where((key[None, :] <= q_pos[:, None]) & (key[None, :] < kv_len), s, float("-inf"))
        else:
            block = tl.load(table_ptr + key // BLOCK_SIZE).to(tl.int64)
            offs = block[:, None] * stride_cb + (key % BLOCK_SIZE)[:, None] * stride_cs + d[None, :]
            k = tl.load(k_base + offs)
            v = tl.load(v_base + offs)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        acc, m, l = _softmax_step(s, v, acc, m, l, qk_scale, DOT_PRECISION)
    return acc, m, l


@triton.jit
def _own_tile(q, acc, m, l, k_desc, v_desc, first_row, col, tile_lo, tile_hi, tok, qk_scale,
              MASKED: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # Key tiles [tile_lo, tile_hi) of the chunk's own keys, rows first_row + key of the
    # step's contiguous K/V, loaded whole by the copy engine (tensor descriptors). Rows past
    # the chunk are the next sequence's (or zeros past the step's): the causal mask (key <=
    # tok, the query's index in the chunk) hides them.
    n = tl.arange(0, BLOCK_N)
    for tile in range(tile_lo, tile_hi):
        k = k_desc.load([first_row + tile * BLOCK_N, col])
        v = v_desc.load([first_row + tile * BLOCK_N, col])
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASKED:
            s = tl.where((tile * BLOCK_N + n)[None, :] <= tok[:, None], s, float("-inf"))
        acc, m, l = _softmax_step(s, v, acc, m, l, qk_scale, DOT_PRECISION)
    return acc, m, l


# The metadata pointers are views into one per-step upload (or slices of one, in a mixed
# batch) and the table width changes every step: specialising on their alignment or
# value would compile new variants mid-run, stalling the engine for seconds.
@triton.jit(do_not_specialize=["stride_table"],
            do_not_specialize_on_alignment=["table_ptr", "cu_q_ptr", "ctx_ptr"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr, k_own, v_own,
    table_ptr, cu_q_ptr, ctx_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ch, stride_cs, stride_table,
    qk_scale, num_q_heads,
    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    OWN_KV: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    _wait_for_previous_kernel(PDL)
    seq = tl.program_id(0)
    q_tile = tl.num_programs(1) - 1 - tl.program_id(1)   # causal: heaviest tiles first
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:   # grid is sized for the longest chunk; others exit here
        return
    ctx_len = tl.load(ctx_ptr + seq)
    kv_len = ctx_len + q_len

    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    row = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + row // G_PAD          # token index inside this sequence's chunk
    head = kv_head * G + row % G_PAD               # query head
    row_ok = (tok < q_len) & (row % G_PAD < G)
    q_pos = ctx_len + tok                          # absolute position: sees keys <= q_pos
    d = tl.arange(0, HEAD_DIM)
    q_offs = (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None], other=0.0)

    m = tl.full([BLOCK_M], -1.0e30, tl.float32)   # finite: a row may see no key in a split
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table = table_ptr + seq * stride_table
    k_base = k_cache_ptr + kv_head * stride_ch
    v_base = v_cache_ptr + kv_head * stride_ch
    # Tiles wholly before the first query of this tile need no causal mask.
    first_tok = q_tile * BLOCK_Q
    last_tok = tl.minimum(first_tok + BLOCK_Q, q_len) - 1
    if OWN_KV:
        # The context's keys from the cache (none masked but a last partial tile), then the
        # chunk's own from the step's K/V.
        ctx_tiles = ctx_len // BLOCK_N
        acc, m, l = _attn_tile(q, acc, m, l, k_base, v_base, table, 0, ctx_tiles, q_pos, ctx_len,
                               stride_cb, stride_cs, qk_scale, False, BLOCK_N, BLOCK_SIZE, HEAD_DIM,
                               DOT_PRECISION)
        acc, m, l = _attn_tile(q, acc, m, l, k_base, v_base, table, ctx_tiles, tl.cdiv(ctx_len, BLOCK_N),
                               q_pos, ctx_len, stride_cb, stride_cs, qk_scale, True, BLOCK_N, BLOCK_SIZE,
                               HEAD_DIM, DOT_PRECISION)
        own_tiles = tl.cdiv(last_tok + 1, BLOCK_N)
        unmasked = tl.minimum((first_tok + 1) // BLOCK_N, own_tiles)
        acc, m, l = _own_tile(q, acc, m, l, k_own, v_own, q_start, kv_head * HEAD_DIM, 0, unmasked, tok,
                              qk_scale, False, BLOCK_N, DOT_PRECISION)
        acc, m, l = _own_tile(q, acc, m, l, k_own, v_own, q_start, kv_head * HEAD_DIM, unmasked, own_tiles,
                              tok, qk_scale, True, BLOCK_N, DOT_PRECISION)
    else:
        # Every key from the cache: this split's share of the tiles up to the last query.
        num_tiles = tl.cdiv(ctx_len + last_tok + 1, BLOCK_N)
        tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
        lo = split * tiles_per_split
        hi = tl.minimum(lo + tiles_per_split, num_tiles)
        first_masked = tl.minimum((ctx_len + first_tok + 1) // BLOCK_N, hi)
        acc, m, l = _attn_tile(q, acc, m, l, k_base, v_base, table, lo, first_masked, q_pos, kv_len,
                               stride_cb, stride_cs, qk_scale, False, BLOCK_N, BLOCK_SIZE, HEAD_DIM,
                               DOT_PRECISION)
        acc, m, l = _attn_tile(q, acc, m, l, k_base, v_base, table, tl.maximum(lo, first_masked), hi,
                               q_pos, kv_len, stride_cb, stride_cs, qk_scale, True, BLOCK_N, BLOCK_SIZE,
                               HEAD_DIM, DOT_PRECISION)

    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    token = q_start + tok
    if NUM_SPLITS == 1:
        o_offs = token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:   # partials: [num_tokens, num_q_heads, NUM_SPLITS, (HEAD_DIM)] in fp32
        part = (token * num_q_heads + head) * NUM_SPLITS + split
        lse = tl.where(l == 0.0, float("-inf"), m + tl.log2(l))
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], out, mask=row_ok[:, None])
        tl.store(part_lse_ptr + part, lse, mask=row_ok)


@triton.jit(do_not_specialize_on_alignment=["cu_q_ptr"])
def _merge_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, cu_q_ptr, stride_ot, stride_oh, num_q_heads,
                         NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                         PDL: tl.constexpr):
    # One program per (sequence, new token, query head): weight each split by exp2(lse - max lse).
    _wait_for_previous_kernel(PDL)
    seq, t, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    if t >= tl.load(cu_q_ptr + seq + 1) - q_start:
        return
    token = q_start + t
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM)
    part = (token * num_q_heads + head) * NUM_SPLITS + s
    lse = tl.load(part_lse_ptr + part, mask=s < NUM_SPLITS, other=float("-inf"))
    o = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=(s < NUM_SPLITS)[:, None],
                other=0.0)
    w = tl.exp2(lse - tl.max(lse, 0))
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))


@dataclass
class AttentionConfig:
    block_m: int      # query rows per program (tokens x padded GQA group)
    block_n: int      # keys per inner-loop tile
    num_warps: int
    num_stages: int
    own_kv: bool = False   # chunks read their own keys from the step's K/V (where given; Hopper)


def attention_config(max_q_len: int, head_dim: int, on_gpu: bool, elem_bytes: int = 2) -> AttentionConfig:
    """Tile shapes (tuned on an H200 with bench.py kernels): decode needs only the 16 rows
    tl.dot wants and is memory bound; prefill is compute bound and wants big tiles, which
    in fp32 (tests only) would overflow shared memory. Small tiles under the interpreter.
    Long chunks read their own keys whole (tensor descriptors): 1.3x faster at 1024 to 8192
    tokens on an H100 (bench.py kernels). Short ones keep the gather: their tiles are few,
    and Python builds the two descriptors at every launch."""
    if not on_gpu:
        return AttentionConfig(16, 16, 4, 1, own_kv=True)
    if max_q_len == 1:
        return AttentionConfig(16, 64, 4, 2)
    if elem_bytes > 2 or head_dim > 128 or max_q_len <= 512:
        # Also short chunks: with 128-row tiles and 3 stages one program fills an SM and
        # short sequences leave it waiting on memory: these smaller tiles run them faster.
        return AttentionConfig(64, 32, 4, 2)
    if max_q_len <= 1024:   # 128-key tiles leave too few programs for the SMs
        return AttentionConfig(128, 64, 4, 2, own_kv=True)
    return AttentionConfig(128, 128, 8, 3, own_kv=True)


def _has_tma(device: torch.device) -> bool:
    """Whether tensor descriptors load through the copy engine: Hopper and later (and the
    interpreter, which runs them as plain loads)."""
    return INTERPRET or _hopper(device)


def _descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A tensor descriptor of K or V [T, Hkv, D] as a matrix [T, Hkv * D], loaded in tiles
    of `rows` tokens of one head [rows, D]."""
    flat = t.flatten(1)
    return TensorDescriptor.from_tensor(flat, [rows, t.shape[2]])


@functools.cache
def _num_sm(device: torch.device) -> int:
    if device.type != "cuda":
        return 4   # the interpreter: a few programs are enough to exercise split-K
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_q_len: int, max_kv_len: int,
                      device: torch.device, block_n: int = 64) -> int:
    """Split-K for decode only: enough programs for ~2 waves, each with >= 2 key tiles.
    A power of two: NUM_SPLITS is a compile-time constant, so every value is a kernel of
    its own, compiled the first time it is met. Mixed steps meet whatever their decodes'
    count and context give; with any value allowed, a serving run would go on compiling
    new ones, each a stall of the engine, long after start-up. Powers of two are few, and
    compiled at start-up (ModelRunner)."""
    if max_q_len > 1 or num_seqs == 0:
        return 1
    programs = num_seqs * num_kv_heads
    want = triton.cdiv(2 * _num_sm(device), programs)
    splits = max(1, min(want, triton.cdiv(max_kv_len, 2 * block_n), 64))
    return 1 << (splits.bit_length() - 1)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, cu_q_lens: torch.Tensor, ctx_lens: torch.Tensor,
                    max_q_len: int, scale: float, num_splits: int = 1,
                    out: torch.Tensor | None = None, num_decodes: int = 0,
                    k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the step's queries over the paged cache -> [num_tokens, num_q_heads, head_dim].

    q            [num_tokens, num_q_heads, head_dim], tokens of all sequences back to back
    k/v_cache    [num_blocks, num_kv_heads, block_size, head_dim] (views of one layer)
    block_tables [num_seqs, max_blocks] int32; cu_q_lens [num_seqs + 1] int32 (prefix sums
                 of q_len); ctx_lens [num_seqs] int32 (tokens cached before this step)
    max_q_len    host int, longest q_len (sizes the grid); num_splits: split-K factor.
    num_decodes  host int: the first num_decodes sequences have q_len 1. In a mixed batch
                 they get their own launch with decode tiles (16 rows, split-K), rather
                 than prefill tiles of 128 rows that would be mostly empty.
    k/v_new      [num_tokens, num_kv_heads, head_dim] or None: this step's own K/V (also in
                 the cache), from which long chunks read their own keys whole on Hopper
                 (AttentionConfig.own_kv); their context, and everything else, from the cache.
    """
    out = q.new_empty(q.shape) if out is None else out
    if 0 < num_decodes < block_tables.shape[0]:
        d = num_decodes
        paged_attention(q, k_cache, v_cache, block_tables[:d], cu_q_lens[:d + 1], ctx_lens[:d], 1, scale,
                        num_splits, out)
        return paged_attention(q, k_cache, v_cache, block_tables[d:], cu_q_lens[d:], ctx_lens[d:],
                               max_q_len, scale, 1, out, k_new=k_new, v_new=v_new)
    if not _use_triton(q):
        return paged_attention_torch(q, k_cache, v_cache, block_tables, cu_q_lens, ctx_lens,
                                     max_q_len, scale, num_splits, out, num_decodes)
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs, (num_kv_heads, block_size) = block_tables.shape[0], k_cache.shape[1:3]
    _check_pow2(head_dim=head_dim)
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not group evenly over {num_kv_heads} kv heads")
    g = num_q_heads // num_kv_heads
    g_pad = triton.next_power_of_2(g)
    cfg = attention_config(max_q_len, head_dim, q.is_cuda, q.element_size())
    block_m = max(cfg.block_m, g_pad)
    block_q = block_m // g_pad
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (num_seqs, triton.cdiv(max_q_len, block_q), num_kv_heads * num_splits)
    own = k_new is not None and cfg.own_kv and num_splits == 1 and _has_tma(q.device)
    # (placeholders the kernel never reads where not splitting, or not reading its own keys)
    k_own, v_own = (_descriptor(t, cfg.block_n) for t in (k_new, v_new)) if own else (k_cache, v_cache)
    part_out, part_lse = (out, out) if num_splits == 1 else (
        q.new_empty(num_tokens, num_q_heads, num_splits, head_dim, dtype=torch.float32),
        q.new_empty(num_tokens, num_q_heads, num_splits, dtype=torch.float32))
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, part_out, part_lse, k_own, v_own, block_tables, cu_q_lens, ctx_lens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        scale * math.log2(math.e), num_q_heads,
        G=g, G_PAD=g_pad, BLOCK_Q=block_q, BLOCK_N=cfg.block_n, BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim, NUM_SPLITS=num_splits, OWN_KV=own, DOT_PRECISION=precision,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_pdl(q.device),
    )
    if num_splits > 1:
        _merge_splits(part_out, part_lse, out, cu_q_lens, num_seqs, max_q_len)
    return out


def _merge_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, cu_q_lens: torch.Tensor,
                  num_seqs: int, max_q_len: int) -> None:
    """Combine split-K partial outputs [T, H, S, D] by their log-sum-exps [T, H, S] into out."""
    num_q_heads, num_splits, head_dim = part_out.shape[1:]
    _merge_splits_kernel[(num_seqs, max_q_len, num_q_heads)](
        part_out, part_lse, out, cu_q_lens, out.stride(0), out.stride(1), num_q_heads,
        NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim,
        **_pdl(out.device),
    )


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, cu_q_lens: torch.Tensor, ctx_lens: torch.Tensor,
                          max_q_len: int, scale: float, num_splits: int = 1,
                          out: torch.Tensor | None = None, num_decodes: int = 0) -> torch.Tensor:
    """The twin: gather each sequence's keys from its blocks, then plain masked softmax."""
    out = torch.empty_like(q) if out is None else out
    block_size = k_cache.shape[2]
    g = q.shape[1] // k_cache.shape[1]
    for s in range(block_tables.shape[0]):
        q0, q1 = int(cu_q_lens[s]), int(cu_q_lens[s + 1])
        if q1 == q0:
            continue
        kv_len = int(ctx_lens[s]) + q1 - q0
        pos = torch.arange(kv_len, device=q.device)
        blocks = block_tables[s, pos // block_size].long()
        k = k_cache[blocks, :, pos % block_size].float().repeat_interleave(g, 1)   # [kv_len, Hq, D]
        v = v_cache[blocks, :, pos % block_size].float().repeat_interleave(g, 1)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k) * scale
        q_pos = torch.arange(kv_len - (q1 - q0), kv_len, device=q.device)
        scores.masked_fill_(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


# ----------------------------------------------------------------------------- small-batch linear
#
# A decode step at batch 1-16 multiplies a few rows by every weight matrix: it streams
# 15 GB of weights through the chip and is bound by memory bandwidth alone. cuBLAS's
# matrix-vector kernels stay well below that bandwidth on the 4096-wide projections of
# Qwen3-8B. Swapping the operands (out^T = W x^T) lets 64 weight rows fill the MMA's M side
# and the batch, padded to 16, its N side: tl.dot then streams W through shared memory
# with the software pipeliner, which keeps enough bytes in flight to get closer. A weight with
# too few 64-row tiles to give every SM work (o_proj and down: 4096 rows, 64 tiles) is
# split along K in two; each half writes fp32 partial sums, and the RMSNorm that always
# follows those projections adds them (rms_norm takes x as [splits, rows, n]).

SMALL_M = 16                           # up to this many rows take the small-batch kernel
SMALL_M_BLOCK_N, SMALL_M_BLOCK_K = 64, 128   # weight rows per program, K per step (tl.dot tiles)


@triton.jit
def _small_m_linear_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_os, stride_om,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           SPLIT_K: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    # Program (n tile, k split): out[split, :, n tile] = x[:, k range] @ W[n tile, k range]^T
    _wait_for_previous_kernel(PDL)
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    n_mask, m_mask = n < N, m < M
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)   # out^T for this tile
    k_per_split = K // SPLIT_K
    for k0 in range(pid_k * k_per_split, (pid_k + 1) * k_per_split, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_w + k[None, :], mask=n_mask[:, None], other=0.0)
        x = tl.load(x_ptr + m[None, :] * stride_x + k[:, None], mask=m_mask[None, :], other=0.0)   # x^T
        acc = tl.dot(w, x, acc, input_precision=DOT_PRECISION)
    out = out_ptr + pid_k * stride_os + m[None, :] * stride_om + n[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[None, :] & n_mask[:, None])


def small_m_linear_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.shape[0] <= SMALL_M and x.shape[1] % SMALL_M_BLOCK_K == 0 and weight.shape[1] == x.shape[1]


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, split_k: int = 1) -> torch.Tensor:
    """x [M, K] (M <= 16) @ weight [N, K]^T through the Triton kernel (also on CPU under
    the interpreter). split_k 1: [M, N] in x's dtype; split_k > 1: [split_k, M, N] fp32
    partial sums over consecutive parts of K."""
    assert small_m_linear_fits(x, weight) and (x.shape[1] // SMALL_M_BLOCK_K) % split_k == 0
    m, k = x.shape
    n = weight.shape[0]
    x, weight = (x if x.stride(1) == 1 else x.contiguous(),
                 weight if weight.stride(1) == 1 else weight.contiguous())
    if split_k == 1:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    tiles = triton.cdiv(n, SMALL_M_BLOCK_N)
    # Tile shapes from a sweep on an H200: deeper pipelines where fewer programs share an SM.
    stages = 3 if tiles >= 2 * _num_sm(x.device) else 5
    if m:
        _small_m_linear_kernel[(tiles, split_k)](
            x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0) if split_k > 1 else 0,
            out.stride(-2), BLOCK_M=SMALL_M, BLOCK_N=SMALL_M_BLOCK_N, BLOCK_K=SMALL_M_BLOCK_K,
            SPLIT_K=split_k, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4,
            num_stages=stages,
            **_pdl(x.device))
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           partial_sums: bool = False) -> torch.Tensor:
    """F.linear, except that on the GPU a batch of up to 16 rows in bf16/fp16 without bias
    takes the small-batch kernel. With partial_sums=True the result may instead be
    [2, M, N] fp32 partial sums, for rms_norm to add. On CPU this is F.linear (the
    interpreter would only be slower; tests call small_m_linear directly)."""
    if not (x.is_cuda and bias is None and x.dtype in (torch.bfloat16, torch.float16)
            and small_m_linear_fits(x, weight)):
        return F.linear(x, weight, bias)
    few_tiles = triton.cdiv(weight.shape[0], SMALL_M_BLOCK_N) < _num_sm(x.device)
    split = 2 if partial_sums and few_tiles and (x.shape[1] // SMALL_M_BLOCK_K) % 2 == 0 else 1
    return small_m_linear(x, weight, split)


# ----------------------------------------------------------------------------- block copies


@triton.jit(do_not_specialize_on_alignment=["src_idx_ptr", "dst_idx_ptr"])
def _copy_rows_kernel(src_ptr, dst_ptr, src_idx_ptr, dst_idx_ptr, row_numel,
                      CHUNK: tl.constexpr):
    # Program (pair, chunk) copies CHUNK elements of row src_idx[pair] to row dst_idx[pair].
    pair, chunk = tl.program_id(0), tl.program_id(1)
    src_row = tl.load(src_idx_ptr + pair).to(tl.int64)
    dst_row = tl.load(dst_idx_ptr + pair).to(tl.int64)
    offs = chunk.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < row_numel
    x = tl.load(src_ptr + src_row * row_numel + offs, mask=mask)
    tl.store(dst_ptr + dst_row * row_numel + offs, x, mask=mask)


def copy_rows(src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor) -> None:
    """dst[dst_idx[i]] = src[src_idx[i]] for every i, in one launch. src and dst are
    contiguous with the same row size; a row of the cache is a whole block (all layers,
    K and V)."""
    if not _use_triton(dst):
        return copy_rows_torch(src, src_idx, dst, dst_idx)
    assert src.is_contiguous() and dst.is_contiguous() and src[0].numel() == dst[0].numel()
    row_numel = dst[0].numel()
    src_idx, dst_idx = src_idx.contiguous(), dst_idx.contiguous()
    chunk = 8192 if dst.is_cuda else 1024
    grid = (len(src_idx), triton.cdiv(row_numel, chunk))
    if grid[0]:
        _copy_rows_kernel[grid](src, dst, src_idx, dst_idx, row_numel, CHUNK=chunk, num_warps=8)


def copy_rows_torch(src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor,
                    dst_idx: torch.Tensor) -> None:
    dst[dst_idx.long()] = src[src_idx.long()].to(dst.device)


def copy_blocks(kv_cache: torch.Tensor, pairs: torch.Tensor) -> None:
    """Copy-on-write: for each (src, dst) row of pairs [P, 2], copy block src to block dst
    (every layer, K and V)."""
    copy_rows(kv_cache, pairs[:, 0], kv_cache, pairs[:, 1])


# ----------------------------------------------------------------------------- sampling penalties


@triton.jit
def _penalties_kernel(logits_ptr, draws_ptr, rows_ptr, knobs_ptr, counts_ptr, in_prompt_ptr, vocab,
                      BLOCK: tl.constexpr):
    # Program (i, chunk) penalises BLOCK logits of row draws[i], reading statistics row rows[i].
    i, chunk = tl.program_id(0), tl.program_id(1)
    draw = tl.load(draws_ptr + i).to(tl.int64)
    row = tl.load(rows_ptr + i).to(tl.int64)
    repetition = tl.load(knobs_ptr + 3 * i)
    presence = tl.load(knobs_ptr + 3 * i + 1)
    frequency = tl.load(knobs_ptr + 3 * i + 2)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < vocab
    x = tl.load(logits_ptr + draw * vocab + offs, mask=mask)
    count = tl.load(counts_ptr + row * vocab + offs, mask=mask, other=0)
    in_prompt = tl.load(in_prompt_ptr + row * vocab + offs, mask=mask, other=0)
    x = tl.where((count > 0) | (in_prompt != 0), tl.where(x > 0, x / repetition, x * repetition), x)
    x = x - frequency * count.to(tl.float32) - presence * (count > 0).to(tl.float32)
    tl.store(logits_ptr + draw * vocab + offs, x, mask=mask)


def apply_penalties(logits: torch.Tensor, draws: torch.Tensor, rows: torch.Tensor, knobs: torch.Tensor,
                    counts: torch.Tensor, in_prompt: torch.Tensor) -> None:
    """In place, for each i: row draws[i] of logits [D, vocab] (float32) gets the penalties
    knobs[i] = (repetition, presence, frequency) [P, 3], from its sequence's statistics row
    rows[i] of counts [R, vocab] (int32: output tokens) and in_prompt [R, vocab] (uint8).
    As vLLM and HF define them: a logit of a token seen in the prompt or the output is
    divided by the repetition penalty if positive, multiplied if not; then each output
    token's logit loses frequency x its count and presence once. One launch for the step."""
    if not _use_triton(logits):
        return apply_penalties_torch(logits, draws, rows, knobs, counts, in_prompt)
    assert logits.shape[1] == counts.shape[1] == in_prompt.shape[1] and logits.is_contiguous()
    vocab, block = logits.shape[1], 4096 if logits.is_cuda else 1024
    grid = (len(draws), triton.cdiv(vocab, block))
    if grid[0]:
        _penalties_kernel[grid](logits, draws, rows, knobs, counts, in_prompt, vocab, BLOCK=block,
                                num_warps=8)


def apply_penalties_torch(logits: torch.Tensor, draws: torch.Tensor, rows: torch.Tensor, knobs: torch.Tensor,
                          counts: torch.Tensor, in_prompt: torch.Tensor) -> None:
    draws, rows = draws.long(), rows.long()
    x, count = logits[draws], counts[rows]
    repetition, presence, frequency = knobs[:, :, None].unbind(1)
    x = torch.where((count > 0) | (in_prompt[rows] != 0),
                    torch.where(x > 0, x / repetition, x * repetition), x)
    logits[draws] = x - frequency * count - presence * (count > 0).float()


def _check_pow2(**dims: int) -> None:
    for name, n in dims.items():
        if n & (n - 1):
            raise ValueError(f"{name}={n}: the Triton kernels need a power of two")


# ----------------------------------------------------------------------------- fused elementwise


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                     stride_xs, stride_x, stride_r, stride_o, stride_ro,
                     NUM_PARTS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    _wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if NUM_PARTS > 1:   # x arrives as split-K partial sums: add them, round as the matmul would
        for part in tl.static_range(1, NUM_PARTS):
            x += tl.load(x_ptr + part * stride_xs + row * stride_x + cols, mask=mask,
                         other=0.0).to(tl.float32)
        x = x.to(out_ptr.dtype.element_ty).to(tl.float32)
    if HAS_RESIDUAL:   # the residual stream, rounded to the model dtype as an unfused add would
        x = x + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
        x = x.to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
    y = y.to(out_ptr.dtype.element_ty).to(tl.float32)   # HF rounds before the weight
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def _is_partial_sums(x: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """x is linear's split-K output [parts, rows, n] rather than [rows, n]."""
    return residual is not None and x.dim() == residual.dim() + 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, n] -> (rms_norm(h) * weight, h) with h = x + residual (or x). With a residual,
    x may also be [parts, rows, n] fp32 partial sums (linear's split-K), added first."""
    if not _use_triton(x):
        return rms_norm_torch(x, weight, eps, residual)
    parts = x.shape[0] if _is_partial_sums(x, residual) else 1
    rows = x if parts == 1 else x[0]
    out = torch.empty_like(rows, dtype=residual.dtype if residual is not None else x.dtype)
    res_out = torch.empty_like(out) if residual is not None else x
    res = residual if residual is not None else x
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            x, res, weight, out, res_out, rows.shape[1], eps, x.stride(0) if parts > 1 else 0,
            rows.stride(0), res.stride(0), out.stride(0), res_out.stride(0), NUM_PARTS=parts,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(rows.shape[1]),
            num_warps=8 if rows.shape[1] >= 2048 else 4, **_pdl(x.device))
    return out, res_out


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if _is_partial_sums(x, residual):
        x = x.sum(0).to(residual.dtype)
    h = x if residual is None else x + residual
    hf = h.float()
    return weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype), h


@triton.jit
def _norm_rope_heads(src, mask, w_ptr, cos, sin, eps, HEAD_DIM: tl.constexpr, DTYPE: tl.constexpr,
                     NORM: tl.constexpr):
    # src: pointers [heads, HEAD_DIM // 2] to the first halves of some heads of one token.
    # RMS-normalise each head and scale by the weight (if NORM), rotate (HF's rotate_half layout).
    HALF: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, HALF)
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_DIM + eps)[:, None]
        # HF rounds the normalised value to the model dtype before the weight; so do we.
        x1 = (x1 * r).to(DTYPE).to(tl.float32) * tl.load(w_ptr + d).to(tl.float32)[None, :]
        x2 = (x2 * r).to(DTYPE).to(tl.float32) * tl.load(w_ptr + HALF + d).to(tl.float32)[None, :]
    return (x1 * cos - x2 * sin).to(DTYPE), (x2 * cos + x1 * sin).to(DTYPE)


@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"])
def _qk_norm_rope_store_kv_kernel(
    qkv_ptr, qw_ptr, kw_ptr, pos_ptr, inv_freq_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_qkv, eps, rope_scale,
    stride_cb, stride_ch, stride_cs,   # cache strides: block, head, slot-in-block (K and V views share them)
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HQ_BLOCK: tl.constexpr, HKV_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLIT_HEADS: tl.constexpr, NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    # Program (token, j) works on 2D tiles [heads, HEAD_DIM // 2]: a program per (token,
    # head) moves too few bytes to keep the memory system busy. With many tokens one program
    # does all of a token's heads (j = 0). With few (decode at batch 1-64) that would leave
    # most SMs idle, so the heads are spread: program j < NUM_Q_HEADS / HQ_BLOCK does a
    # group of q heads, the last one k and v (SPLIT_HEADS). Each program writes back only
    # the heads it read, so q and k can be rewritten in place.
    _wait_for_previous_kernel(PDL)
    tok, j = tl.program_id(0).to(tl.int64), tl.program_id(1)
    HALF: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, HALF)
    angle = tl.load(pos_ptr + tok).to(tl.float32) * tl.load(inv_freq_ptr + d)
    cos, sin = (tl.cos(angle) * rope_scale)[None, :], (tl.sin(angle) * rope_scale)[None, :]
    row = qkv_ptr + tok * stride_qkv   # [q heads | k heads | v heads] x HEAD_DIM
    DTYPE: tl.constexpr = qkv_ptr.dtype.element_ty
    Q_GROUPS: tl.constexpr = (NUM_Q_HEADS + HQ_BLOCK - 1) // HQ_BLOCK

    if (not SPLIT_HEADS) or (j < Q_GROUPS):
        hq = j * HQ_BLOCK + tl.arange(0, HQ_BLOCK)[:, None]
        q_mask = hq < NUM_Q_HEADS
        q1, q2 = _norm_rope_heads(row + hq * HEAD_DIM + d[None, :], q_mask, qw_ptr, cos, sin, eps,
                                  HEAD_DIM, DTYPE, NORM)
        dst = row + hq * HEAD_DIM + d[None, :]
        tl.store(dst, q1, mask=q_mask)
        tl.store(dst + HALF, q2, mask=q_mask)

    if (not SPLIT_HEADS) or (j == Q_GROUPS):
        # K back in place, and K and V into the cache; a padding token (slot -1) writes only
        # its K in place.
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
        hkv = tl.arange(0, HKV_PAD)[:, None]
        k_src = row + (NUM_Q_HEADS + hkv) * HEAD_DIM + d[None, :]
        k1, k2 = _norm_rope_heads(k_src, hkv < NUM_KV_HEADS, kw_ptr, cos, sin, eps, HEAD_DIM, DTYPE, NORM)
        tl.store(k_src, k1, mask=hkv < NUM_KV_HEADS)
        tl.store(k_src + HALF, k2, mask=hkv < NUM_KV_HEADS)
        kv_mask = (hkv < NUM_KV_HEADS) & (slot >= 0)
        dst = block * stride_cb + hkv * stride_ch + offset * stride_cs + d[None, :]
        tl.store(k_cache_ptr + dst, k1.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(k_cache_ptr + dst + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
        dv = tl.arange(0, HEAD_DIM)[None, :]   # V is only copied: whole rows
        v = tl.load(row + (NUM_Q_HEADS + NUM_KV_HEADS + hkv) * HEAD_DIM + dv, mask=kv_mask)
        tl.store(v_cache_ptr + block * stride_cb + hkv * stride_ch + offset * stride_cs + dv, v, mask=kv_mask)


def qk_norm_rope_store_kv(qkv: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                          positions: torch.Tensor, inv_freq: torch.Tensor, rope_scale: float,
                          num_q_heads: int, num_kv_heads: int, eps: float, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """From the fused projection qkv [T, (Hq + 2 Hkv) * D]: per-head RMSNorm of q and k (unless
    the weights are None), RoPE at positions [T] (inv_freq [D/2] fp32), both rewritten in
    place (the twin returns a new tensor); k and v also go into the paged cache views
    [num_blocks, Hkv, block_size, D] at slot_mapping [T] (-1: padding, skipped). Returns qkv
    as [T, Hq + 2 Hkv, D]: the q, then k, then v heads."""
    if not _use_triton(qkv):
        return qk_norm_rope_store_kv_torch(qkv, q_weight, k_weight, positions, inv_freq, rope_scale,
                                           num_q_heads, num_kv_heads, eps, k_cache, v_cache, slot_mapping)
    head_dim = qkv.shape[1] // (num_q_heads + 2 * num_kv_heads)
    _check_pow2(head_dim=head_dim)
    norm = q_weight is not None
    if not norm:   # the kernel takes a pointer it never reads
        q_weight = k_weight = inv_freq
    assert qkv.stride(1) == 1 and k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    t = qkv.shape[0]
    split = t < _num_sm(qkv.device)
    hkv_pad = triton.next_power_of_2(num_kv_heads)
    hq_block = max(hkv_pad, 2) if split else triton.next_power_of_2(num_q_heads)
    if t:
        _qk_norm_rope_store_kv_kernel[(t, triton.cdiv(num_q_heads, hq_block) + 1 if split else 1)](
            qkv, q_weight, k_weight, positions, inv_freq, k_cache, v_cache, slot_mapping,
            qkv.stride(0), eps, rope_scale, k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2),
            NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HQ_BLOCK=hq_block, HKV_PAD=hkv_pad,
            HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[2], SPLIT_HEADS=split, NORM=norm,
            num_warps=8 if hq_block * head_dim >= 4096 else 4, **_pdl(qkv.device))
    return qkv.unflatten(1, (-1, head_dim))


def qk_norm_rope_store_kv_torch(qkv: torch.Tensor, q_weight: torch.Tensor | None,
                                k_weight: torch.Tensor | None, positions: torch.Tensor,
                                inv_freq: torch.Tensor, rope_scale: float, num_q_heads: int,
                                num_kv_heads: int, eps: float, k_cache: torch.Tensor,
                                v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    d = qkv.shape[1] // (num_q_heads + 2 * num_kv_heads)
    q, k, v = qkv.unflatten(-1, (-1, d)).split([num_q_heads, num_kv_heads, num_kv_heads], 1)
    freqs = positions.float()[:, None] * inv_freq
    angles = torch.cat((freqs, freqs), -1)[:, None]   # [T, 1, D]
    cos, sin = (angles.cos() * rope_scale).to(qkv.dtype), (angles.sin() * rope_scale).to(qkv.dtype)

    def norm_rope(x, w):
        if w is not None:
            x = rms_norm_torch(x, w, eps)[0]
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat((-x2, x1), -1) * sin
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    block, offset = slots // k_cache.shape[2], slots % k_cache.shape[2]
    k = norm_rope(k, k_weight)
    k_cache[block, :, offset] = k[valid]   # index dims first: [n, Hkv, D]
    v_cache[block, :, offset] = v[valid]
    return torch.cat((norm_rope(q, q_weight), k, v), 1)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr):
    _wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty),
             mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2n] = [gate | up] -> silu(gate) * up [T, n] (the SwiGLU MLP's middle)."""
    if not _use_triton(x):
        return silu_mul_torch(x)
    n = x.shape[1] // 2
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    block = 1024
    if x.shape[0]:
        _silu_mul_kernel[(x.shape[0], triton.cdiv(n, block))](x, out, n, x.stride(0), out.stride(0),
                                                              BLOCK=block, **_pdl(x.device))
    return out


def silu_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, -1)
    return torch.nn.functional.silu(gate) * up
