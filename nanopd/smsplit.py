"""SM partitions of one GPU: a prefill lane and a decode lane that run at the same time on
disjoint sets of streaming multiprocessors (SMs), for the split worker (engine.py).

A decode step reads every weight once for a few tokens each: it is bound by memory
bandwidth, and about half the SMs already draw most of it. A prefill chunk is bound by
compute. Put side by side on disjoint SMs, a decode step no longer waits behind a long
prompt's chunk, and the chunk runs on what decode leaves.

CUDA's green contexts give a process such partitions. One call of the driver's
cuDevSmResourceSplitByCount cuts the device's SMs into a group of at least `decode_sms`
and the remainder; a green context on each, and a stream on each, make two streams whose
kernels run only on their own SMs. (Two separate splits, as torch's GreenContext.create
makes them, may overlap.) Counts round up to the device's granularity (8 SMs on an H200).
A CUDA graph keeps the SMs of the stream it was captured on, so the split worker's runner
captures one set of decode graphs per partition (lanes.py:SplitRunner). sm_ids (a kernel
that writes the SM each program ran on) proves the partition disjoint.

Where this is missing (a CPU, a GPU or driver without green contexts, no `cuda.bindings`),
no partition exists and the two lanes run one after the other on one stream, through the
same scheduler and engine code.
"""

import os
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl


class Split(NamedTuple):
    """An entry of the split menu: SMs for each lane (decode_sms rounded as the driver does)."""
    prefill_sms: int
    decode_sms: int

    def __str__(self) -> str:
        return f"{self.prefill_sms}P/{self.decode_sms}D"


@dataclass
class Lanes:
    """A split's two streams; None on a machine without partitions (both lanes: the current stream)."""
    split: Split
    prefill: torch.cuda.Stream | None = None
    decode: torch.cuda.Stream | None = None
    keep: tuple = ()   # the driver objects the streams live in


def num_sms(device: torch.device) -> int:
    """The device's SMs (a CPU: 0)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


def default_menu(total_sms: int) -> list[Split]:
    """The splits built at start-up: decode on 1/4, 3/8, 1/2 and 5/8 of the SMs, in multiples
    of 8 (the prefill lane takes the rest: prompts need the SMs more, bench.py split). On a
    machine without SMs to split, nominal counts of a 128-SM device, so the same menu,
    scheduler and planner run everywhere."""
    total = total_sms or 128
    decode = sorted({max(8, total * k // 64 // 8 * 8) for k in (16, 24, 32, 40)})
    return [Split(total - d, d) for d in decode]


def load_kernels_at_start() -> None:
    """Call before CUDA starts in a process that will split its GPU (before anything asks
    CUDA about devices, torch.cuda.is_available() included): CUDA then loads every kernel
    when it starts instead of at the kernel's first launch. Loading a kernel may
    synchronise the whole context (the CUDA programming guide, on lazy loading), so a
    decode step that launches one for the first time (a GEMM cuBLAS picks for a new batch
    size, say) would wait for the prompt chunk running beside it. The cost: a longer
    start and the device memory of every kernel (the KV cache is sized after it). Once
    CUDA has started, it is too late: a warning says so (and make_lanes checks the mode
    CUDA runs in). On a machine without CUDA the setting does nothing."""
    if os.environ.get("CUDA_MODULE_LOADING") == "EAGER":
        return
    if torch.cuda.is_initialized():
        warnings.warn("CUDA started before this split engine: its kernels load at their first launch, "
                      "and a decode step that loads one waits for the prompt chunk beside it (build the "
                      "engine before using CUDA, or set CUDA_MODULE_LOADING=EAGER)", stacklevel=3)
        return
    # over torch's default (LAZY), which a parent process may pass on
    os.environ["CUDA_MODULE_LOADING"] = "EAGER"


def make_lanes(device: torch.device, split: Split) -> Lanes:
    """Two streams on disjoint SMs for split, where the device can; else both None. The
    split's counts are what the driver gave (decode rounded up to its granularity)."""
    if device.type != "cuda":
        return Lanes(split)
    try:
        (prefill, decode), (p_sms, d_sms), keep = _split_streams(device.index or 0, split.decode_sms)
    except (ImportError, RuntimeError, AttributeError):
        return Lanes(split)   # no cuda.bindings, or a driver without green contexts
    return Lanes(Split(p_sms, d_sms), prefill, decode, keep)


def _check(result):
    """A cuda.bindings call's values, or a RuntimeError naming its error."""
    err, *values = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver error {err}")
    return values[0] if len(values) == 1 else values


def _split_streams(device_index: int, decode_sms: int):
    """((prefill stream, decode stream), (their SM counts), driver objects): one split of
    the device's SMs into a group of at least decode_sms and the remainder."""
    from cuda.bindings import driver as cu

    torch.cuda.init()   # the primary context, which the green contexts' streams run beside
    _warn_if_lazy(cu)
    dev = _check(cu.cuDeviceGet(device_index))
    sms = _check(cu.cuDeviceGetDevResource(dev, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
    groups, _, rest = _check(cu.cuDevSmResourceSplitByCount(1, sms, 0, decode_sms))
    streams, keep = [], []
    for part in (rest, groups[0]):   # prefill: the remainder; decode: the group
        desc = _check(cu.cuDevResourceGenerateDesc([part], 1))
        ctx = _check(cu.cuGreenCtxCreate(desc, dev, cu.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM))
        stream = _check(cu.cuGreenCtxStreamCreate(ctx, cu.CUstream_flags.CU_STREAM_NON_BLOCKING, 0))
        streams.append(torch.cuda.ExternalStream(int(stream), device=torch.device("cuda", device_index)))
        keep += [desc, ctx, stream]
    return streams, (rest.sm.smCount, groups[0].sm.smCount), tuple(keep)


def _warn_if_lazy(cu) -> None:
    """A warning if CUDA runs this process with lazy loading (load_kernels_at_start came too
    late); nothing if this driver's bindings cannot say."""
    try:
        lazy = _check(cu.cuModuleGetLoadingMode()) != cu.CUmoduleLoadingMode.CU_MODULE_EAGER_LOADING
    except (AttributeError, RuntimeError):
        return
    if lazy:
        warnings.warn("CUDA loads kernels at their first launch in this process, and a split worker's "
                      "decode step that loads one waits for the prompt chunk beside it: build the engine "
                      "before anything uses CUDA, or set CUDA_MODULE_LOADING=EAGER "
                      "(smsplit.load_kernels_at_start)", stacklevel=3)


# ----------------------------------------------------------------------------- SM ids (the split's proof)


@triton.jit
def _sm_ids_kernel(out_ptr, SPIN: tl.constexpr):
    """Each program writes the id of the SM it ran on (PTX %smid), after spinning a little,
    so that the programs spread over every SM their stream may use."""
    pid = tl.program_id(0)
    zero = tl.zeros([1], dtype=tl.int32)
    for _ in range(SPIN):
        zero = tl.inline_asm_elementwise("nanosleep.u32 100; mov.u32 $0, $1;", "=r,r", [zero],
                                         dtype=tl.int32, is_pure=False, pack=1)
    smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [zero], dtype=tl.int32,
                                     is_pure=False, pack=1)
    tl.store(out_ptr + pid + tl.arange(0, 1), smid)


def sm_ids(programs: int, device: torch.device, spin: int = 64) -> torch.Tensor:
    """[programs] int32: the SM each of `programs` programs ran on, launched on the current
    stream (a GPU only: it reads a hardware register, so it has no torch twin)."""
    out = torch.full((programs,), -1, dtype=torch.int32, device=device)
    _sm_ids_kernel[(programs,)](out, SPIN=spin)
    return out
