"""First-fit allocator of contiguous block runs over one byte range.

The NIXL producer registers a single DRAM buffer once (registration is costly on real
RDMA hardware) and carves embedding slots out of it with this allocator. It is plain
bookkeeping with no locking: the owner serialises calls.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


class DoubleFreeError(ValueError):
    """``free`` got an offset that is not the start of a live allocation."""


@dataclass(frozen=True)
class PoolUsage:
    """A snapshot of the allocator's occupancy, in bytes (multiples of the block size)."""

    allocations: int
    bytes_in_use: int
    bytes_free: int
    largest_free: int
    """Biggest request that would succeed right now (fragmentation shows here)."""


class BlockPool:
    """Allocates runs of ``block_bytes`` blocks inside ``[0, total_bytes)``.

    Free space is kept as sorted, coalesced ``(start_block, nblocks)`` runs; ``alloc``
    takes the first run that fits, ``free`` merges the run back with its neighbours.
    """

    def __init__(self, total_bytes: int, block_bytes: int) -> None:
        if block_bytes <= 0 or total_bytes < block_bytes:
            raise ValueError(
                f"need 0 < block_bytes <= total_bytes, got {block_bytes} and {total_bytes}"
            )
        self.block_bytes = block_bytes
        self.num_blocks = total_bytes // block_bytes
        self._free_starts: list[int] = [0]
        self._free_lens: list[int] = [self.num_blocks]
        self._allocated: dict[int, int] = {}

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def blocks_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.block_bytes))

    def alloc(self, nbytes: int) -> int | None:
        """Byte offset of a fresh run holding ``nbytes``, or ``None`` when no run fits."""
        need = self.blocks_for(nbytes)
        for i, length in enumerate(self._free_lens):
            if length >= need:
                start = self._free_starts[i]
                if length == need:
                    del self._free_starts[i]
                    del self._free_lens[i]
                else:
                    self._free_starts[i] = start + need
                    self._free_lens[i] = length - need
                self._allocated[start] = need
                return start * self.block_bytes
        return None

    def free(self, offset: int) -> int:
        """Return the run that starts at ``offset``; gives back its size in bytes."""
        start, rem = divmod(offset, self.block_bytes)
        if rem or start not in self._allocated:
            raise DoubleFreeError(f"offset {offset} is not an allocated run (double free?)")
        length = self._allocated.pop(start)
        i = bisect.bisect_left(self._free_starts, start)
        merge_prev = i > 0 and self._free_starts[i - 1] + self._free_lens[i - 1] == start
        merge_next = i < len(self._free_starts) and start + length == self._free_starts[i]
        if merge_prev and merge_next:
            self._free_lens[i - 1] += length + self._free_lens[i]
            del self._free_starts[i]
            del self._free_lens[i]
        elif merge_prev:
            self._free_lens[i - 1] += length
        elif merge_next:
            self._free_starts[i] = start
            self._free_lens[i] += length
        else:
            self._free_starts.insert(i, start)
            self._free_lens.insert(i, length)
        return length * self.block_bytes

    def usage(self) -> PoolUsage:
        free_blocks = sum(self._free_lens)
        return PoolUsage(
            allocations=len(self._allocated),
            bytes_in_use=(self.num_blocks - free_blocks) * self.block_bytes,
            bytes_free=free_blocks * self.block_bytes,
            largest_free=max(self._free_lens, default=0) * self.block_bytes,
        )
