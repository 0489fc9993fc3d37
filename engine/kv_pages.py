"""Page accounting for the paged KV cache (pure Python, no torch).

Two pools, one per attention layer type. Full-attention layers keep every position of a
sequence, so a sequence holds ceil(context / page_size) full pages. Sliding-window layers only
ever read the last `sliding_window - 1` positions, so a sequence holds a small *ring* of
sliding pages, reused as it advances: logical page i lives in ring[i % ring_size]. The ring is
large enough that the pages one pass reads (the window before its first new token) and writes
(its new tokens) never collide.

Pages are reserved for a sequence's whole context at admission (prompt plus its token budget
rounded up to whole canvases), so an admitted sequence never runs out of pages and nothing is
ever preempted; they return to the pool when it finishes or is aborted.
"""

from __future__ import annotations

from dataclasses import dataclass


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class IdPool:
    """A free list of ids [0, num_pages): KV pages, or sampler slots."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise MemoryError(f"asked for {count} pages, {len(self._free)} free")
        return [self._free.pop() for _ in range(count)]

    def release(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))

    def free_ids(self) -> list[int]:
        """A copy of the free list (for accounting checks)."""
        return list(self._free)


@dataclass(frozen=True, slots=True)
class PageGeometry:
    """What the pools look like: page size, the window, and the largest pass."""

    page_size: int
    sliding_window: int
    max_pass_tokens: int  # the most new tokens one row may carry (prefill chunk or canvas)
    has_full: bool
    has_sliding: bool

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")

    def full_pages(self, context: int) -> int:
        return ceil_div(context, self.page_size) if self.has_full else 0

    def sliding_ring(self, context: int) -> int:
        """Ring size for a sequence of `context` positions: the pages spanned by a window of
        `sliding_window - 1` read positions plus one pass of new tokens, plus one for alignment."""
        if not self.has_sliding:
            return 0
        span = ceil_div(self.sliding_window - 1 + self.max_pass_tokens, self.page_size) + 1
        return min(span, ceil_div(context, self.page_size))


@dataclass(slots=True)
class PageTables:
    """A sequence's page tables: logical page index -> physical page, per pool."""

    full: list[int]
    ring: list[int]
    num_logical: int
    _sliding: list[int] | None = None

    def sliding(self) -> list[int]:
        """The sliding pool's table, logical page -> ring slot."""
        if self._sliding is None:
            ring = self.ring
            self._sliding = [ring[i % len(ring)] for i in range(self.num_logical)] if ring else []
        return self._sliding


class KVPages:
    """Both pools plus admission: can a sequence of this context be admitted now?"""

    def __init__(self, geometry: PageGeometry, num_full_pages: int, num_sliding_pages: int) -> None:
        self.geometry = geometry
        self.full = IdPool(num_full_pages if geometry.has_full else 0)
        self.sliding = IdPool(num_sliding_pages if geometry.has_sliding else 0)

    def fits_ever(self, context: int) -> bool:
        """Whether an empty cache could hold a sequence of `context` positions."""
        g = self.geometry
        return (
            g.full_pages(context) <= self.full.num_pages
            and g.sliding_ring(context) <= self.sliding.num_pages
        )

    def can_allocate(self, context: int) -> bool:
        g = self.geometry
        return (
            g.full_pages(context) <= self.full.num_free
            and g.sliding_ring(context) <= self.sliding.num_free
        )

    def allocate(self, context: int) -> PageTables:
        g = self.geometry
        return PageTables(
            full=self.full.allocate(g.full_pages(context)),
            ring=self.sliding.allocate(g.sliding_ring(context)),
            num_logical=ceil_div(context, g.page_size),
        )

    def release(self, tables: PageTables) -> None:
        self.full.release(tables.full)
        self.sliding.release(tables.ring)
        tables.full, tables.ring, tables._sliding = [], [], []

    def usage(self) -> float:
        """Fraction of pages in use (both pools together), 0..1."""
        total = self.full.num_pages + self.sliding.num_pages
        if total == 0:
            return 0.0
        return 1.0 - (self.full.num_free + self.sliding.num_free) / total
