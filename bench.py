"""nanoPD's benchmarks: the evidence behind every number in the README.

  python bench.py kernels   paged attention, store_kv and block gather on the GPU, each
                            beside a reference measured in the same run (SDPA on a
                            contiguous cache, a plain device copy)

Every result is printed as a table and, with --out, written as JSON.
"""

import argparse
import json

import torch
import torch.nn.functional as F
import triton.testing

import kernels


def time_ms(fn, graph: bool = False) -> float:
    """Median time of fn in ms. graph=True replays a CUDA graph (how decode really runs:
    launch overhead would otherwise dominate microsecond kernels)."""
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


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

    def ours():
        return kernels.paged_attention(q, k_cache, v_cache, tables, cu, ctx, q_len, scale, splits)

    # SDPA on the same K/V, contiguous: [B, H, T, D]
    qs = q.view(batch, q_len, hq, d).transpose(1, 2)
    ks, vs = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()

    def sdpa():
        return F.scaled_dot_product_attention(qs, ks, vs, is_causal=not decode, scale=scale, enable_gqa=True)

    err = (ours().float() - sdpa().transpose(1, 2).reshape(q.shape).float()).norm() / sdpa().float().norm()
    t_ours, t_sdpa = time_ms(ours, graph=decode), time_ms(sdpa, graph=decode)
    if decode:   # memory bound: bytes of K and V read
        work, unit = 2 * batch * seq_len * hkv * d * k.element_size() / 1e9, "GB/s"
    else:        # compute bound: causal QK^T and PV
        work, unit = 2 * 2 * batch * seq_len * seq_len * hq * d / 2 / 1e12, "TFLOP/s"
    name = f"decode B={batch} T={seq_len} (splits {splits})" if decode else f"prefill T={seq_len} causal"
    return {"case": name, "ours_ms": t_ours, "ref_ms": t_sdpa, "unit": unit, "ours_rate": work / t_ours * 1e3,
                "ref_rate": work / t_sdpa * 1e3, "ratio": t_sdpa / t_ours, "rel_err": err.item(), "ref": "SDPA"}


def bench_store_kv(num_tokens=16384, hkv=8, d=128, block_size=16):
    dev, dt = "cuda", torch.bfloat16
    k = torch.randn(num_tokens, hkv, d, device=dev, dtype=dt)
    v = torch.randn_like(k)
    nb = num_tokens // block_size
    cache = torch.empty(nb, 4, 2, hkv, block_size, d, device=dev, dtype=dt)
    slots = torch.randperm(nb, device=dev).repeat_interleave(block_size) * block_size
    slots = (slots + torch.arange(num_tokens, device=dev) % block_size).int()
    kernels.store_kv(k, v, cache[:, 1, 0], cache[:, 1, 1], slots)
    ok = torch.equal(cache[slots.long() // block_size, 1, 0, :, slots.long() % block_size], k)
    src, dst = torch.cat([k, v]), torch.empty(2 * num_tokens, hkv, d, device=dev, dtype=dt)
    t_ours = time_ms(lambda: kernels.store_kv(k, v, cache[:, 1, 0], cache[:, 1, 1], slots))
    t_copy = time_ms(lambda: dst.copy_(src))
    gb = 2 * src.numel() * src.element_size() / 1e9   # read + write
    return {"case": f"store_kv {num_tokens} tokens", "ours_ms": t_ours, "ref_ms": t_copy, "unit": "GB/s",
                "ours_rate": gb / t_ours * 1e3, "ref_rate": gb / t_copy * 1e3, "ratio": t_copy / t_ours,
                "rel_err": 0.0 if ok else float("nan"), "ref": "copy_"}


def bench_gather(num_blocks=128, cache_blocks=2048, layers=36, hkv=8, d=128, block_size=16):
    """One 2048-token Qwen3-8B request's blocks (all layers, ~302 MB) into a contiguous buffer."""
    dev, dt = "cuda", torch.bfloat16
    cache = torch.randn(cache_blocks, layers, 2, hkv, block_size, d, device=dev, dtype=dt)
    ids = torch.randperm(cache_blocks, device=dev)[:num_blocks].int()
    buf = torch.empty(num_blocks, *cache.shape[1:], device=dev, dtype=dt)
    kernels.gather_blocks(cache, ids, buf)
    ok = torch.equal(buf, cache[ids.long()])
    src = cache[:num_blocks]
    t_ours = time_ms(lambda: kernels.gather_blocks(cache, ids, buf))
    t_copy = time_ms(lambda: buf.copy_(src))
    gb = 2 * buf.numel() * buf.element_size() / 1e9
    return {"case": f"gather {num_blocks} blocks ({gb / 2 * 1e3:.0f} MB)", "ours_ms": t_ours, "ref_ms": t_copy,
                "unit": "GB/s", "ours_rate": gb / t_ours * 1e3, "ref_rate": gb / t_copy * 1e3,
                "ratio": t_copy / t_ours, "rel_err": 0.0 if ok else float("nan"), "ref": "copy_"}


def run_kernels(out: str | None) -> list[dict]:
    cases = [lambda: bench_attention(1, 4096, True), lambda: bench_attention(64, 4096, True),
             lambda: bench_attention(256, 2048, True), lambda: bench_attention(1, 2048, False),
             lambda: bench_attention(1, 8192, False), bench_store_kv, bench_gather]
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["kernels"], help="which benchmark to run")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.py kernels measures GPU kernels: no CUDA device found")
    if args.what == "kernels":
        run_kernels(args.out)


if __name__ == "__main__":
    main()
