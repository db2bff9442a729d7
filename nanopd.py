"""nanoPD's entry point. For now: a greedy generation demo on the paged KV cache.

    python nanopd.py --prompt "The quick brown fox" --max-tokens 32

It shows how the pieces fit: the BlockManager hands out cache blocks, every step turns
the sequence into AttentionMetadata (slots, block table, lengths), and the model writes
its K/V through those slots and attends over the blocks. The continuous-batching engine,
sampling and the LLM API replace this loop in the next step of the project.
"""

import argparse
import time
from pathlib import Path

import torch

import kernels
from kv_cache import BlockManager, allocate_kv_cache
from model import AttentionMetadata, Qwen3, load_model


class ByteTokenizer:
    """For random-weight presets, which have no tokenizer: UTF-8 bytes are token ids."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode(errors="replace")


def load_tokenizer(model_name: str):
    if Path(model_name).is_dir():
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(model_name)
    return ByteTokenizer()


@torch.inference_mode()
def generate(model: Qwen3, prompt_ids: list[int], max_tokens: int, block_size: int = 16):
    """Greedy decoding of one sequence; yields each new token id."""
    dev = model.device
    bm = BlockManager(num_blocks=-(-(len(prompt_ids) + max_tokens) // block_size), block_size=block_size)
    kv_cache = allocate_kv_cache(bm.num_blocks, model.num_layers, model.num_kv_heads, block_size,
                                 model.head_dim, model.dtype, dev)
    tokens = list(prompt_ids)
    table, num_computed = bm.allocate(tokens)   # nothing cached in a fresh manager: 0
    while len(tokens) < len(prompt_ids) + max_tokens:
        new = tokens[num_computed:]   # the whole prompt first, then one token per step
        bm.append_slots(table, num_computed, len(tokens))
        positions = list(range(num_computed, len(tokens)))

        def i32(x):
            return torch.tensor(x, dtype=torch.int32, device=dev)

        meta = AttentionMetadata(
            slot_mapping=i32([bm.slot(table, p) for p in positions]), block_tables=i32([table]),
            cu_q_lens=i32([0, len(new)]), ctx_lens=i32([num_computed]), max_q_len=len(new),
            num_splits=kernels.choose_num_splits(1, model.num_kv_heads, len(new), len(tokens), dev))
        hidden = model(i32(new).long(), i32(positions).long(), kv_cache, meta)
        next_id = int(model.compute_logits(hidden[-1:]).argmax(-1))
        num_computed = len(tokens)
        tokens.append(next_id)
        yield next_id
    bm.free(table)


def main() -> None:
    p = argparse.ArgumentParser(description="nanoPD greedy generation demo")
    p.add_argument("--model", default="qwen3-8b" if torch.cuda.is_available() else "tiny",
                   help="preset (tiny, qwen3-0.6b, qwen3-8b) or a local HF checkpoint folder")
    p.add_argument("--prompt", default="The quick brown fox")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16")
    args = p.parse_args()
    model = load_model(args.model, dtype=args.dtype)
    tokenizer = load_tokenizer(args.model)
    prompt_ids = tokenizer.encode(args.prompt)
    if not prompt_ids:
        raise SystemExit("error: the prompt is empty")
    print(f"{args.model} on {model.device} ({model.dtype}); prompt: {len(prompt_ids)} tokens")
    out, start = [], time.perf_counter()
    for token in generate(model, prompt_ids, args.max_tokens):
        out.append(token)
        print(tokenizer.decode([token]), end="", flush=True)
    elapsed = time.perf_counter() - start
    print(f"\n{len(out)} tokens in {elapsed:.2f} s ({len(out) / elapsed:.1f} tokens/s, eager, no CUDA graphs)")


if __name__ == "__main__":
    main()
