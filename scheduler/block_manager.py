"""Paged KV block manager: reference-counted blocks plus a prefix cache keyed by chained block hashes.

A full block's hash covers its tokens and, through the parent hash, every token before it, so
a hit on block i means the whole prefix up to block i is identical (token ids are compared too,
so a hash collision can never hand out wrong KV). A freed block keeps its hash and content until
it is reused, so later requests can still hit it; free blocks are reused least recently freed first.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from engine.request import Request


def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """64-bit hash of a block's tokens chained to its parent block's hash.

    The same in every process and Python version (Python's own `hash` of a tuple holding None is
    not, before 3.12), so a hash can name a block's content across instances. blake2b is in the
    standard library and fast enough for one block of ids at a time."""
    h = hashlib.blake2b(digest_size=8)
    h.update(b"root" if parent is None else parent.to_bytes(8, "little"))
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.num_hit_blocks = 0  # prefix-cache hits handed out, for metrics and tests

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ----------------------------------------------------------------------

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks holding a cached prefix of the request (full blocks only).

        At least one token is always left to compute, so the request still produces logits (or, for
        a resumed request on P, still runs the step that completes its KV).
        """
        if not self.enable_prefix_caching:
            return []
        tokens = request.all_token_ids
        max_blocks = (request.num_tokens_to_compute - 1) // self.block_size
        hits: list[int] = []
        parent: int | None = None
        for i in range(max_blocks):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            h = chain_hash(parent, chunk)
            block = self.hash_to_block.get(h)
            if block is None or self.block_tokens[block] != chunk:
                break
            hits.append(block)
            parent = h
        return hits

    def cache_full_blocks(self, request: Request) -> None:
        """Register every block whose tokens are now all computed, so others can reuse it."""
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        parent = request.block_hashes[-1] if request.block_hashes else None
        for i in range(len(request.block_hashes), num_full):
            chunk = tuple(request.all_token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = chain_hash(parent, chunk)
            request.block_hashes.append(h)
            block = request.block_ids[i]
            if h not in self.hash_to_block and self.block_hash[block] is None:
                self.block_hash[block] = h
                self.block_tokens[block] = chunk
                self.hash_to_block[h] = block
            parent = h

    def reset_prefix_cache(self) -> None:
        """Forget every cached block no request holds (vLLM's reset_prefix_cache)."""
        for block in self.free:
            if self.block_hash[block] is not None:
                del self.hash_to_block[self.block_hash[block]]
                self.block_hash[block] = None
                self.block_tokens[block] = None

    # -- allocation ------------------------------------------------------------------------

    def allocate(self, request: Request, num_new_tokens: int,
                 cached_blocks: list[int] | None = None) -> list[int] | None:
        """Give `request` blocks for num_computed + num_new_tokens tokens.

        `cached_blocks` (on admission) are prefix-cache hits that become the request's first
        blocks. Returns the newly added block ids, or None (and changes nothing) if memory is short.
        """
        cached_blocks = cached_blocks or []
        have = len(request.block_ids) + len(cached_blocks)
        total_tokens = request.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        need = max(0, self.blocks_needed(total_tokens) - have)
        # Cached blocks that are currently free are taken out of the free pool too.
        revived = sum(1 for b in cached_blocks if self.ref_count[b] == 0)
        if need + revived > len(self.free):
            return None
        self.num_hit_blocks += len(cached_blocks)
        for b in cached_blocks:
            if self.ref_count[b] == 0:
                del self.free[b]
            self.ref_count[b] += 1
        fresh = [self._take_free_block() for _ in range(need)]
        added = cached_blocks + fresh
        request.block_ids.extend(added)
        return added

    def _take_free_block(self) -> int:
        block, _ = self.free.popitem(last=False)
        if self.block_hash[block] is not None:  # evict its old cached content
            del self.hash_to_block[self.block_hash[block]]
            self.block_hash[block] = None
            self.block_tokens[block] = None
        self.ref_count[block] = 1
        return block

    def free_request(self, request: Request) -> None:
        self.free_blocks(request.block_ids)
        request.block_ids = []
        request.block_hashes = []

    def free_blocks(self, block_ids: list[int]) -> None:
        # Tail blocks first: they are the least likely to be shared, so evict them first.
        for b in reversed(block_ids):
            self.ref_count[b] -= 1
            assert self.ref_count[b] >= 0, f"block {b} freed twice"
            if self.ref_count[b] == 0:
                self.free[b] = None
