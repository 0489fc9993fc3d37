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

With prefix caching (`engine.prefix_cache`), a sequence's complete prefix pages are registered
under their content's name as soon as they are computed. Full pages are shared by reference
(counted: `refs`); a sequence that finds its prompt's first pages cached starts after them. A
sliding page is never shared: an admitted sequence takes the window before its reuse point into
its own ring — an idle cached page as it is, one that another ring holds as a copy
(`CacheHit.copies`) — and a registered sliding page that a ring is about to overwrite is
swapped for a fresh one first (`before_write`), so its content stays cached. Registered pages
nobody holds are *idle*: still cached, taken back (least recently released first) when a pool
runs out of free pages. Per pool: free + held + idle = capacity.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.prefix_cache import PrefixCache


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


@dataclass(slots=True, eq=False)
class PageTables:
    """A sequence's page tables: logical page index -> physical page, per pool. `version`
    changes whenever a table does (a ring slot's page swapped, the pages released), so a copy
    of the tables made at one version (the runner's device tables) knows when it is stale."""

    full: list[int]
    ring: list[int]
    num_logical: int
    _sliding: list[int] | None = None
    version: int = 0

    def sliding(self) -> list[int]:
        """The sliding pool's table, logical page -> ring slot."""
        if self._sliding is None:
            ring = self.ring
            self._sliding = [ring[i % len(ring)] for i in range(self.num_logical)] if ring else []
        return self._sliding

    def set_ring_page(self, slot: int, page: int) -> None:
        self.ring[slot] = page
        self._sliding = None
        self.version += 1


@dataclass(frozen=True, slots=True)
class CacheHit:
    """What admission found cached for a sequence: the full pages of its first `num_pages`
    logical pages (shared), and (logical page, cached sliding page) for each page of the
    sliding window before them (taken into the sequence's own ring, or copied there)."""

    full: tuple[int, ...]
    window: tuple[tuple[int, int], ...]

    @property
    def num_pages(self) -> int:
        return len(self.full)

    def copies(self, tables: PageTables) -> list[tuple[int, int]]:
        """(source, destination) sliding pages that give `tables`' ring the window (the
        pages it took as they are need none)."""
        ring = tables.ring
        slots = [(src, ring[logical % len(ring)]) for logical, src in self.window]
        return [(src, dst) for src, dst in slots if src != dst]


class KVPages:
    """Both pools, admission (can a sequence of this context be admitted now?) and, when
    `prefix_caching`, the prefix cache over them."""

    def __init__(
        self,
        geometry: PageGeometry,
        num_full_pages: int,
        num_sliding_pages: int,
        prefix_caching: bool = False,
    ) -> None:
        self.geometry = geometry
        self.full = IdPool(num_full_pages if geometry.has_full else 0)
        self.sliding = IdPool(num_sliding_pages if geometry.has_sliding else 0)
        # Content names need full pages to hang on: a model without full layers never caches.
        self.cache = PrefixCache() if prefix_caching and geometry.has_full else None
        self.refs: dict[int, int] = {}  # full page -> running sequences holding it

    def fits_ever(self, context: int) -> bool:
        """Whether an empty cache could hold a sequence of `context` positions."""
        g = self.geometry
        return (
            g.full_pages(context) <= self.full.num_pages
            and g.sliding_ring(context) <= self.sliding.num_pages
        )

    # -- admission ------------------------------------------------------------------------------

    def find(
        self, names: list[bytes], num_prompt: int, spans: Sequence[tuple[int, int]] = ()
    ) -> CacheHit | None:
        """The longest usable cached prefix of a prompt whose full pages are `names`: at most
        `num_prompt - 1` positions (the last prompt position is always computed: it may be
        sampled), ending inside none of the position `spans` (images computed in one pass),
        and on a model with sliding layers only as far as the window before it is cached too.
        None when nothing is."""
        if self.cache is None or not names:
            return None
        g = self.geometry
        found = self.cache.lookup(names[: (num_prompt - 1) // g.page_size])
        for num in range(len(found), 0, -1):
            if any(first < num * g.page_size <= last for first, last in spans):
                continue
            first = max(0, num * g.page_size - (g.sliding_window - 1)) // g.page_size
            window = [(j, found[j].sliding) for j in range(first, num)] if g.has_sliding else []
            if all(src is not None for _, src in window):
                full = tuple(page.full for page in found[:num])
                return CacheHit(full, tuple(window))  # type: ignore[arg-type]
        return None

    def can_allocate(self, context: int, hit: CacheHit | None = None) -> bool:
        """Whether a sequence of `context` positions (reusing `hit`) can be admitted now. A
        hit never needs more than no hit: its idle pages are its own."""
        g, cache = self.geometry, self.cache
        need_full, need_sliding = g.full_pages(context), g.sliding_ring(context)
        idle_full = idle_sliding = 0
        if cache is not None:
            idle_full, idle_sliding = len(cache.idle_full), len(cache.idle_sliding)
            if hit is not None:
                need_full -= hit.num_pages
                idle_full -= sum(1 for p in hit.full if p in cache.idle_full)
                taken = sum(1 for _, p in hit.window if p in cache.idle_sliding)
                need_sliding, idle_sliding = need_sliding - taken, idle_sliding - taken
        return (
            need_full <= self.full.num_free + idle_full
            and need_sliding <= self.sliding.num_free + idle_sliding
        )

    def allocate(self, context: int, hit: CacheHit | None = None) -> PageTables:
        """The page tables of a sequence of `context` positions: the hit's pages (shared) then
        fresh ones, taken from the free pages first, then from idle cached ones. MemoryError
        (nothing taken) if they do not fit: check `can_allocate` first."""
        if not self.can_allocate(context, hit):
            raise MemoryError(f"a context of {context} positions does not fit now")
        g = self.geometry
        shared = list(hit.full) if hit is not None else []
        for page in shared:
            self._hold(page)
        fresh = self._take_full(g.full_pages(context) - len(shared))
        for page in fresh:
            self.refs[page] = 1
        size = g.sliding_ring(context)
        ring: list[int | None] = [None] * size
        window = hit.window if hit is not None else ()
        keep = frozenset(src for _, src in window)
        for logical, src in window:  # idle window pages join the ring as they are
            if self.cache is not None and src in self.cache.idle_sliding:
                del self.cache.idle_sliding[src]
                ring[logical % size] = src
        ring = [self._take_sliding(keep) if p is None else p for p in ring]
        return PageTables(shared + fresh, ring, ceil_div(context, g.page_size))  # type: ignore[arg-type]

    def _hold(self, page: int) -> None:
        self.refs[page] = self.refs.get(page, 0) + 1
        if self.cache is not None:
            self.cache.idle_full.pop(page, None)

    def _take_full(self, count: int) -> list[int]:
        short = count - self.full.num_free
        for _ in range(max(0, short)):
            assert self.cache is not None
            page, sliding = self.cache.evict_full()
            self.full.release([page])
            if sliding is not None:
                self.sliding.release([sliding])
        return self.full.allocate(count)

    def _take_sliding(self, keep: frozenset[int] = frozenset()) -> int:
        if self.sliding.num_free == 0:
            page = self.cache.evict_sliding(keep) if self.cache is not None else None
            if page is None:
                raise MemoryError("no sliding page free or idle")
            return page
        (page,) = self.sliding.allocate(1)
        return page

    # -- a running sequence ---------------------------------------------------------------------

    def register(self, tables: PageTables, names: list[bytes], first: int, computed: int) -> None:
        """Name logical pages first.. of a sequence (complete: `computed` positions have their
        KV) by `names`. A sliding page is named only while its ring still holds it."""
        if self.cache is None:
            return
        ring, size = tables.ring, self.geometry.page_size
        last = (computed - 1) // size  # the newest logical page in the ring
        for j, name in enumerate(names, first):
            sliding = ring[j % len(ring)] if ring and j > last - len(ring) else None
            self.cache.register(name, tables.full[j], sliding)

    def before_write(self, tables: PageTables, start: int, num_tokens: int) -> None:
        """A row is about to write positions [start, start + num_tokens): a ring slot it
        writes that holds a named page's sliding KV gets a fresh page (the named one stays
        cached, idle), or, when no page is free or idle, forgets that it was named."""
        cache, ring = self.cache, tables.ring
        if cache is None or not ring or num_tokens <= 0:
            return
        size = self.geometry.page_size
        for logical in range(start // size, (start + num_tokens - 1) // size + 1):
            slot = logical % len(ring)
            page = ring[slot]
            if page not in cache.name_of_sliding:
                continue
            try:
                fresh = self._take_sliding(frozenset([page]))
            except MemoryError:
                cache.drop_sliding(page)
                continue
            cache.idle_sliding[page] = None
            tables.set_ring_page(slot, fresh)

    def release(self, tables: PageTables) -> None:
        """A sequence ends: its pages go back to the free pools, except named ones, which stay
        cached (idle once nobody holds them; the tail of a sequence is taken back first)."""
        cache = self.cache
        for page in reversed(tables.full):
            held = self.refs.pop(page) - 1
            if held:
                self.refs[page] = held
            elif cache is not None and page in cache.name_of_full:
                cache.idle_full[page] = None
            else:
                self.full.release([page])
        for page in reversed(tables.ring):
            if cache is not None and page in cache.name_of_sliding:
                cache.idle_sliding[page] = None
            else:
                self.sliding.release([page])
        tables.full, tables.ring, tables._sliding = [], [], []
        tables.version += 1

    # -- the cache as a whole -------------------------------------------------------------------

    def reset_cache(self) -> int:
        """Forget every cached page (running sequences keep what they hold); returns how many
        named pages were forgotten."""
        if self.cache is None:
            return 0
        count = len(self.cache)
        full, sliding = self.cache.clear()
        self.full.release(full)
        self.sliding.release(sliding)
        return count

    def num_unheld(self) -> tuple[int, int]:
        """Pages of each pool (full, sliding) that no running sequence holds: free, or cached
        and idle."""
        idle_full, idle_sliding = self.idle_ids()
        return self.full.num_free + len(idle_full), self.sliding.num_free + len(idle_sliding)

    def idle_ids(self) -> tuple[list[int], list[int]]:
        """The idle cached pages of each pool (full, sliding), for accounting checks."""
        if self.cache is None:
            return [], []
        return list(self.cache.idle_full), list(self.cache.idle_sliding)

    def _capacity(self) -> int:
        return self.full.num_pages + self.sliding.num_pages

    def usage(self) -> float:
        """Fraction of pages held by running sequences (both pools together), 0..1; idle
        cached pages count as free (they are taken back on demand)."""
        total = self._capacity()
        if total == 0:
            return 0.0
        idle_full, idle_sliding = self.idle_ids()
        free = self.full.num_free + self.sliding.num_free + len(idle_full) + len(idle_sliding)
        return 1.0 - free / total

    def cache_usage(self) -> float:
        """Fraction of pages that are cached and idle (both pools together), 0..1."""
        total = self._capacity()
        idle_full, idle_sliding = self.idle_ids()
        return (len(idle_full) + len(idle_sliding)) / total if total else 0.0
