"""Paged KV memory: the cache tensor and the block allocator.

Each worker holds one KV cache tensor cut into blocks of `block_size` token slots. A
sequence's block table (a plain list of block ids, owned by the engine's Sequence) maps
its token positions to slots. `BlockManager` hands out blocks and counts references:
forked sequences share blocks and copy one only when about to write into it
(copy-on-write), and full blocks are found again by a chained hash of their tokens
(prefix caching). It is pure Python bookkeeping; the engine moves the data, e.g. running
the copy-on-write pairs it returns through `kernels.copy_blocks`.
"""

import itertools
from collections import OrderedDict
from dataclasses import dataclass

import torch

# ----------------------------------------------------------------------------- the cache tensor


def allocate_kv_cache(num_blocks: int, num_layers: int, num_kv_heads: int, block_size: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """[num_blocks, num_layers, 2 (K, V), num_kv_heads, block_size, head_dim].

    Block-major: a block's K and V for every layer are one contiguous chunk, so
    copy-on-write and cross-device transfer move a request in a few large copies.
    """
    # Zeros, not empty: attention reads the unwritten tail of a sequence's last block and
    # gives it zero weight, but 0 * NaN from uninitialised memory would still be NaN.
    shape = (num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, block_size: int, head_dim: int,
                       dtype: torch.dtype) -> int:
    return num_layers * 2 * num_kv_heads * block_size * head_dim * dtype.itemsize


def blocks_for_memory(budget_bytes: int, bytes_per_block: int) -> int:
    """How many blocks fit in a memory budget (the engine decides the budget)."""
    return max(0, budget_bytes // bytes_per_block)


# ---------------------------------------------------------------------------- the block allocator


class OutOfBlocks(RuntimeError):
    """More blocks were asked for than are free: admission checks can_allocate first; a running
    sequence that cannot grow is preempted (scheduler.py)."""


def hash_block(prev_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Chained hash of a full block: its tokens and, through prev_hash, every token before them."""
    return hash((prev_hash, token_ids))


NO_PREFIX = 0  # parent_id of a sequence's first block


@dataclass(slots=True)
class Block:
    ref_count: int = 0
    # Set while the block is in the prefix cache, i.e. full and its KV computed.
    hash: int | None = None
    token_ids: tuple[int, ...] = ()
    # Hashes collide and block ids are recycled, so a hit is verified by tokens and by
    # prefix_id: a number naming the exact prefix that ends in this block, never reused.
    prefix_id: int = NO_PREFIX
    parent_id: int = NO_PREFIX


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Allocates blocks to block tables; counts references; copy-on-write; prefix cache.

    Every block is in one of three states: in use (ref_count > 0), evictable (ref_count 0
    but still in the prefix cache: revived by a hit, or evicted least recently used first
    when a fresh block is needed), or free. A block with ref_count > 1 is never written in
    place: append_slots first swaps it for a fresh copy.
    """

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01,
                 enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        # New sequences must leave this many blocks free, so that running ones can grow
        # without being preempted the moment a new one is admitted.
        self.watermark_blocks = int(watermark * num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block() for _ in range(num_blocks)]
        self.free_block_ids = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0 first
        self.evictable: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.cached: dict[int, int] = {}  # hash -> block id
        self._prefix_ids = itertools.count(NO_PREFIX + 1)

    @property
    def num_free_blocks(self) -> int:
        """Blocks a fresh allocation can take: the free ones and the evictable cached ones."""
        return len(self.free_block_ids) + len(self.evictable)

    # -- new sequences --

    def can_allocate(self, token_ids: list[int], reuse: bool = True) -> bool:
        """Whether a new prompt fits and still leaves the watermark free (reuse: as allocate)."""
        hits = self._match_prefix(token_ids) if reuse else []
        taken = self._free_blocks_taken(token_ids, hits)
        return self.num_free_blocks - taken >= self.watermark_blocks

    def allocate(self, token_ids: list[int], reuse: bool = True) -> tuple[list[int], int]:
        """Block table covering all of `token_ids`, and how many leading tokens are cached.

        The cached tokens are whole prefix-cache blocks, shared, that the engine skips
        computing. The last token is never among them: the engine needs its logits, and
        writing it must not touch a shared block. reuse=False takes no cached block (every
        position is computed: prompt logprobs need their logits). Does not enforce the
        watermark.
        """
        hits = self._match_prefix(token_ids) if reuse else []
        taken = self._free_blocks_taken(token_ids, hits)
        if taken > self.num_free_blocks:
            raise OutOfBlocks(f"{len(token_ids)} tokens need {taken} blocks, {self.num_free_blocks} free")
        # Revive the hits before taking fresh blocks, so eviction cannot take a hit.
        for block_id in hits:
            self._acquire(block_id)
        num_fresh = cdiv(len(token_ids), self.block_size) - len(hits)
        table = hits + [self._take_fresh_block() for _ in range(num_fresh)]
        return table, len(hits) * self.block_size

    def fork(self, block_table: list[int]) -> list[int]:
        """A child table sharing every block of the parent; copies happen on write."""
        for block_id in block_table:
            self._acquire(block_id)
        return list(block_table)

    # -- running sequences --

    def append_slots(self, block_table: list[int], start: int, end: int) -> list[tuple[int, int]]:
        """Make positions [start, end) writable: grow the table to `end` tokens and give
        every block the write touches a single owner.

        Returns the copy-on-write (src, dst) block pairs, which the engine must copy
        before the step writes: each shared block in the range is replaced in
        `block_table` by a fresh dst, and the other sequences keep src.
        """
        if end <= len(block_table) * self.block_size and end - start == 1 \
                and self.blocks[block_table[start // self.block_size]].ref_count == 1:
            return []   # the common decode step: one slot in a block this table owns alone
        needed = self._blocks_to_write(block_table, start, end)
        if needed > self.num_free_blocks:
            raise OutOfBlocks(f"writing positions [{start}, {end}) needs {needed} blocks, "
                              f"{self.num_free_blocks} free")
        copies = []
        last = min(len(block_table), cdiv(end, self.block_size))
        for i in range(start // self.block_size, last):
            src = block_table[i]
            if self.blocks[src].ref_count > 1:
                block_table[i] = self._take_fresh_block()
                self.blocks[src].ref_count -= 1  # still >= 1, so src is never handed out as a dst
                copies.append((src, block_table[i]))
        while len(block_table) * self.block_size < end:
            block_table.append(self._take_fresh_block())
        return copies

    def truncate(self, block_table: list[int], num_tokens: int) -> None:
        """Give back the table's blocks past its first num_tokens slots (tokens given up)."""
        keep = cdiv(num_tokens, self.block_size)
        for block_id in reversed(block_table[keep:]):
            self._release(block_id)
        del block_table[keep:]

    def cache_computed_blocks(self, block_table: list[int], token_ids: list[int],
                              num_computed_tokens: int) -> None:
        """Enter the table's full, computed blocks into the prefix cache.

        Call after every step, once its KV is written: with chunked prefill a prompt is
        computed over several steps, and a block must not be found before its KV exists.
        If another sequence already cached the same prefix block, this table switches to
        that block and frees its own copy (so it may change `block_table`).
        """
        if not self.enable_prefix_caching:
            return
        num_full = num_computed_tokens // self.block_size
        # Cached blocks always form a prefix of a table: start after the last one.
        first = num_full
        while first > 0 and self.blocks[block_table[first - 1]].hash is None:
            first -= 1
        prev = self.blocks[block_table[first - 1]] if first else None
        prev_hash, parent_id = (prev.hash, prev.prefix_id) if prev else (None, NO_PREFIX)
        for i in range(first, num_full):
            tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            block_hash = hash_block(prev_hash, tokens)
            cached = self._lookup(block_hash, parent_id, tokens)
            if cached is not None:
                self._acquire(cached)
                self._release(block_table[i])
                block_table[i] = cached
            elif block_hash in self.cached:
                return  # a hash collision holds the slot: the rest of the chain stays uncached
            else:
                self._register(block_table[i], block_hash, parent_id, tokens)
            prev_hash, parent_id = block_hash, self.blocks[block_table[i]].prefix_id

    def free(self, block_table: list[int]) -> None:
        """Drop the table's references and empty it."""
        # In reverse, so a prompt's tail blocks become least recently used and are evicted
        # before its head, which more future prompts share.
        for block_id in reversed(block_table):
            self._release(block_id)
        block_table.clear()

    # -- internals --

    def _match_prefix(self, token_ids: list[int]) -> list[int]:
        """Cached blocks holding the leading full blocks of token_ids[:-1]."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        prev_hash, parent_id = None, NO_PREFIX
        for i in range((len(token_ids) - 1) // self.block_size):
            tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            prev_hash = hash_block(prev_hash, tokens)
            block_id = self._lookup(prev_hash, parent_id, tokens)
            if block_id is None:
                break
            hits.append(block_id)
            parent_id = self.blocks[block_id].prefix_id
        return hits

    def _lookup(self, block_hash: int, parent_id: int, tokens: tuple[int, ...]) -> int | None:
        """The cached block for these tokens after this prefix; None on a miss or a collision."""
        block_id = self.cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        return block_id if block.parent_id == parent_id and block.token_ids == tokens else None

    def _register(self, block_id: int, block_hash: int, parent_id: int, tokens: tuple[int, ...]):
        block = self.blocks[block_id]
        block.hash, block.token_ids = block_hash, tokens
        block.prefix_id, block.parent_id = next(self._prefix_ids), parent_id
        self.cached[block_hash] = block_id

    def _free_blocks_taken(self, token_ids: list[int], hits: list[int]) -> int:
        """Free-pool blocks an allocation takes: the fresh ones plus the evictable hits."""
        fresh = cdiv(len(token_ids), self.block_size) - len(hits)
        return fresh + sum(self.blocks[block_id].ref_count == 0 for block_id in hits)

    def _blocks_to_write(self, block_table: list[int], start: int, end: int) -> int:
        """Fresh blocks needed to grow the table to `end` tokens and copy the shared ones
        that positions [start, end) touch."""
        last = cdiv(end, self.block_size)
        shared = sum(self.blocks[block_table[i]].ref_count > 1
                     for i in range(start // self.block_size, min(len(block_table), last)))
        return max(0, last - len(block_table)) + shared

    def _take_fresh_block(self) -> int:
        if self.free_block_ids:
            block_id = self.free_block_ids.pop()
        else:  # evict the least recently used cached block: its hash goes, its memory is reused
            block_id, _ = self.evictable.popitem(last=False)
            block = self.blocks[block_id]
            del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
        self.blocks[block_id].ref_count = 1
        return block_id

    def _acquire(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.evictable[block_id]
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is None:
                self.free_block_ids.append(block_id)
            else:
                self.evictable[block_id] = None
