"""A small model of PyTorch's CUDA caching allocator, replayed over a dry run's allocations and frees.

A dry run counts the bytes its tensors ask for (*requested*: the sum of their storages' sizes). On a GPU the
allocator hands out blocks cut from segments it reserves from the driver, and keeps freed blocks cached for reuse, so
``torch.cuda.max_memory_allocated`` (*allocated*: the blocks handed out) and ``torch.cuda.max_memory_reserved``
(*reserved*: the segments held) are larger. :func:`replay` feeds the sequence of a dry run (each storage's bytes when it
is allocated, and which storage is freed when) through :class:`CachingAllocator`, which follows the rules of
``c10/cuda/CUDACachingAllocator.cpp`` with its default settings:

- A request is rounded up to a multiple of :data:`MIN_BLOCK` (512 B); a zero-byte request takes no block.
- Rounded requests up to :data:`SMALL_SIZE` (1 MiB) go to the small pool, larger ones to the large pool.
- A cached (free) block of the request's pool is reused where one is large enough: the smallest such block (best fit,
  the lower segment and offset on ties).
- Without one, a new segment is reserved: :data:`SMALL_BUFFER` (2 MiB) for the small pool, :data:`LARGE_BUFFER`
  (20 MiB) for a request under :data:`MIN_LARGE_ALLOC` (10 MiB), else the request rounded up to a multiple of
  :data:`ROUND_LARGE` (2 MiB).
- The block found or made is split where the remainder is worth keeping: in the small pool a remainder of at least
  512 B, in the large pool only a remainder over 1 MiB. Otherwise the request takes the whole block, and *allocated*
  counts the whole block (an 11 MiB request takes all of a 12 MiB segment).
- A freed block goes back to its pool, merged with its free neighbours in the same segment. Segments are never given
  back: nothing here calls ``empty_cache``, and the device has no capacity, so the allocator never frees its cache to
  retry a request (on a nearly full GPU it does, and *reserved* can then be lower than modelled).

Not modelled: expandable segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, which grows one segment per
stream instead), ``max_split_size_mb``, ``roundup_power2_divisions`` and ``garbage_collection_threshold`` (all off by
default), several streams (every block here is on one stream, and no block waits for another stream's events), CUDA
graphs' private pools, and memory outside the allocator: the CUDA context (a few hundred MiB per process), cuDNN's and
other libraries' own allocations, and what another process holds.

Examples:
    >>> MiB = 2**20
    >>> peaks = replay([("+", 1, 1000), ("+", 2, 3 * MiB), ("-", 1, 1000), ("+", 3, 700)])
    >>> peaks.requested, peaks.allocated, peaks.reserved  # 1000 B takes 1024 B of a 2 MiB small segment
    (3146728, 3146752, 23068672)
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable
from dataclasses import dataclass

#: Every block is a multiple of this many bytes (``kMinBlockSize``).
MIN_BLOCK = 512
#: The largest request of the small pool (``kSmallSize``), also the remainder a large block must exceed to be split.
SMALL_SIZE = 1 << 20
#: The segment the small pool reserves (``kSmallBuffer``).
SMALL_BUFFER = 2 << 20
#: The segment a large request under :data:`MIN_LARGE_ALLOC` reserves (``kLargeBuffer``).
LARGE_BUFFER = 20 << 20
#: From this size a large request reserves a segment of its own size, rounded to :data:`ROUND_LARGE`
#: (``kMinLargeAlloc``).
MIN_LARGE_ALLOC = 10 << 20
#: A segment of its own is rounded up to a multiple of this (``kRoundLarge``).
ROUND_LARGE = 2 << 20

#: One event of a dry run: ``("+", key, nbytes)`` when a storage of ``nbytes`` is allocated, ``("-", key, nbytes)``
#: when the storage ``key`` is freed.
Event = tuple[str, int, int]


def round_size(nbytes: int) -> int:
    """The block a request of ``nbytes`` asks for: at least 512 B, a multiple of 512 B.

    Examples:
        >>> round_size(1), round_size(512), round_size(513)
        (512, 512, 1024)
    """
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(size: int) -> int:
    """The segment reserved for a rounded request of ``size`` bytes when no cached block fits it.

    Examples:
        >>> MiB = 2**20
        >>> [segment_size(n) // MiB for n in (512, MiB, MiB + 512, 10 * MiB - 512, 10 * MiB, 11 * MiB)]
        [2, 2, 20, 20, 10, 12]
    """
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class _Block:
    """A stretch of one segment, handed out or cached; its neighbours in the segment are ``prev`` and ``next``."""

    __slots__ = ("segment", "offset", "size", "small", "free", "prev", "next")

    def __init__(self, segment: int, offset: int, size: int, small: bool) -> None:
        self.segment, self.offset, self.size, self.small = segment, offset, size, small
        self.free = False
        self.prev: _Block | None = None
        self.next: _Block | None = None

    def key(self) -> tuple[int, int, int]:  # the order of a pool's cached blocks: size, then place
        return (self.size, self.segment, self.offset)


@dataclass
class AllocatorPeaks:
    """The peaks of one replay, in bytes.

    Attributes:
        requested: The most bytes the storages alive at once asked for (the dry run's own figure).
        allocated: The most bytes in blocks handed out at once (``max_memory_allocated``): each request rounded up to
            512 B, or the whole cached block it took where the remainder was not split off.
        reserved: The most bytes in segments (``max_memory_reserved``); segments are never released, so this is the
            bytes reserved at the end.
        segments: How many segments were reserved.
    """

    requested: int = 0
    allocated: int = 0
    reserved: int = 0
    segments: int = 0


class CachingAllocator:
    """The caching allocator's blocks and segments on one device and one stream (see the module's docstring).

    Examples:
        >>> allocator = CachingAllocator()
        >>> allocator.malloc("a", 100), allocator.malloc("b", 600)
        (512, 1024)
        >>> allocator.free("a"); allocator.malloc("c", 200)  # the freed 512 B block is reused
        512
        >>> allocator.peaks.allocated, allocator.peaks.reserved
        (1536, 2097152)
    """

    def __init__(self) -> None:
        self.peaks = AllocatorPeaks()
        self.requested = self.allocated = self.reserved = 0  # now
        self._cached: dict[bool, list[tuple[tuple[int, int, int], _Block]]] = {True: [], False: []}  # by small
        self._live: dict[object, tuple[_Block, int]] = {}  # key -> its block and the bytes it requested
        self._segments = itertools.count()

    def malloc(self, key: object, nbytes: int) -> int:
        """Allocate ``nbytes`` for ``key``; returns the bytes of the block handed out (0 for a zero-byte request)."""
        if key in self._live:
            raise ValueError(f"{key!r} is allocated already")
        if nbytes <= 0:
            return 0
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._take_cached(size, small)
        if block is None:  # a new segment, as cudaMalloc gives it
            total = segment_size(size)
            block = _Block(next(self._segments), 0, total, small)
            self.reserved += total
            self.peaks.segments += 1
            self.peaks.reserved = max(self.peaks.reserved, self.reserved)
        remainder = block.size - size
        if remainder >= MIN_BLOCK if small else remainder > SMALL_SIZE:
            rest = _Block(block.segment, block.offset + size, remainder, small)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._cache(rest)
        self._live[key] = (block, nbytes)
        self.requested += nbytes
        self.allocated += block.size
        self.peaks.requested = max(self.peaks.requested, self.requested)
        self.peaks.allocated = max(self.peaks.allocated, self.allocated)
        return block.size

    def free(self, key: object) -> None:
        """Free ``key``'s block: back to its pool, merged with the free blocks beside it. A key never allocated (a
        zero-byte request) is ignored."""
        found = self._live.pop(key, None)
        if found is None:
            return
        block, nbytes = found
        self.requested -= nbytes
        self.allocated -= block.size
        for side in (block.prev, block.next):
            if side is not None and side.free:
                self._uncache(side)
                if side is block.prev:  # side absorbs block
                    side.size += block.size
                    side.next = block.next
                    if block.next is not None:
                        block.next.prev = side
                    block = side
                else:  # block absorbs side
                    block.size += side.size
                    block.next = side.next
                    if side.next is not None:
                        side.next.prev = block
        self._cache(block)

    def _cache(self, block: _Block) -> None:
        block.free = True
        bisect.insort(self._cached[block.small], (block.key(), block))

    def _uncache(self, block: _Block) -> None:
        pool = self._cached[block.small]
        del pool[bisect.bisect_left(pool, block.key(), key=lambda item: item[0])]
        block.free = False

    def _take_cached(self, size: int, small: bool) -> _Block | None:
        pool = self._cached[small]
        index = bisect.bisect_left(pool, (size, -1, -1), key=lambda item: item[0])
        if index == len(pool):
            return None
        block = pool.pop(index)[1]
        block.free = False
        return block


def replay(events: Iterable[Event]) -> AllocatorPeaks:
    """The allocator's peaks over ``events`` (:data:`Event`, in order), starting from an empty allocator.

    A storage alive before the dry run's step (weights, gradients, optimizer state, the batch) comes first in the
    events, in the order it was counted, as if allocated in that order into an empty cache: the cache a real process
    has built up by then (its earlier steps' freed blocks) is not known, so *reserved* is that of a first step
    reaching this one's peak.
    """
    allocator = CachingAllocator()
    for sign, key, nbytes in events:
        if sign == "+":
            allocator.malloc(key, nbytes)
        else:
            allocator.free(key)
    return allocator.peaks
