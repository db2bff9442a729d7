"""Engine settings: EngineConfig, and the checks that turn a bad setting into a ValueError
naming it before anything is built (no model loaded, no worker started).

Every engine, in this process or in a worker process, is built from one EngineConfig;
the cluster (cluster.py) validates it once in the parent and hands each worker a copy
with its own device.
"""

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    model: str = "tiny"                # preset name or HF checkpoint folder
    dtype: str | torch.dtype | None = None   # None: bf16 on CUDA, fp32 on CPU
    device: str | None = None          # None: cuda if available
    block_size: int = 16               # token slots per KV block
    max_num_batched_tokens: int = 512  # tokens per step (prefill chunks + decodes)
    max_num_seqs: int = 256            # sequences per step: the seats
    max_model_len: int = 4096          # prompt + output
    num_kv_blocks: int | None = None   # None: what fits in gpu_memory_utilization
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enforce_eager: bool = False        # no CUDA graphs
    seed: int = 0                      # random weights of presets

    def validate(self) -> None:
        """Raise a ValueError naming the first bad setting."""
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1 (or None to size it), got {self.num_kv_blocks}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        check_device(self.device)
        resolve_dtype(self.dtype, self.device)


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device | None) -> torch.dtype:
    """The torch dtype a setting names; None: bf16 on CUDA, fp32 on CPU."""
    if dtype is None:
        on_cuda = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()
        return torch.bfloat16 if on_cuda else torch.float32
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")


def check_device(device: str | torch.device | None) -> torch.device | None:
    """The device, or a ValueError naming it if this machine has no such device (None: the default)."""
    if device is None:
        return None
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not a device name (cpu, cuda, cuda:N)") from None
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available")
    if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if d.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: only cpu and cuda devices are supported")
    return d
