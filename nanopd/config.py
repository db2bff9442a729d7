"""Engine settings: EngineConfig, and the checks that turn a bad setting into a ValueError
naming it before anything is built (no model loaded, no worker started).

Every engine, in this process or in a worker process, is built from one EngineConfig;
the cluster (cluster.py) validates it once in the parent and hands each worker a copy
with its own device.
"""

import math
import numbers
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float": torch.float32, "half": torch.float16}   # vLLM's other names
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")   # a folder with either holds an HF tokenizer


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (speculate.py), from vLLM's `speculative_config` dict: a drafter
    proposes num_speculative_tokens tokens after a sequence's last, the model checks them
    all in one step. "ngram" drafts by prompt lookup: the tokens that followed the latest
    earlier occurrence of the sequence's last n tokens (n from prompt_lookup_max down to
    prompt_lookup_min). num_branches (nanoPD's key, not vLLM's) checks up to that many
    candidate continuations of a sequence in the same step, on copy-on-write branches.
    "draft_model" drafts with a smaller model (a preset or a checkpoint folder) of the same
    vocabulary, greedily."""
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    # No drafts while more sequences than this run (None: at any batch). vLLM drafts at any
    # batch by default; nanoPD stops past 8: checking drafts pays while a step is bound by
    # reading the weights (small batches) and costs once it is bound by compute (large
    # ones). `bench.py speculative` measures the crossover (docs/speculative.md).
    disable_by_batch_size: int | None = 8
    num_branches: int = 1                      # candidate continuations checked at once (1: vLLM's one)
    # Draft-and-check rounds a step runs on the device before the host reads its tokens
    # (nanoPD's key; 1: vLLM's one). Where the drafter also drafts on the device (ngram does),
    # rounds after the first take their drafts, acceptance and inputs from the round before
    # on the device: the host's work between drafting steps is paid once a step, not a round.
    num_rounds: int = 4
    model: str | None = None                   # draft_model: the drafting model


SPECULATIVE_METHODS = {"ngram": ("prompt_lookup_max", "prompt_lookup_min", "num_branches"),
                       "draft_model": ("model",)}   # method -> the keys it takes besides the common ones


def speculative_config(value) -> SpeculativeConfig | None:
    """vLLM's speculative_config (a dict, or one of ours, or None) as a SpeculativeConfig, or
    a ValueError naming what is wrong with it."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a dict like {{'method': 'ngram', "
                         f"'num_speculative_tokens': 4}}, got {value!r}")
    method = value.get("method")
    if method not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative_config's method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                         f"got {method!r}")
    allowed = {"method", "num_speculative_tokens", "disable_by_batch_size", "num_rounds",
               *SPECULATIVE_METHODS[method]}
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise ValueError(f"speculative_config for {method} does not take {', '.join(map(repr, unknown))} "
                         f"(it takes {', '.join(sorted(allowed))})")
    cfg = SpeculativeConfig(**value)
    check_int("speculative_config's num_speculative_tokens", cfg.num_speculative_tokens, low=1)
    check_int("speculative_config's num_branches", cfg.num_branches, low=1)
    check_int("speculative_config's num_rounds", cfg.num_rounds, low=1)
    if method == "draft_model" and not (isinstance(cfg.model, str) and cfg.model):
        raise ValueError(f"speculative_config for draft_model needs 'model': a preset name or a checkpoint "
                         f"folder, got {cfg.model!r}")
    check_int("speculative_config's prompt_lookup_min", cfg.prompt_lookup_min, low=1)
    check_int("speculative_config's prompt_lookup_max", cfg.prompt_lookup_max, low=cfg.prompt_lookup_min)
    if cfg.disable_by_batch_size is not None:
        check_int("speculative_config's disable_by_batch_size", cfg.disable_by_batch_size, low=1)
    return cfg


# The features that plug into the plain engine: the setting that asks for one -> the Engine
# subclass serving it, in a file of its own, which engine.py:make_engine loads only then.
FEATURES = {
    "speculative_config": "nanopd.speculate:SpecEngine",   # drafts checked in a step, branches, rounds
    "sm_split": "nanopd.lanes:SplitEngine",                # a step on two lanes of disjoint SMs
}


@dataclass
class EngineConfig:
    model: str = "tiny"                # preset name or HF checkpoint folder
    tokenizer: str | None = None       # an HF tokenizer folder to use instead of the model's
    dtype: str | torch.dtype | None = None   # None or "auto" (vLLM's): bf16 on CUDA, fp32 on CPU
    device: str | None = None          # None: cuda if available
    block_size: int = 16               # token slots per KV block
    max_num_batched_tokens: int = 512  # tokens per step (prefill chunks + decodes)
    max_num_seqs: int = 256            # sequences per step: the seats
    max_model_len: int = 4096          # prompt + output
    num_kv_blocks: int | None = None   # None: what fits in gpu_memory_utilization
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enforce_eager: bool = False        # no CUDA graphs
    # The presets' random weights, and torch's generators, which requests without a seed of
    # their own draw from: seeded at start, as vLLM seeds its workers (vLLM's default is 0 too).
    seed: int = 0
    # A split worker (smsplit.py): prefill and decode at once on disjoint SMs of one GPU.
    sm_split: tuple[int, int] | None = None   # (prefill SMs, decode SMs) to start on; None: unsplit
    split_menu: tuple[tuple[int, int], ...] = ()   # more splits to be ready for (graphs captured at start-up)
    speculative_config: dict | SpeculativeConfig | None = None   # vLLM's; None: no speculative decoding

    @property
    def splits_sms(self) -> bool:
        """Whether engines built from this config split their GPU's SMs (smsplit.py)."""
        return bool(self.sm_split or self.split_menu)

    def features(self) -> list[str]:
        """The settings of this config that ask for more than the plain engine (engine.py):
        each names a feature that plugs into it (FEATURES)."""
        asked = {"speculative_config": self.speculative_config is not None, "sm_split": self.splits_sms}
        return [name for name, on in asked.items() if on]

    def engine_class(self) -> str | None:
        """Where the engine this config asks for is ("module:class"); None: the plain Engine."""
        asked = self.features()
        if len(asked) > 1:
            self.validate()   # it names the settings that exclude each other
            raise ValueError(f"{' and '.join(asked)} cannot be served together")
        return FEATURES[asked[0]] if asked else None

    def validate(self) -> None:
        """Raise a ValueError naming the first bad setting."""
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a preset name or a checkpoint folder, got {self.model!r}")
        if self.tokenizer is not None and not (isinstance(self.tokenizer, str) and any(
                (Path(self.tokenizer) / f).is_file() for f in TOKENIZER_FILES)):
            raise ValueError(f"tokenizer must be a folder holding an HF tokenizer "
                             f"({' or '.join(TOKENIZER_FILES)}), got {self.tokenizer!r}")
        for name in ("max_model_len", "block_size", "max_num_batched_tokens", "max_num_seqs"):
            check_int(name, getattr(self, name), low=1)
        if self.block_size > self.max_model_len:   # a block holds token slots of one sequence
            raise ValueError(f"block_size ({self.block_size}) must be at most "
                             f"max_model_len ({self.max_model_len})")
        if self.num_kv_blocks is not None:
            check_int("num_kv_blocks", self.num_kv_blocks, low=1)
        check_real("gpu_memory_utilization", self.gpu_memory_utilization)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("enable_prefix_caching", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        check_int("seed", self.seed, low=0, high=2 ** 63 - 1)
        if not isinstance(self.split_menu, list | tuple):
            raise ValueError("split_menu must be a list of (prefill_sms, decode_sms) pairs, "
                             f"got {self.split_menu!r}")
        for name, split in [("sm_split", self.sm_split)] + [("split_menu", s) for s in self.split_menu]:
            if split is not None:
                check_split(name, split)
        check_device(self.device)
        resolve_dtype(self.dtype, self.device)
        self.speculative_config = speculative_config(self.speculative_config)
        if self.speculative_config is not None and self.splits_sms:
            raise ValueError("speculative_config with sm_split or split_menu: a split worker's lanes "
                             "pipeline their steps, and a speculating step must end before the next is "
                             "drafted; use one or the other")


def check_split(name: str, split) -> None:
    """A ValueError naming `name` unless split is a (prefill SMs, decode SMs) pair of
    positive integers (whether the GPU has them is checked where it is split, runner.py)."""
    if not isinstance(split, list | tuple) or len(split) != 2:
        raise ValueError(f"{name} must be a (prefill_sms, decode_sms) pair, got {split!r}")
    for what, value in zip(("prefill_sms", "decode_sms"), split):
        check_int(f"{name}'s {what}", value, low=1)


def check_int(name: str, value, low: int | None = None, high: int | None = None) -> None:
    """A ValueError naming `name` unless value is an integer (not a bool) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"at least {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bounds}, got {value}")


def check_real(name: str, value, low: float | None = None) -> None:
    """A ValueError naming `name` unless value is a finite real number, at least low."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device | None) -> torch.dtype:
    """The torch dtype a setting names; None or "auto": bf16 on CUDA, fp32 on CPU."""
    if dtype is None or dtype == "auto":
        on_cuda = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()
        return torch.bfloat16 if on_cuda else torch.float32
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    raise ValueError(f"dtype {dtype!r} is not one of auto, {', '.join(DTYPES)}")


def check_device(device: str | torch.device | None) -> torch.device | None:
    """The device, or a ValueError naming it if this machine has no such device (None: the default)."""
    if device is None:
        return None
    if not isinstance(device, str | torch.device):
        raise ValueError(f"device must be a name like 'cpu' or 'cuda:0', got {device!r}")
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
