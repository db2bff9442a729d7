"""The model for nanoPD: a decoder of the Qwen3 / Qwen2 (Qwen2.5) / Llama family, loading
it from an HF checkpoint or a named preset, and the tokenizer that goes with it.

The three families share one network; what differs (q/k norms, biases) is data, read from
the checkpoint's config through ARCHITECTURES, not branches.

A step's tokens from all sequences are concatenated (no batch dimension): input_ids and
positions are [num_tokens]. Each attention layer writes the step's K/V into the paged cache
and attends over the whole context through `kernels`; AttentionMetadata says where every
token lives. The engine builds the metadata, picks each sequence's last hidden state and
calls `compute_logits`. Module names follow HF's, except that q/k/v and gate/up are fused
into one matmul each; PACKED maps the checkpoint's names onto them (as in nano-vllm).
"""

import json
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import AutoConfig, PretrainedConfig, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from nanopd import gpu_kernels as kernels
from nanopd.config import TOKENIZER_FILES, resolve_dtype


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the paged cache and which keys they see."""
    slot_mapping: torch.Tensor   # [num_tokens] int32: block_id * block_size + offset; -1 = padding
    block_tables: torch.Tensor   # [num_seqs, max_blocks] int32
    cu_q_lens: torch.Tensor      # [num_seqs + 1] int32: prefix sums of each sequence's new tokens
    ctx_lens: torch.Tensor       # [num_seqs] int32: tokens already cached before this step
    max_q_len: int               # a host int (sizes the kernel grid), so no device sync
    num_splits: int = 1          # split-K for the decodes: kernels.choose_num_splits
    num_decodes: int = 0         # the first num_decodes sequences are decodes (q_len 1)


# ----------------------------------------------------------------------------- the network


@dataclass(frozen=True)
class Architecture:
    """What a decoder family has that the shared network leaves optional."""
    qk_norm: bool           # RMSNorm on each head of q and k before RoPE (Qwen3)
    qkv_bias: bool          # biases on the q, k and v projections
    o_bias: bool            # a bias on the output projection
    mlp_bias: bool = False  # biases on gate, up and down


# HF model_type -> its Architecture, from the config's fields (Qwen2's biases are fixed; HF's
# Qwen3 and Llama read attention_bias, Llama also mlp_bias).
ARCHITECTURES = {
    "qwen3": lambda c: Architecture(qk_norm=True, qkv_bias=c.attention_bias, o_bias=c.attention_bias),
    "qwen2": lambda c: Architecture(qk_norm=False, qkv_bias=True, o_bias=False),
    "llama": lambda c: Architecture(qk_norm=False, qkv_bias=c.attention_bias, o_bias=c.attention_bias,
                                    mlp_bias=c.mlp_bias),
}


def head_dim(config: PretrainedConfig) -> int:
    """config.head_dim where the config has one (Qwen3 always), else hidden_size / heads, as HF."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_frequencies(config: PretrainedConfig) -> tuple[torch.Tensor, float]:
    """inv_freq [head_dim // 2] (fp32) and the cos/sin scale. Scaled RoPE types come from HF's
    own initialisers, so any rope_type the config names works; the length-dependent updates
    of "dynamic" and "longrope" are not modelled (their frequencies stay at the initial ones)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":   # transformers 5 has no "default" entry in ROPE_INIT_FUNCTIONS
        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config)
        return inv_freq.float(), float(scale)
    theta, d = params.get("rope_theta", getattr(config, "rope_theta", 10000.0)), head_dim(config)
    return 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d), 1.0


class RMSNorm(nn.Module):
    """RMSNorm through kernels.rms_norm; given the residual stream, it first adds x to it
    (one fused kernel) and returns both the normalised x and the new residual."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return kernels.rms_norm(x, self.weight, self.eps, residual)


class Linear(nn.Linear):
    """nn.Linear through kernels.linear: on the GPU a decode-sized batch takes the
    small-batch kernel, and with partial_sums=True may come back as split-K partial sums
    that the next RMSNorm adds."""

    def forward(self, x: torch.Tensor, partial_sums: bool = False) -> torch.Tensor:
        return kernels.linear(x, self.weight, self.bias, partial_sums)


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, arch: Architecture, layer: int,
                 rope: tuple[torch.Tensor, float]):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.eps = head_dim(config), config.rms_norm_eps
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=arch.o_bias)
        self.q_norm = RMSNorm(self.head_dim, self.eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, self.eps) if arch.qk_norm else None
        inv_freq, self.rope_scale = rope   # computed once by CausalLM, shared by every layer
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
            slot_mapping: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> q, k and v heads [T, heads + 2 kv_heads, head_dim], q and k rotated;
        k and v also go into the cache."""
        qkv = self.qkv_proj(x)
        # Qwen3 first normalises each head's q and k (the other families have no q/k norm:
        # weights None); q and k are rotated, k and v go straight into this layer's cache.
        # One kernel for all of it.
        k_cache, v_cache = kv_cache[:, self.layer, 0], kv_cache[:, self.layer, 1]
        q_weight, k_weight = (self.q_norm.weight, self.k_norm.weight) if self.q_norm else (None, None)
        return kernels.qk_norm_rope_store_kv(qkv, q_weight, k_weight, positions, self.inv_freq,
                                             self.rope_scale, self.num_heads, self.num_kv_heads,
                                             self.eps, k_cache, v_cache, slot_mapping)

    def heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Attention.qkv's output -> views of its q, k and v heads."""
        return qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], 1)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               meta: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        """q over the paged cache -> [T, heads, head_dim] (into out if given). A prompt chunk
        reads its own keys from k and v (this step's, Attention.heads), its context from the
        cache."""
        k_cache, v_cache = kv_cache[:, self.layer, 0], kv_cache[:, self.layer, 1]
        return kernels.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_q_lens, meta.ctx_lens,
                                       meta.max_q_len, self.scale, num_splits=meta.num_splits,
                                       num_decodes=meta.num_decodes, out=out, k_new=k, v_new=v)


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig, arch: Architecture):
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=arch.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=arch.mlp_bias)
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r}: only silu (SwiGLU) is supported")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the next norm adds them
        return self.down_proj(kernels.silu_mul(self.gate_up_proj(x)), partial_sums=True)


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, arch: Architecture, layer: int,
                 rope: tuple[torch.Tensor, float]):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Attention(config, arch, layer, rope)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = MLP(config, arch)

    # h is the previous block's output, not yet added to the residual stream: each norm does
    # that add (x + residual) in the same kernel, and first adds h's split-K partial sums if
    # the projection left it as such (kernels.linear).

    def before_attention(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                         kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (q, k and v [T, heads + 2 kv_heads, head_dim] (Attention.qkv), residual)"""
        h, residual = self.input_layernorm(h, residual)
        return self.self_attn.qkv(h, positions, kv_cache, slot_mapping), residual

    def after_attention(self, o: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """o [T, heads, head_dim] -> (this block's output h, residual)"""
        h = self.self_attn.o_proj(o.flatten(1), partial_sums=True)   # the post-attention norm adds them
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class CausalLM(nn.Module):
    """A decoder of any family in ARCHITECTURES (config.model_type says which).
    kv_cache: [num_blocks, num_layers, 2 (K, V), num_kv_heads, block_size, head_dim]."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        if getattr(config, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported")
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        rope, arch = rope_frequencies(config), ARCHITECTURES[config.model_type](config)
        self.layers = nn.ModuleList(DecoderLayer(config, arch, i, rope) for i in range(self.num_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        q_size, kv_size = config.num_attention_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.packed_sizes = {"qkv_proj": [q_size, kv_size, kv_size],
                             "gate_up_proj": [config.intermediate_size] * 2}

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> hidden states [num_tokens, hidden_size]."""
        x, residual = self.piece(0, input_ids, None, positions, kv_cache, meta.slot_mapping)
        for i, layer in enumerate(self.layers):
            o = layer.self_attn.attend(*layer.self_attn.heads(x), kv_cache, meta)
            x, residual = self.piece(i + 1, o, residual, positions, kv_cache, meta.slot_mapping)
        return x

    def piece(self, i: int, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
              kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The work between attention i-1 and attention i: everything but attention, whose
        launches depend on the batch's sequences, so that CUDA graphs can capture each piece
        for a token count (ModelRunner). x is the token ids for i = 0, else attention i-1's
        output; returns (q, k and v of layer i, residual), or (the final hidden states, None)
        for i = num_layers."""
        if i == 0:
            h = self.embed_tokens(x)
        else:
            h, residual = self.layers[i - 1].after_attention(x, residual)
        if i == self.num_layers:
            return self.norm(h, residual)[0], None
        return self.layers[i].before_attention(h, residual, positions, kv_cache, slot_mapping)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> logits [n, vocab_size], in the model's dtype."""
        return self.lm_head(hidden)


# ----------------------------------------------------------------------------- loading

QWEN3 = {"vocab_size": 151936, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
         "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "head_dim": 128,
         "bos_token_id": 151643, "eos_token_id": 151645}
PRESETS = {
    "qwen3-8b": dict(QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "qwen3-0.6b": dict(QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    # For CPU runs: vocab = 256 bytes + specials (256 = bos, 257 = eos) + room to spare.
    "tiny": dict(QWEN3, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                 tie_word_embeddings=True, bos_token_id=256, eos_token_id=257),
}
# checkpoint module name -> (our fused module, which shard of its output rows)
PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def load_config(name_or_path: str) -> PretrainedConfig:
    """A preset's Qwen3Config, or a checkpoint folder's config.json."""
    if name_or_path in PRESETS:
        return Qwen3Config(**PRESETS[name_or_path])
    folder = Path(name_or_path)
    if not folder.is_dir():
        raise ValueError(f"{name_or_path!r} is neither a preset ({', '.join(PRESETS)}) "
                         "nor a checkpoint folder")
    if not (folder / "config.json").is_file():
        raise ValueError(f"checkpoint folder {folder} has no config.json")
    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as e:   # unreadable JSON, unknown model type, ...
        raise ValueError(f"{folder / 'config.json'} cannot be read as a model config: {e}") from None
    if config.model_type not in ARCHITECTURES:
        raise ValueError(f"{folder}: model_type {config.model_type!r} is not supported "
                         f"(supported: {', '.join(ARCHITECTURES)})")
    return config


def eos_ids(config: PretrainedConfig) -> set[int]:
    """The checkpoint's end-of-sequence token ids (its config may name one, several or none)."""
    eos = config.eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files: those the shard index names, else every *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index} is not a safetensors shard index: {e!r}") from None
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files or not all(f.is_file() for f in files):
        raise ValueError(f"checkpoint folder {folder} has no (or missing) *.safetensors files")
    return files


def _destination(model: CausalLM, params: dict[str, nn.Parameter], hf_name: str) -> tuple[str, torch.Tensor]:
    """The parameter a checkpoint tensor belongs to, and the rows of it that the tensor fills."""
    name = hf_name.removeprefix("model.")
    module, _, leaf = name.rpartition(".")   # "layers.3.self_attn.q_proj", "weight"
    parent, _, proj = module.rpartition(".")
    if proj in PACKED:
        fused, shard = PACKED[proj]
        name = f"{parent}.{fused}.{leaf}"
        if name in params:
            return name, params[name].split(model.packed_sizes[fused])[shard]
    if name not in params:
        raise ValueError(f"unexpected weight {hf_name} in the checkpoint")
    return name, params[name]


@torch.no_grad()
def load_weights(model: CausalLM, files: list[Path]) -> None:
    """Copy checkpoint tensors, read straight onto the model's device, into its parameters."""
    params = dict(model.named_parameters())   # a tied lm_head is listed once, as embed_tokens
    rows_filled = dict.fromkeys(params, 0)     # counts rows, so a missing q/k/v or gate/up shows
    for file in files:
        try:
            load_file_into(model, params, file, rows_filled)
        except (SafetensorError, OSError, RuntimeError) as e:   # truncated, garbage, unreadable
            raise ValueError(f"{file} cannot be read as safetensors: {e}") from None
    missing = [name for name, p in params.items() if rows_filled[name] != p.shape[0]]
    if missing:
        raise ValueError(f"checkpoint lacks weights for {', '.join(missing[:5])}"
                         f"{' ...' if len(missing) > 5 else ''}")


def load_file_into(model: CausalLM, params: dict[str, nn.Parameter], file: Path,
                   rows_filled: dict[str, int]) -> None:
    """Copy one safetensors file's tensors into their parameters, counting the rows filled."""
    with safe_open(file, framework="pt", device=str(model.device)) as f:
        for hf_name in f.keys():   # noqa: SIM118 (safe_open is not iterable)
            if hf_name == "lm_head.weight" and model.config.tie_word_embeddings:
                continue
            if ".rotary_emb." in hf_name:   # RoPE's buffers, which some older Llama checkpoints saved
                continue
            name, dst = _destination(model, params, hf_name)
            tensor = f.get_tensor(hf_name)
            if tensor.shape != dst.shape:
                raise ValueError(f"{file.name}: {hf_name} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            rows_filled[name] += tensor.shape[0]


@torch.no_grad()
def init_random(model: CausalLM, seed: int) -> None:
    """normal(0, 0.02) matrices, unit norms, zero biases; on the model's device, from seed."""
    gen = torch.Generator(model.device).manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() > 1:
            p.normal_(0.0, 0.02, generator=gen)
        else:
            p.fill_(1.0 if name.endswith("norm.weight") else 0.0)


@contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(name_or_path: str, dtype: torch.dtype | str | None = None,
               device: str | torch.device | None = None, seed: int = 0) -> CausalLM:
    """A preset name (random weights from seed) or an HF checkpoint folder -> CausalLM in eval
    mode; its config is model.config. Defaults: cuda if available; bf16 there, fp32 on CPU."""
    config = load_config(name_or_path)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = resolve_dtype(dtype, device)
    files = None if name_or_path in PRESETS else checkpoint_files(Path(name_or_path))
    # Allocate every parameter on the device in its final dtype: no CPU copy, no fp32 detour.
    with torch.device(device), default_dtype(dtype):
        model = CausalLM(config)
    model.requires_grad_(False)
    if files is None:
        init_random(model, seed)
    else:
        load_weights(model, files)
    return model.eval()


# ----------------------------------------------------------------------------- tokenizers


class ByteTokenizer:
    """For random-weight presets (and checkpoints without tokenizer files): UTF-8 bytes.
    A model's vocabulary is larger than 256: an id past the bytes decodes to a visible
    placeholder, "⟨id⟩", unless it is a special token (bos, eos, pad) and those are skipped.
    Where scripts touch a tokenizer it answers as an HF one does: tok(text)["input_ids"],
    encode, decode, convert_ids_to_tokens, bos/eos/pad_token_id, vocab_size."""

    chat_template: str | None = None   # none of its own: LLM.chat takes one (chat_template=...)
    vocab_size = 256                   # the bytes (HF's vocab_size: special tokens left out)

    def __init__(self, bos_token_id: int | list[int] | None = None,
                 eos_token_id: int | list[int] | None = None, pad_token_id: int | list[int] | None = None):
        named = [[] if i is None else i if isinstance(i, list) else [i]
                 for i in (bos_token_id, eos_token_id, pad_token_id)]
        self.special_ids = {i for ids in named for i in ids}
        # HF's tokenizers name one id each (a config may list several EOS ids: the first)
        self.bos_token_id, self.eos_token_id, self.pad_token_id = (ids[0] if ids else None for ids in named)

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(self.special_ids)

    def __call__(self, text: str | list[str], add_special_tokens: bool = True,
                 return_tensors: str | None = None, **_):
        """HF's call: {"input_ids", "attention_mask"} (a BatchEncoding) of a text or of a list of them."""
        from transformers import BatchEncoding
        one = not isinstance(text, list | tuple)
        batch = [self.encode(t) for t in ([text] if one else text)]
        data = {"input_ids": batch, "attention_mask": [[1] * len(ids) for ids in batch]}
        if one:   # one text: a list each (as tensors [1, n], as HF's)
            data = {k: v[0] for k, v in data.items()}
        return BatchEncoding(data, tensor_type=return_tensors, prepend_batch_axis=one)

    def encode(self, text: str, add_special_tokens: bool = True, **_) -> list[int]:
        """The text's bytes; no special token is added (as Qwen's tokenizers add none)."""
        return list(text.encode())

    def decode(self, ids, skip_special_tokens: bool = False, **_) -> str:
        """ids (a list, a tensor or one id) as text: byte runs as UTF-8, other ids as ⟨id⟩."""
        ids = ids.tolist() if hasattr(ids, "tolist") else ids
        pieces, run = [], bytearray()
        for i in [ids] if isinstance(ids, int) else ids:
            if i < 256:
                run.append(i)
                continue
            pieces.append(run.decode(errors="replace"))
            run = bytearray()
            if not (skip_special_tokens and i in self.special_ids):
                pieces.append(f"⟨{i}⟩")
        return "".join(pieces) + run.decode(errors="replace")

    def convert_ids_to_tokens(self, ids: int | list[int],
                              skip_special_tokens: bool = False) -> str | list[str]:
        """Each id's token: an ASCII byte's character, another byte as <0xNN> (SentencePiece's
        byte tokens), an id past the bytes as ⟨id⟩."""
        if isinstance(ids, int):
            return self.convert_ids_to_tokens([ids])[0]
        return [chr(i) if i < 128 else f"<0x{i:02X}>" if i < 256 else f"⟨{i}⟩"
                for i in ids if not (skip_special_tokens and i in self.special_ids)]

    def apply_chat_template(self, conversation: list[dict], chat_template: str | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = False, **kwargs) -> str:
        """The conversation rendered by a Jinja chat template, as HF tokenizers render theirs."""
        from transformers.utils.chat_template_utils import render_jinja_template
        if chat_template is None:
            raise ValueError("the byte tokenizer has no chat template: pass chat_template=...")
        text, _ = render_jinja_template([conversation], chat_template=chat_template,
                                        add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text[0]) if tokenize else text[0]


def load_tokenizer(name_or_path: str):
    """A checkpoint folder's own tokenizer (offline, through AutoTokenizer), else bytes: for
    a preset, and for a folder without tokenizer files with a warning (its model's ids are
    most likely not bytes)."""
    folder = Path(name_or_path)
    if folder.is_dir() and any((folder / f).exists() for f in TOKENIZER_FILES):
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(folder)
    config = load_config(name_or_path)
    if name_or_path not in PRESETS:
        warnings.warn(f"checkpoint folder {folder} has no tokenizer files (tokenizer.json, "
                      "tokenizer_config.json): prompts will be encoded as UTF-8 bytes and the "
                      "output shown as bytes", stacklevel=2)
    return ByteTokenizer(config.bos_token_id, config.eos_token_id, getattr(config, "pad_token_id", None))


class Detokenizer:
    """The text of a growing list of token ids, one token at a time (for stop strings).
    A token's text may depend on the tokens before it (a character split over byte-level
    pieces, a leading space), so each new piece of text is the decode of a short window
    less the decode of the window's start; while the window ends in an incomplete
    character (U+FFFD) the text waits for the next token. The window restarts after each
    piece, so every add decodes a few tokens, not the whole output. skip_special_tokens:
    whether special tokens are left out of the text (SamplingParams's)."""

    def __init__(self, tokenizer, ids: list[int] = (), skip_special_tokens: bool = True):
        self.tokenizer, self.ids, self.text = tokenizer, [], ""
        self.skip_special_tokens = skip_special_tokens
        self.prefix = self.read = 0   # the window is ids[prefix:]; ids[prefix:read] is already text
        for token in ids:
            self.add(token)

    def add(self, token: int) -> str:
        """Take the next token; the text it completes (often "", at the end of a character)."""
        self.ids.append(token)
        decode, skip = self.tokenizer.decode, self.skip_special_tokens
        before = decode(self.ids[self.prefix:self.read], skip_special_tokens=skip)
        after = decode(self.ids[self.prefix:], skip_special_tokens=skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.text += after[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]
