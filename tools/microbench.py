"""nanoPD's micro-benchmarks: the parts timed one at a time, each beside a reference or a
hardware ceiling measured in the same run (bench.py runs them: `python bench.py kernels`).

  python bench.py kernels   paged attention, the q/k-norm + RoPE + KV-store kernel, the
                            block copies and the small-batch linear on the GPU, each
                            beside a reference measured in the same run (SDPA on a
                            contiguous cache, a plain device copy, cuBLAS)
  python bench.py engine    the single-GPU engine on Qwen3-8B (random weights): decode
                            step times, a mixed step on the piecewise graphs and
                            eagerly, prefill ms/token, batch-1 decode inside
                            generate, one 8192-token prompt's TTFT and
                            LLM.generate throughput, beside the hardware ceilings
                            measured in the same run
  python bench.py profile   where a decode step's GPU time goes, kernel by kernel (the
                            step run eagerly under torch.profiler); --batch, --context

  python bench.py transfer  KV handoff between two GPUs through the worker processes:
                            bandwidth of the real path (p2p, relay, distributed) for 128-, 512-
                            and 2048-token requests, one at a time and eight at once,
                            beside a plain device-to-device copy (warm, and after the
                            GPUs idle as between requests) and the transport alone in
                            one process; a decode step's time while transfers run. On
                            one GPU both workers share it (no distributed: NCCL wants
                            a GPU per worker), which checks the code, not the link

Every result is printed as a table and, with --out, written as JSON. --small runs each
at toy sizes (the tiny preset, small batches, few requests; the sizes are SMALL_ENGINE,
SMALL_PROFILE, SMALL_TRANSFER and kernel_cases(small=True)): seconds, to check that it
runs, as the GPU tests do; its numbers mean nothing.
"""

import argparse
import contextlib
import dataclasses
import itertools
import json
import statistics
import time
import traceback

import torch
import torch.nn.functional as F
import triton.testing

from nanopd import gpu_kernels as kernels
from nanopd.request import SamplingParams
from nanopd.scheduler import Batch
from nanopd.timing import fake_batch, free_batch, run_step, time_step_ms


def time_ms(fn, graph: bool = False) -> float:
    """Median time of fn in ms. graph=True replays a CUDA graph (how decode really runs:
    launch overhead would otherwise dominate microsecond kernels)."""
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def launch_wait_ms(fn, reps: int = 10) -> tuple[float, float]:
    """How long the GPU waits for fn's work when the host launches it on an idle GPU (as a
    step launched once the host has read the one before), and fn's host time, in ms
    (medians). The wait: fn's span between events recorded around it on an idle GPU, less
    its span queued behind a sleep kernel (3 million cycles, ~2 ms), where the launch is
    done before it runs."""
    spans: dict[bool, list[float]] = {False: [], True: []}
    host = []
    for queued in (False, True) * reps:
        torch.cuda.synchronize()
        if queued:
            torch.cuda._sleep(3_000_000)   # clock cycles
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        began = time.perf_counter()
        fn()
        if not queued:
            host.append(time.perf_counter() - began)
        end.record()
        torch.cuda.synchronize()
        spans[queued].append(start.elapsed_time(end))
    return statistics.median(spans[False]) - statistics.median(spans[True]), statistics.median(host) * 1e3


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """|got - want| / |want| in float32 (Frobenius norms): a kernel's error against its reference."""
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def paged_copy_of(k: torch.Tensor, v: torch.Tensor, block_size: int, num_layers: int = 4):
    """Scatter contiguous K/V [B, T, Hkv, D] into a block-major cache
    [blocks, layers, 2, Hkv, block_size, D] at shuffled block ids (layer 1 is used), so the
    kernel reads strided, non-contiguous blocks as it does in the engine."""
    b, t, hkv, d = k.shape
    nb = t // block_size
    cache = torch.empty(b * nb, num_layers, 2, hkv, block_size, d, dtype=k.dtype, device=k.device)
    tables = torch.randperm(b * nb, device=k.device).view(b, nb).int()
    for i in range(b):   # [T, H, D] -> [nb, H, bs, D]
        cache[tables[i].long(), 1, 0] = k[i].view(nb, block_size, hkv, d).transpose(1, 2)
        cache[tables[i].long(), 1, 1] = v[i].view(nb, block_size, hkv, d).transpose(1, 2)
    return cache[:, 1, 0], cache[:, 1, 1], tables


def bench_attention(batch: int, seq_len: int, decode: bool, hq=32, hkv=8, d=128, block_size=16):
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    k = torch.randn(batch, seq_len, hkv, d, device=dev, dtype=dt)
    v = torch.randn(batch, seq_len, hkv, d, device=dev, dtype=dt)
    q_len = 1 if decode else seq_len
    q = torch.randn(batch * q_len, hq, d, device=dev, dtype=dt)
    k_cache, v_cache, tables = paged_copy_of(k, v, block_size)
    cu = torch.arange(0, batch + 1, device=dev, dtype=torch.int32) * q_len
    ctx = torch.full((batch,), seq_len - q_len, device=dev, dtype=torch.int32)
    scale = d ** -0.5
    splits = kernels.choose_num_splits(batch, hkv, q_len, seq_len, q.device)

    # a prompt's own K/V as the step computed them (Attention.qkv), which prefill reads
    own = {} if decode else {"k_new": k.view(-1, hkv, d), "v_new": v.view(-1, hkv, d)}

    def ours():
        return kernels.paged_attention(q, k_cache, v_cache, tables, cu, ctx, q_len, scale, splits, **own)

    # SDPA on the same K/V, contiguous: [B, H, T, D]
    qs = q.view(batch, q_len, hq, d).transpose(1, 2)
    ks, vs = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()

    def sdpa():
        return F.scaled_dot_product_attention(qs, ks, vs, is_causal=not decode, scale=scale, enable_gqa=True)

    err = rel_err(ours(), sdpa().transpose(1, 2).reshape(q.shape))
    t_ours, t_sdpa = time_ms(ours, graph=decode), time_ms(sdpa, graph=decode)
    if decode:   # memory bound: bytes of K and V read
        work, unit = 2 * batch * seq_len * hkv * d * k.element_size() / 1e9, "GB/s"
    else:        # compute bound: causal QK^T and PV
        work, unit = 2 * 2 * batch * seq_len * seq_len * hq * d / 2 / 1e12, "TFLOP/s"
    name = (f"decode B={batch} T={seq_len} (splits {splits})" if decode
            else f"prefill {f'B={batch} ' if batch > 1 else ''}T={seq_len} causal")
    return {"case": name, "ours_ms": t_ours, "ref_ms": t_sdpa, "unit": unit,
            "ours_rate": work / t_ours * 1e3, "ref_rate": work / t_sdpa * 1e3, "ratio": t_sdpa / t_ours,
            "rel_err": err, "ref": "SDPA"}


def bench_rope_store_kv(num_tokens=16384, hq=32, hkv=8, d=128, block_size=16):
    """One Qwen3-8B prefill step's q/k norm + RoPE + K/V cache write (the fused kernel: it
    reads qkv, rewrites q and k in place, writes k and v to the cache, 26/24 of a copy's
    bytes), beside a plain copy of qkv."""
    dev, dt = "cuda", torch.bfloat16
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * d, device=dev, dtype=dt)
    qw, kw = torch.rand(d, device=dev, dtype=dt) + 0.5, torch.rand(d, device=dev, dtype=dt) + 0.5
    positions = torch.arange(num_tokens, device=dev)
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, d, 2, device=dev).float() / d)
    nb = num_tokens // block_size
    cache = torch.zeros(nb, 4, 2, hkv, block_size, d, device=dev, dtype=dt)
    slots = torch.randperm(nb, device=dev).repeat_interleave(block_size) * block_size
    slots = (slots + torch.arange(num_tokens, device=dev) % block_size).int()
    args = (qkv, qw, kw, positions, inv_freq, 1.0, hq, hkv, 1e-6)
    twin = cache.clone()
    heads_ref = kernels.qk_norm_rope_store_kv_torch(*args, twin[:, 1, 0], twin[:, 1, 1], slots)
    heads = kernels.qk_norm_rope_store_kv(*args, cache[:, 1, 0], cache[:, 1, 1], slots)   # qkv in place
    err = max(rel_err(heads, heads_ref), rel_err(cache, twin))
    dst = torch.empty_like(qkv)
    t_ours = time_ms(lambda: kernels.qk_norm_rope_store_kv(*args, cache[:, 1, 0], cache[:, 1, 1], slots))
    t_copy = time_ms(lambda: dst.copy_(qkv))
    gb = 2 * qkv.numel() * qkv.element_size() / 1e9   # read + write
    return {"case": f"qk_norm_rope_store_kv {num_tokens} tok", "ours_ms": t_ours, "ref_ms": t_copy,
            "unit": "GB/s", "ours_rate": gb / t_ours * 1e3, "ref_rate": gb / t_copy * 1e3,
            "ratio": t_copy / t_ours, "rel_err": err, "ref": "copy_"}


def bench_norm_and_silu(kernel: str, num_tokens: int = 16384, hidden: int = 4096, inter: int = 12288):
    """One Qwen3-8B prefill step's residual add + RMSNorm (reads x and the residual, writes
    the sum and its norm) or SiLU-and-multiply (reads gate and up, writes their product),
    beside a plain copy of as many bytes, checked against its torch twin."""
    dev, dt = "cuda", torch.bfloat16
    if kernel == "rms_norm":
        x, res = torch.randn(2, num_tokens, hidden, device=dev, dtype=dt)
        w = torch.rand(hidden, device=dev, dtype=dt) + 0.5
        args, ours, twin, moved = (x, w, 1e-6, res), kernels.rms_norm, kernels.rms_norm_torch, 4 * x.numel()
    else:
        x = torch.randn(num_tokens, 2 * inter, device=dev, dtype=dt)
        args, ours, twin, moved = (x,), kernels.silu_mul, kernels.silu_mul_torch, 3 * x.numel() // 2
    got, want = ours(*args), twin(*args)
    pairs = zip(got, want) if kernel == "rms_norm" else [(got, want)]   # rms_norm: (norm, sum)
    err = max(rel_err(a, b) for a, b in pairs)
    src = torch.empty(moved // 2, device=dev, dtype=dt)   # read + write: as many bytes as the kernel moves
    dst = torch.empty_like(src)
    t_ours, t_copy = time_ms(lambda: ours(*args)), time_ms(lambda: dst.copy_(src))
    gb = moved * x.element_size() / 1e9
    return {"case": f"{kernel} {num_tokens} tok", "ours_ms": t_ours, "ref_ms": t_copy, "unit": "GB/s",
            "ours_rate": gb / t_ours * 1e3, "ref_rate": gb / t_copy * 1e3, "ratio": t_copy / t_ours,
            "rel_err": err, "ref": "copy_"}


def bench_copy_blocks(num_blocks=128, cache_blocks=2048, layers=36, hkv=8, d=128, block_size=16):
    """Copy-on-write of 128 scattered Qwen3-8B blocks (all layers, ~302 MB) to 128 others,
    beside one contiguous copy of as many bytes."""
    dev, dt = "cuda", torch.bfloat16
    cache = torch.randn(cache_blocks, layers, 2, hkv, block_size, d, device=dev, dtype=dt)
    ids = torch.randperm(cache_blocks, device=dev)[:2 * num_blocks].int()
    pairs = ids.view(2, num_blocks).T.contiguous()   # [num_blocks, 2]: (src, dst), all distinct
    expect = cache[pairs[:, 0].long()].clone()
    kernels.copy_blocks(cache, pairs)
    ok = torch.equal(cache[pairs[:, 1].long()], expect)
    src, buf = cache[:num_blocks], torch.empty(num_blocks, *cache.shape[1:], device=dev, dtype=dt)
    t_ours = time_ms(lambda: kernels.copy_blocks(cache, pairs))
    t_copy = time_ms(lambda: buf.copy_(src))
    gb = 2 * buf.numel() * buf.element_size() / 1e9
    return {"case": f"copy_blocks {num_blocks} blocks ({gb / 2 * 1e3:.0f} MB)", "ours_ms": t_ours,
                "ref_ms": t_copy, "unit": "GB/s", "ours_rate": gb / t_ours * 1e3,
                "ref_rate": gb / t_copy * 1e3, "ratio": t_copy / t_ours,
                "rel_err": 0.0 if ok else float("nan"), "ref": "copy_"}


def bench_small_m_linear(name: str, n: int, k: int, m: int = 1, copies: int = 8):
    """A decode projection of Qwen3-8B at batch m: kernels.linear (the small-batch kernel,
    split-K partial sums left unadded where it splits) beside cuBLAS (F.linear). Graph
    replays over `copies` weight matrices, so that the L2 cache cannot serve the weights."""
    dev, dt = "cuda", torch.bfloat16
    ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
    x = torch.randn(m, k, device=dev, dtype=dt)
    out = kernels.linear(x, ws[0], partial_sums=True)
    ours = out.float().sum(0) if out.dim() == 3 else out.float()
    ref = F.linear(x, ws[0]).float()
    err = rel_err(ours, ref)
    t_ours = time_ms(lambda: [kernels.linear(x, w, partial_sums=True) for w in ws], graph=True) / copies
    t_ref = time_ms(lambda: [F.linear(x, w) for w in ws], graph=True) / copies
    gb = n * k * 2 / 1e9
    return {"case": f"linear {name} M={m} ({gb * 1e3:.0f} MB)", "ours_ms": t_ours, "ref_ms": t_ref,
            "unit": "GB/s", "ours_rate": gb / t_ours * 1e3, "ref_rate": gb / t_ref * 1e3,
            "ratio": t_ref / t_ours, "rel_err": err, "ref": "cuBLAS"}


def kernel_cases(small: bool = False) -> list:
    """The kernels benchmark's cases, each a function giving one row: Qwen3-8B's shapes, or
    (small) every case at a toy size, seconds in all, for the tests: the same code paths,
    numbers that mean nothing."""
    if small:
        return [lambda: bench_attention(1, 512, True), lambda: bench_attention(8, 512, True),
                lambda: bench_attention(1, 256, False), lambda: bench_rope_store_kv(1024),
                lambda: bench_norm_and_silu("rms_norm", 1024, 256, 512),
                lambda: bench_norm_and_silu("silu_mul", 1024, 256, 512),
                lambda: bench_copy_blocks(16, 256, 4),
                lambda: bench_small_m_linear("qkv", 6144, 4096, copies=2),       # split-K
                lambda: bench_small_m_linear("gate_up", 24576, 4096, copies=2)]  # enough tiles: no split
    return [lambda: bench_attention(1, 4096, True), lambda: bench_attention(64, 4096, True),
            lambda: bench_attention(256, 2048, True), lambda: bench_attention(1, 2048, False),
            lambda: bench_attention(1, 8192, False), lambda: bench_attention(16, 1024, False),
            lambda: bench_attention(128, 128, False), bench_rope_store_kv,
            lambda: bench_norm_and_silu("rms_norm"), lambda: bench_norm_and_silu("silu_mul"),
            bench_copy_blocks,
            lambda: bench_small_m_linear("qkv", 6144, 4096),
            lambda: bench_small_m_linear("o_proj", 4096, 4096),
            lambda: bench_small_m_linear("gate_up", 24576, 4096),
            lambda: bench_small_m_linear("down", 4096, 12288)]


def run_kernels(out: str | None, small: bool = False) -> list[dict]:
    """Every kernel case (kernel_cases), printed as it ends and then as a table."""
    cases = kernel_cases(small)
    rows = []
    for case in cases:
        rows.append(case())
        torch.cuda.empty_cache()
        r = rows[-1]
        print(f"{r['case']:<34} ours {r['ours_ms']:8.4f} ms {r['ours_rate']:8.1f} {r['unit']:<8}"
              f" {r['ref']} {r['ref_ms']:8.4f} ms {r['ref_rate']:8.1f}  ratio {r['ratio']:.2f}"
              f"  err {r['rel_err']:.1e}", flush=True)
    print("\n| case | nanoPD | reference | ours / ref |\n| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['case']} | {r['ours_ms']:.4f} ms, {r['ours_rate']:.0f} {r['unit']} | {r['ref']} "
              f"{r['ref_ms']:.4f} ms, {r['ref_rate']:.0f} {r['unit']} | {r['ratio']:.2f}x |")
    print(f"\ndevice: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if out:
        with open(out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return rows


# ----------------------------------------------------------------------------- the engine


def measure_ceilings() -> dict:
    """HBM copy bandwidth (4 GiB device copy, bytes read + written) and bf16 matmul rate
    (8192^3), the two roofs every engine number is set against. The matmul is timed on
    N(0, 1) data and on data the size of the model's weights (N(0, 0.02)), which draws less
    power and so keeps a higher clock; the faster is the roof."""
    src = torch.randn(1 << 30, device="cuda")   # 4 GiB of fp32
    dst = torch.empty_like(src)
    copy_gbs = 2 * src.nbytes / time_ms(lambda: dst.copy_(src)) / 1e6
    src = dst = None   # free before the engine sizes its cache
    rates = []
    for std in (1.0, 0.02):
        a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) * std for _ in range(2))
        rates.append(2 * 8192 ** 3 / time_ms(lambda a=a, b=b: a @ b) / 1e9)
    return {"hbm_copy_GBps": copy_gbs, "bf16_matmul_TFLOPs": max(rates), "bf16_matmul_TFLOPs_by_std": rates}


@dataclasses.dataclass
class ModelFacts:
    """What the engine ceilings are computed from."""
    weight_bytes: int       # read by every decode step (the LM head's input embedding excluded)
    kv_per_token: int       # K/V bytes per token of context
    flops_per_token: int    # 2 x non-embedding parameters

    @staticmethod
    def of(eng) -> "ModelFacts":
        cfg, m = eng.model.config, eng.model
        params = sum(p.numel() for p in m.parameters())
        weight_bytes = (params - cfg.vocab_size * cfg.hidden_size * (0 if cfg.tie_word_embeddings else 1)) * 2
        return ModelFacts(weight_bytes, 2 * m.num_layers * m.num_kv_heads * m.head_dim * 2,
                          2 * (params - cfg.vocab_size * cfg.hidden_size))


def prefill_flops(eng, facts: ModelFacts, n: int) -> float:
    """One n-token prompt's FLOPs: its matmuls, the LM head for its last token only (the
    logits a prompt computes), and its causal attention (QK^T and PV)."""
    m = eng.model
    head = 2 * m.config.vocab_size * m.config.hidden_size
    attention = 4 * n * n / 2 * m.config.num_attention_heads * m.head_dim * m.num_layers
    return n * (facts.flops_per_token - head) + head + attention


def ceiling_ms(res: dict, nbytes: float, flops: float) -> float:
    """The larger of the bytes at the copy bandwidth and the FLOPs at the matmul rate."""
    return max(nbytes / res["hbm_copy_GBps"] / 1e6, flops / res["bf16_matmul_TFLOPs"] / 1e9)


def record(rows: list[dict], name: str, fn, ceiling: float, unit_div: float = 1.0) -> None:
    """Run fn() -> (ms, graph replay ms or None), print it beside its ceiling, add the row."""
    try:
        ms, gpu_ms = fn()
    except Exception:  # noqa: BLE001 (print it and go on to the next measurement)
        traceback.print_exc()
        return
    rows.append({"case": name, "ms": ms / unit_div, "gpu_ms": gpu_ms and gpu_ms / unit_div,
                 "ceiling_ms": ceiling / unit_div})
    gpu = f"(graph replay alone {gpu_ms:.4f} ms)" if gpu_ms else ""
    print(f"{name:<40} {ms / unit_div:8.4f} ms   ceiling {ceiling / unit_div:8.4f} ms   "
          f"ratio {ceiling / ms:.2f} {gpu}", flush=True)


@dataclasses.dataclass(frozen=True)
class EngineSizes:
    """What `bench.py engine` measures. The defaults are the runs the docs quote (Qwen3-8B);
    SMALL_ENGINE is every measurement at toy sizes, seconds in all, for the tests."""
    model: str = "qwen3-8b"
    batches: tuple[int, ...] = (1, 64, 256)   # decode steps, each sequence `context` tokens in
    context: int = 1024
    mixed: tuple[int, int] = (32, 128)        # a mixed step: decodes, and one prompt chunk's tokens
    prefill: int = 2048                       # one prompt's tokens in one step
    generate: tuple[int, int, int] = (1024, 128, 128)   # LLM.generate: requests, tokens in, tokens out
    ttft_prompt: int = 8192                   # one prompt's time to first token in LLM.generate
    reps: int = 30                            # timed decode steps a row (mixed 2/3 of it, prefill 1/3)
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 16384
    num_kv_blocks: int | None = None          # None: what fits (a small model gets a small cache)


SMALL_ENGINE = EngineSizes(model="tiny", batches=(1, 4), context=64, mixed=(4, 16), prefill=256,
                           generate=(16, 32, 16), ttft_prompt=256, reps=6, max_num_seqs=64,
                           max_num_batched_tokens=512, num_kv_blocks=1024)


def step_rows(eng, res: dict, facts: ModelFacts, rows: list[dict], sizes: EngineSizes) -> None:
    """Decode steps at each batch size (synchronised, and the graph replay alone); a prefill
    step; a mixed step (decodes + a prompt chunk) on the piecewise graphs and, as the same
    run's reference, eagerly (what the runner does past PIECE_TOKENS)."""
    def timed(make, reps: int, graph_of: int | None = None, eager: bool = False):
        batch, pieces = make(), eng.runner.piece_sizes
        try:
            eng.runner.piece_sizes = [] if eager else pieces
            ms = time_step_ms(eng, batch, reps)   # also leaves this batch in the graph's inputs
            if graph_of is None:
                return ms, None
            graph = eng.runner.full_gpu.graphs[next(s for s in eng.runner.full_gpu.sizes if s >= graph_of)][0]
            return ms, triton.testing.do_bench(graph.replay, warmup=20, rep=200, return_mode="median")
        finally:
            eng.runner.piece_sizes = pieces
            free_batch(eng, batch)

    ctx, (decodes, chunk_len), reps = sizes.context, sizes.mixed, sizes.reps

    def mixed() -> Batch:
        dec, chunk = fake_batch(eng, decodes, ctx, 1), fake_batch(eng, 1, 0, chunk_len)
        return Batch(dec.seqs + chunk.seqs, dec.num_new + chunk.num_new)
    for b in sizes.batches:
        ceiling = ceiling_ms(res, facts.weight_bytes + b * ctx * facts.kv_per_token,
                             b * facts.flops_per_token)
        record(rows, f"decode step, batch {b}, context {ctx}", lambda b=b: timed(
            lambda: fake_batch(eng, b, ctx, 1), reps, graph_of=b), ceiling)
    ceiling = ceiling_ms(res, facts.weight_bytes + decodes * ctx * facts.kv_per_token,
                         (decodes + chunk_len) * facts.flops_per_token)
    record(rows, f"mixed step, {decodes} decodes + {chunk_len}-token chunk",
           lambda: timed(mixed, reps * 2 // 3), ceiling)
    record(rows, "  the same step eagerly", lambda: timed(mixed, reps * 2 // 3, eager=True), ceiling)
    n = sizes.prefill
    record(rows, f"prefill {n} tokens (ms per token)",
           lambda: timed(lambda: fake_batch(eng, 1, 0, n), reps // 3),
           ceiling_ms(res, 0, prefill_flops(eng, facts, n)), unit_div=n)


PENALISED = SamplingParams(temperature=0.0, repetition_penalty=1.1, presence_penalty=0.5,
                           frequency_penalty=0.5)


def penalty_cost(eng, sizes: EngineSizes) -> dict:
    """A decode step of the largest batch with every sequence penalised (repetition,
    presence, frequency; each with sizes.context // 8 output tokens counted), beside the
    same step unpenalised, alternating so that both see the same GPU; the penalties'
    share of the step."""
    b, ctx = max(sizes.batches), sizes.context
    batch = fake_batch(eng, b, ctx, 1)
    for seq in batch.seqs:   # the last eighth of the context counts as output
        seq.num_prompt_tokens = ctx - ctx // 8
    try:
        run_step(eng, batch, PENALISED)   # builds the sequences' token counts, once
        plain, penalised = [], []
        for _ in range(5):
            plain.append(time_step_ms(eng, batch, sizes.reps // 3))
            penalised.append(time_step_ms(eng, batch, sizes.reps // 3, PENALISED))
    finally:
        for seq in batch.seqs:
            eng.runner.token_counts.forget(seq)
        free_batch(eng, batch)
    res = {"batch": b, "context": ctx, "plain_ms": statistics.median(plain),
           "penalised_ms": statistics.median(penalised)}
    res["overhead"] = res["penalised_ms"] / res["plain_ms"] - 1
    print(f"decode step, batch {b}, context {ctx}: {res['plain_ms']:.3f} ms, with every sequence penalised "
          f"{res['penalised_ms']:.3f} ms ({res['overhead']:+.1%})", flush=True)
    return res


def random_prompts(vocab: int, count: int, length: int, g: torch.Generator) -> list[list[int]]:
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(count)]


def decode_in_generate_row(llm, res: dict, facts: ModelFacts, rows: list[dict], g: torch.Generator,
                           context: int = 1024, tokens: int = 128) -> None:
    """One request decoding `tokens` tokens after a `context`-token prompt, as a user sees
    it: the time between its output tokens, host work (scheduling, sampling, stop checks)
    included."""
    vocab = llm.engine.model.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=tokens + 1, ignore_eos=True)

    def one():
        out = llm.generate(random_prompts(vocab, 1, context, g), params, use_tqdm=False)[0]
        return (out.metrics.finish_time - out.metrics.first_token_time) / tokens * 1e3, None
    one()   # warm-up
    mid = context + tokens // 2   # the context of the middle decode step
    record(rows, f"decode in generate, batch 1, context ~{mid}", one,
           ceiling_ms(res, facts.weight_bytes + mid * facts.kv_per_token, facts.flops_per_token))


def ttft_row(llm, res: dict, facts: ModelFacts, rows: list[dict], g: torch.Generator, length: int,
             runs: int = 3) -> None:
    """One `length`-token prompt's time to first token in LLM.generate (max_tokens 2), as a
    user sees it: the median of `runs` prompts after one warm-up, beside its prefill's
    FLOPs at the matmul rate."""
    vocab = llm.engine.model.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    def one() -> float:
        out = llm.generate(random_prompts(vocab, 1, length, g), params, use_tqdm=False)[0]
        return (out.metrics.first_token_time - out.metrics.arrival_time) * 1e3
    one()
    record(rows, f"TTFT, one {length}-token prompt",
           lambda: (statistics.median(one() for _ in range(runs)), None),
           ceiling_ms(res, 0, prefill_flops(llm.engine, facts, length)))


@contextlib.contextmanager
def step_timeline(runner):
    """Inside: per step of runner, (start, end) CUDA events, the start recorded as the host
    begins the step, whether the step before had already ended once this one was launched
    (the GPU then ran dry: the host set the pace), and whether it carried prompt tokens."""
    steps, run = [], runner.run

    def timed(batch, *args, **kwargs):
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        out = run(batch, *args, **kwargs)
        steps.append((start, out.ready, bool(steps) and steps[-1][1].query(), max(batch.num_new) > 1))
        return out
    runner.run = timed
    try:
        yield steps
    finally:
        del runner.run   # the class's method again


def gpu_time(steps: list, began: torch.cuda.Event, ended: torch.cuda.Event) -> dict:
    """Where a run's time went on the GPU (step_timeline's steps, between the events began
    and ended): before its first step (the host taking the requests in), in steps carrying
    prompt tokens and in decode steps, idle between steps (and before how many it ran dry),
    and after the last (the host handing the outputs back)."""
    torch.cuda.synchronize()
    ms = lambda a, b: a.elapsed_time(b) / 1e3
    prompt = [ms(s, e) for s, e, _, p in steps if p]
    return {"steps": len(steps), "before_first_step_s": ms(began, steps[0][0]),
            "prompt_steps": len(prompt), "prompt_steps_s": sum(prompt),
            "decode_steps_s": sum(ms(s, e) for s, e, _, p in steps if not p),
            "gpu_idle_s": sum(ms(end, start) for (_, end, *_), (start, *_) in itertools.pairwise(steps)),
            "steps_after_idle": sum(dry for _, _, dry, _ in steps),
            "after_last_step_s": ms(steps[-1][1], ended)}


def generate_throughput(llm, res: dict, facts: ModelFacts, g: torch.Generator,
                        shape: tuple[int, int, int] = (1024, 128, 128)) -> dict:
    """LLM.generate over `shape` (requests, tokens in, tokens out; the default is vLLM's
    throughput figure's), beside its roofline: every token passes once through the layers
    (all but the last output token of each request) and every output token through the LM
    head (prompt tokens skip it), at the matmul rate; each decode step reads its request's
    K/V so far, at the copy bandwidth. The two add: a step runs its attention after its
    GEMMs."""
    count, n_prompt, n_out = shape
    cfg = llm.engine.model.config
    prompts = random_prompts(cfg.vocab_size, count, n_prompt, g)
    # Warm-up: compiles the kernels of every kind of step (prefill, mixed, decode).
    llm.generate(random_prompts(cfg.vocab_size, max(1, count // 4), n_prompt, g),
                 SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    torch.cuda.synchronize()
    began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = time.perf_counter()
    began.record()
    with step_timeline(llm.engine.runner) as steps:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True))
    ended.record()
    elapsed = time.perf_counter() - t
    where = gpu_time(steps, began, ended)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    head = 2 * cfg.vocab_size * cfg.hidden_size
    n_in, requests = n_prompt * count, len(outs)
    matmul_s = ((n_in + tokens - requests) * (facts.flops_per_token - head) + tokens * head) \
        / res["bf16_matmul_TFLOPs"] / 1e12
    kv_read_s = requests * sum(n_prompt + j for j in range(1, n_out)) * facts.kv_per_token \
        / res["hbm_copy_GBps"] / 1e9
    roof_s = matmul_s + kv_read_s
    print(f"LLM.generate {count} x ({n_prompt} in, {n_out} out): {elapsed:.2f} s, {tokens / elapsed:.0f} "
          f"output tokens/s, {(tokens + n_in) / elapsed:.0f} total tokens/s; roofline {roof_s:.2f} s = "
          f"matmuls {matmul_s:.2f} + K/V reads {kv_read_s:.2f} ({tokens / roof_s:.0f} output tokens/s); "
          f"on the GPU: {where['before_first_step_s']:.3f} s before the first step, "
          f"{where['prompt_steps']} steps with prompt tokens {where['prompt_steps_s']:.3f} s, "
          f"{where['steps'] - where['prompt_steps']} decode steps {where['decode_steps_s']:.3f} s, "
          f"idle between steps {where['gpu_idle_s']:.3f} s "
          f"(before {where['steps_after_idle']} steps), {where['after_last_step_s']:.3f} s after the last")
    return {"requests": requests, "output_tokens": tokens, "seconds": elapsed,
            "output_tokens_per_s": tokens / elapsed, "total_tokens_per_s": (tokens + n_in) / elapsed,
            "matmul_s": matmul_s, "kv_read_s": kv_read_s, "roofline_s": roof_s, **where}


def run_engine(out: str | None, sizes: EngineSizes = EngineSizes()) -> dict:
    """The single-GPU engine on sizes.model beside the ceilings measured in the same run."""
    from nanopd import LLM
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, **measure_ceilings()}
    print(f"ceilings: HBM copy {res['hbm_copy_GBps']:.0f} GB/s, "
          f"bf16 matmul {res['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    t = time.perf_counter()
    llm = LLM(sizes.model, max_num_seqs=sizes.max_num_seqs,
              max_num_batched_tokens=sizes.max_num_batched_tokens,
              max_model_len=max(4096, sizes.ttft_prompt + 16), num_kv_blocks=sizes.num_kv_blocks)
    eng, res["startup_s"] = llm.engine, time.perf_counter() - t
    facts = ModelFacts.of(eng)
    print(f"{sizes.model}: {sum(p.numel() for p in eng.model.parameters()) / 1e9:.2f}B parameters, "
          f"{facts.weight_bytes / 1e9:.1f} GB read per decode step, "
          f"{eng.runner.num_blocks} KV blocks, start-up {res['startup_s']:.1f} s")
    rows, g = [], torch.Generator().manual_seed(0)
    step_rows(eng, res, facts, rows, sizes)
    res["penalties"] = penalty_cost(eng, sizes)
    decode_in_generate_row(llm, res, facts, rows, g, sizes.context, sizes.generate[2])
    ttft_row(llm, res, facts, rows, g, sizes.ttft_prompt)
    try:
        res["generate"] = generate_throughput(llm, res, facts, g, sizes.generate)
    except Exception:  # noqa: BLE001 (print it and still write what was measured)
        traceback.print_exc()
    res["rows"] = rows
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
    return res


@dataclasses.dataclass(frozen=True)
class ProfileSizes:
    """What `bench.py profile` measures: a decode step of batch sequences, each context
    tokens in, on model; SMALL_PROFILE is the same at toy sizes, for the tests."""
    model: str = "qwen3-8b"
    batch: int = 1
    context: int = 1024


SMALL_PROFILE = ProfileSizes(model="tiny", batch=2, context=64)


def run_profile(out: str | None, sizes: ProfileSizes = ProfileSizes(), steps: int = 5) -> list[dict]:
    """A decode step run eagerly under torch.profiler: the same kernels the CUDA graph
    replays, with each one's GPU time, to show where a step's time goes. The rows: the 25
    kernels with the most GPU time, per step."""
    from torch.profiler import ProfilerActivity, profile

    from nanopd import LLM
    model, batch_size, context = sizes.model, sizes.batch, sizes.context
    blocks = batch_size * (context // 16 + 2) + 64   # the fake batch's KV, not what the GPU could hold
    llm = LLM(model, max_num_seqs=max(batch_size, 16), max_model_len=4096, enforce_eager=True,
              max_num_batched_tokens=max(batch_size, 512), num_kv_blocks=blocks)
    eng = llm.engine
    batch = fake_batch(eng, batch_size, context, 1)
    for _ in range(3):
        run_step(eng, batch)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run_step(eng, batch)
        torch.cuda.synchronize()
    events = prof.key_averages()
    print(f"{model}, decode batch {batch_size}, context {context}, {steps} eager steps:")
    print(events.table(sort_by="device_time_total", row_limit=25, max_name_column_width=60))
    # The kernels themselves are the GPU's events; a CPU op (aten::mm) counts its kernels' time too.
    gpu = sorted((e for e in events if e.device_type != torch.autograd.DeviceType.CPU),
                 key=lambda e: -e.device_time_total)
    rows = [{"kernel": e.key, "gpu_ms_per_step": e.device_time_total / 1e3 / steps,
             "calls_per_step": e.count / steps}
            for e in gpu[:25]]
    if out:
        with open(out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "model": model, "batch": batch_size,
                       "context": context, "rows": rows}, f, indent=1)
    return rows


# ----------------------------------------------------------------------------- KV transfer


def measure_link(src: str, dst: str, nbytes: int = 1 << 30, idle_bytes: int = 302_000_000) -> dict:
    """Ceilings of the two transports, same run: an nbytes (1 GiB) copy between the devices,
    and device -> pinned host -> device (each direction timed alone); and an idle_bytes
    copy between the devices (302 MB: one 2048-token request's KV of Qwen3-8B) after both
    have idled 50 ms, as they do between the requests `run_transfer` sends one at a time."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=src)
    y = torch.empty_like(x, device=dst)
    host = torch.empty_like(x, device="cpu").pin_memory()
    rates = {name: x.nbytes / time_ms(fn) / 1e6 for name, fn in
             [("p2p_GBps", lambda: y.copy_(x)), ("d2h_GBps", lambda: host.copy_(x)),
              ("h2d_GBps", lambda: y.copy_(host))]}
    rates["p2p_after_idle_GBps"] = copy_after_idle_GBps(x[:idle_bytes], y[:idle_bytes])
    rates["idle_MB"] = idle_bytes / 1e6
    x = y = host = None
    torch.cuda.empty_cache()
    return rates


def copy_after_idle_GBps(x: torch.Tensor, y: torch.Tensor, idle_s: float = 0.05, reps: int = 6) -> float:
    """y.copy_(x) between devices, each copy after both devices have idled idle_s: the link
    and copy engines come back from idle slower than they run back to back. Median GB/s."""
    rates = []
    for _ in range(reps):
        torch.cuda.synchronize(x.device)
        torch.cuda.synchronize(y.device)
        time.sleep(idle_s)
        with torch.cuda.device(x.device):   # the copy runs on the source device's stream
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            y.copy_(x, non_blocking=True)
            end.record()
            end.synchronize()
        rates.append(x.nbytes / start.elapsed_time(end) / 1e6)
    return statistics.median(rates)


def transport_alone(transport, src_cache: torch.Tensor, dst_cache: torch.Tensor, dst_blocks: list[int],
                    blocks: int = 128) -> dict:
    """The transport in this process, no workers: GB/s of one pull of `blocks` blocks (a
    2048-token request), timed by its events, median of 5; as one run of consecutive
    blocks, and one block at a time (every other block, so no two are consecutive)."""
    rates = {}
    for name, src_ids, dst_ids in (("consecutive", list(range(blocks)), dst_blocks[:blocks]),
                                   ("scattered", list(range(0, 2 * blocks, 2)), dst_blocks[1:2 * blocks:2])):
        secs = []
        for _ in range(6):
            pull = transport.pull(0, src_cache, src_ids, dst_cache, dst_ids)
            pull.done.synchronize()
            pull.ready()   # reads the copy's time off its events
            secs.append(pull.seconds)
        rates[f"{name}_GBps"] = pull.nbytes / statistics.median(secs[1:]) / 1e9
    return rates


def decode_step_while_pulling(model: str, src: str, dst: str, batch: int = 64, context: int = 1024) -> dict:
    """A decode step (CUDA-graph replay, batch x context) on dst, timed alone and while a
    P2PTransport pulls blocks from src into the same cache on its own stream, two ways:
    - per_step: 128 blocks (one 2048-token request's KV, 302 MB of Qwen3-8B) pulled with
      every step. A prefill worker takes several decode steps' time to produce that much
      KV, so one per step is several times the most a real decode worker receives;
    - saturated: 2.4 GB pulls back to back for the whole timed window, the link never idle.
    Also the transport alone (transport_alone), same caches."""
    from nanopd import LLM
    from nanopd.transport import P2PTransport
    chunk = 1024   # blocks per saturating pull: 2.4 GB of Qwen3-8B, ~6 ms on the link
    eng = LLM(model, device=dst, max_num_seqs=batch,
              num_kv_blocks=batch * (context // 16 + 2) + chunk + 64).engine
    fake = fake_batch(eng, batch, context, 1)
    run_step(eng, fake)   # leaves the batch in the graph's inputs
    graph = eng.runner.full_gpu.graphs[next(s for s in eng.runner.full_gpu.sizes if s >= batch)][0]
    cache = eng.runner.kv_cache
    src_cache = torch.zeros(chunk, *cache.shape[1:], dtype=cache.dtype, device=src)
    dst_blocks, _ = eng.scheduler.allocate(list(range(chunk * eng.cfg.block_size)))
    transport = P2PTransport(torch.device(dst))
    alone_rates = transport_alone(transport, src_cache, cache, dst_blocks)

    def steps_ms(n: int = 60, pull_blocks: int = 0) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            if pull_blocks:
                transport.pull(0, src_cache, list(range(pull_blocks)), cache, dst_blocks[:pull_blocks])
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / n

    steps_ms(10)
    alone = steps_ms()
    per_step = steps_ms(pull_blocks=128)
    torch.cuda.synchronize()
    # Saturated: hold the copy stream while the host queues the pulls, and start the steps
    # when it lets go, so copies and steps begin together; 80 x 2.4 GB is ~0.5 s of
    # copying at the link's speed, longer than the 60 timed steps.
    with torch.cuda.stream(transport.stream):
        torch.cuda._sleep(1_000_000_000)   # ~0.5 s
        gate = torch.cuda.Event()
        gate.record()
    t = time.perf_counter()
    pulls = [transport.pull(0, src_cache, list(range(chunk)), cache, dst_blocks) for _ in range(80)]
    queued_s = time.perf_counter() - t
    started = pulls[0].done.query()
    torch.cuda.current_stream().wait_event(gate)
    saturated = steps_ms()
    busy = not pulls[-1].done.query()   # the transfers outlasted the timed steps
    torch.cuda.synchronize()
    return {"case": f"decode step, batch {batch}, context {context}", "alone_ms": alone,
            "per_step_MB": 128 * cache[0].nbytes / 1e6, "per_step_ms": per_step,
            "per_step_ratio": per_step / alone,
            "saturated_ms": saturated, "saturated_ratio": saturated / alone,
            "saturated_valid": busy and not started, "pulls_queued_s": queued_s,
            "transport_alone": alone_rates}


@dataclasses.dataclass(frozen=True)
class TransferSizes:
    """What `bench.py transfer` measures. The defaults are the runs the docs quote (Qwen3-8B);
    SMALL_TRANSFER is every measurement at toy sizes, seconds in all, for the tests."""
    model: str = "qwen3-8b"
    lengths: tuple[int, ...] = (128, 512, 2048)   # prompt tokens of the requests sent one at a time
    at_once: int = 8                 # requests of the longest length sent together (p2p)
    link_bytes: int = 1 << 30        # the copy that measures the link's ceiling
    idle_bytes: int = 302_000_000    # the copy after idling: one 2048-token request's KV of Qwen3-8B
    batch: int = 64                  # the decode step timed while pulls run: batch x context
    context: int = 1024


SMALL_TRANSFER = TransferSizes(model="tiny", lengths=(32, 128), at_once=2, link_bytes=64 << 20,
                               idle_bytes=16 << 20, batch=8, context=128)


def transports_for(devices: tuple[str, str]) -> tuple[str, ...]:
    """The transports measured between two devices: distributed (NCCL) only between two
    GPUs, since NCCL wants a GPU of its own per worker."""
    return ("p2p", "relay", "distributed") if devices[0] != devices[1] else ("p2p", "relay")


def run_transfer(out: str | None, devices: tuple[str, str] = ("cuda:0", "cuda:1"),
                 sizes: TransferSizes = TransferSizes()) -> dict:
    """The KV handoff from devices[0] to devices[1] beside the link's ceilings, same run. Both
    may be one GPU (its copies then stay inside it): the same code runs, the rates differ."""
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "devices": list(devices),
           **measure_link(*devices, sizes.link_bytes, sizes.idle_bytes)}
    print(f"ceilings: {devices[0]} -> {devices[1]} copy {res['p2p_GBps']:.0f} GB/s ({res['idle_MB']:.0f} MB "
          f"after 50 ms idle: {res['p2p_after_idle_GBps']:.0f}); pinned host: {res['d2h_GBps']:.0f} GB/s "
          f"down, {res['h2d_GBps']:.0f} GB/s up", flush=True)
    res["overlap"] = decode_step_while_pulling(sizes.model, *devices, sizes.batch, sizes.context)
    o = res["overlap"]
    print(f"{o['case']}: {o['alone_ms']:.3f} ms alone; {o['per_step_ms']:.3f} ms "
          f"({o['per_step_ratio']:.3f}x) pulling {o['per_step_MB']:.0f} MB with every step; "
          f"{o['saturated_ms']:.3f} ms ({o['saturated_ratio']:.3f}x) with the link saturated (transfers "
          f"covered the timed steps: {o['saturated_valid']})", flush=True)
    a = o["transport_alone"]
    print(f"P2PTransport alone, in this process, 128 blocks ({o['per_step_MB']:.0f} MB): "
          f"{a['consecutive_GBps']:.0f} GB/s as one run, {a['scattered_GBps']:.0f} GB/s one block at a time",
          flush=True)
    torch.cuda.empty_cache()
    g, rows = torch.Generator().manual_seed(0), []
    # The KV of the requests in flight at once, with room to spare; set, not what fits, since
    # both workers may share one GPU.
    blocks = 4 * max(sizes.at_once, 6) * (max(sizes.lengths) // 16 + 1)
    for transport in transports_for(devices):
        with transfer_cluster(sizes.model, devices, transport, blocks) as llm:
            rows += transfer_rows(llm, transport, res, sizes.lengths, g)
            if transport == "p2p":   # at once: handoffs follow each other, the link has no time to idle
                res["p2p_at_once"] = at_once(llm, max(sizes.lengths), sizes.at_once, g)
    res["rows"] = rows
    summarize_transports(res, rows)
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
    return res


def transfer_cluster(model: str, devices: tuple[str, str], transport: str, num_kv_blocks: int):
    """One prefill worker on devices[0] and one decode worker on devices[1]."""
    from nanopd import LLM
    return LLM(model, policy="disaggregated", devices=list(devices), transport=transport, max_num_seqs=64,
               max_num_batched_tokens=4096, max_model_len=4096, num_kv_blocks=num_kv_blocks)


def transfer_rows(llm, transport: str, res: dict, lengths: tuple[int, ...], g: torch.Generator) -> list[dict]:
    """Six requests of each length, one at a time (each transfer has the link to itself):
    the median copy rate and handoff time of the last five, beside the transport's ceiling
    (the device copy; for relay, the slower host direction)."""
    rows, vocab = [], llm.cluster.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for length in lengths:
        outs = []
        for _ in range(6):
            ids = torch.randint(0, vocab, (length,), generator=g).tolist()
            outs += llm.generate([ids], params, use_tqdm=False)
        ms = [o.metrics for o in outs[1:]]   # the first one warms up
        gbs = statistics.median(m.kv_copy_GBps() for m in ms)
        handoff = statistics.median(m.phases()["transfer"] for m in ms) * 1e3
        ceiling = min(res["d2h_GBps"], res["h2d_GBps"]) if transport == "relay" else res["p2p_GBps"]
        rows.append({"transport": transport, "tokens": length, "MB": ms[0].kv_bytes_moved / 1e6,
                     "GBps": gbs, "ceiling_GBps": ceiling, "ratio": gbs / ceiling, "handoff_ms": handoff})
        r = rows[-1]
        idle = (f", {gbs / res['p2p_after_idle_GBps']:.2f} of {res['idle_MB']:.0f} MB copied after idling "
                f"({res['p2p_after_idle_GBps']:.0f})"
                if transport == "p2p" and length == max(lengths) else "")
        print(f"{transport:<5} {length:5d} tokens ({r['MB']:6.1f} MB): copy {gbs:6.1f} GB/s = "
              f"{r['ratio']:.2f} of {ceiling:.0f}{idle}; first token -> decode worker has it: "
              f"{handoff:.2f} ms", flush=True)
    return rows


def at_once(llm, length: int, count: int, g: torch.Generator) -> dict:
    """The copy rate of each of `count` requests of `length` tokens sent together."""
    prompts = [torch.randint(0, llm.cluster.vocab_size, (length,), generator=g).tolist()
               for _ in range(count)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                        use_tqdm=False)
    rates = [o.metrics.kv_copy_GBps() for o in outs]
    print(f"p2p   {length:5d} tokens, {count} at once: copy GB/s " + ", ".join(f"{r:.0f}" for r in rates),
          flush=True)
    return {"tokens": length, "requests": count, "GBps": rates}


def summarize_transports(res: dict, rows: list[dict]) -> None:
    """The distributed transport's copy rate and handoff beside p2p's at the longest length,
    when both were measured (res gains distributed_vs_p2p)."""
    longest = max(r["tokens"] for r in rows)
    at = {r["transport"]: r for r in rows if r["tokens"] == longest}
    if "distributed" not in at or "p2p" not in at:
        print("distributed (NCCL) not measured: it needs a GPU of its own per worker", flush=True)
        return
    res["distributed_vs_p2p"] = at["distributed"]["GBps"] / at["p2p"]["GBps"]
    print(f"distributed (NCCL) / p2p, {longest} tokens, copy rate: {res['distributed_vs_p2p']:.2f}x; "
          f"handoff {at['distributed']['handoff_ms']:.2f} ms vs {at['p2p']['handoff_ms']:.2f} ms", flush=True)


def add_profile_flags(p: argparse.ArgumentParser) -> None:
    """`bench.py profile`'s own flags, beside the measuring tools' (bench.py)."""
    p.add_argument("--batch", type=int, default=None, help="decode batch size (default: 1, 2 with --small)")
    p.add_argument("--context", type=int, default=None, help="tokens of context per sequence (default: "
                   "1024, 64 with --small)")


def add_transfer_flags(p: argparse.ArgumentParser) -> None:
    """`bench.py transfer`'s own flag, beside the measuring tools' (bench.py)."""
    p.add_argument("--devices", nargs=2, default=None, metavar=("PREFILL", "DECODE"),
                   help="the two devices (default: cuda:0 cuda:1, or cuda:0 twice on one GPU)")


def main(args: argparse.Namespace) -> None:
    """`bench.py kernels | engine | profile | transfer` (args.command), with bench.py's flags."""
    if not torch.cuda.is_available():
        raise SystemExit(f"bench.py {args.command} measures the GPU: no CUDA device found")
    if args.command == "kernels":
        run_kernels(args.out, args.small)
    elif args.command == "engine":
        sizes = SMALL_ENGINE if args.small else EngineSizes()
        run_engine(args.out, dataclasses.replace(sizes, model=args.model or sizes.model))
    elif args.command == "transfer":
        sizes = SMALL_TRANSFER if args.small else TransferSizes()
        devices = args.devices or ("cuda:0", "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0")
        if devices[0] == devices[1]:
            print(f"one device ({devices[0]}): the KV copies stay inside it, and distributed (NCCL) is "
                  "left out")
        run_transfer(args.out, tuple(devices), dataclasses.replace(sizes, model=args.model or sizes.model))
    else:
        sizes = SMALL_PROFILE if args.small else ProfileSizes()
        given = {name: value for name, value in (("batch", args.batch), ("context", args.context))
                 if value is not None}
        run_profile(args.out, dataclasses.replace(sizes, model=args.model or sizes.model, **given))
