"""Automatic prefix caching: content-addressed KV pages (pure Python, no torch).

A full page of a sequence's prefix (its prompt, then its committed canvases) is named by a hash
chained from the previous page's hash and the page's token ids; the chain's root is a salt of
everything else that changes the KV — the engine's numerics and adapter, and a request's own
extra key (media inputs hash into it). So two pages share a name only when everything before
them is the same: a request can only ever reach pages computed for its own tokens from the
start. SHA-256 (vLLM's choice): a collision would leak one request's KV into another's.

`PrefixCache` is the index: name -> the page's full-attention page and (when it still has it)
its sliding-window page. It knows which registered pages are idle (no running request holds
them): those stay cached, in least-recently-released order, until a pool needs them back.
The pools and who holds what are `engine.kv_pages`'s; this module only names and remembers.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

ROOT = b"canvas-prefix-cache-v1"


def root_hash(salt: str, extra_key: str = "") -> bytes:
    """The chain's root for an engine (`salt`: its numerics and adapter) and a request's
    `extra_key` (media hashes, or anything else a request's KV depends on beyond its tokens)."""
    return hashlib.sha256(b"\0".join([ROOT, salt.encode(), extra_key.encode()])).digest()


def chain_hashes(parent: bytes, tokens: list[int], page_size: int) -> list[bytes]:
    """The names of the full pages of `tokens` (a partial last page has none), chained from
    `parent` (the root, or the name of the page before `tokens[0]`)."""
    out = []
    for first in range(0, len(tokens) - page_size + 1, page_size):
        page = array("q", tokens[first : first + page_size]).tobytes()
        parent = hashlib.sha256(parent + page).digest()
        out.append(parent)
    return out


@dataclass(slots=True)
class CachedPage:
    """One registered page: its full-attention page and its sliding-window page, or None when
    the model has no sliding layers or that content is gone (overwritten, evicted)."""

    full: int
    sliding: int | None


class PrefixCache:
    """The name -> page index, plus the idle (evictable) pages of each pool in LRU order."""

    def __init__(self) -> None:
        self.entries: dict[bytes, CachedPage] = {}
        self.name_of_full: dict[int, bytes] = {}
        self.name_of_sliding: dict[int, bytes] = {}
        # Registered pages nobody holds, least recently released first: what eviction takes.
        self.idle_full: OrderedDict[int, None] = OrderedDict()
        self.idle_sliding: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.entries)

    def lookup(self, names: list[bytes]) -> list[CachedPage]:
        """The cached pages of the longest prefix of `names` that is all cached."""
        out = []
        for name in names:
            entry = self.entries.get(name)
            if entry is None:
                break
            out.append(entry)
        return out

    def register(self, name: bytes, full: int, sliding: int | None) -> bool:
        """Name a page that a running request holds (complete, never written again). False if
        the name is taken (another request computed the same page first: this copy stays
        private to its holder)."""
        if name in self.entries:
            return False
        self.entries[name] = CachedPage(full, sliding)
        self.name_of_full[full] = name
        if sliding is not None:
            self.name_of_sliding[sliding] = name
        return True

    def drop_sliding(self, page: int) -> None:
        """Forget that `page` holds a registered page's sliding KV (about to be overwritten or
        freed)."""
        name = self.name_of_sliding.pop(page)
        self.entries[name].sliding = None
        self.idle_sliding.pop(page, None)

    def evict_full(self) -> tuple[int, int | None]:
        """Forget the least recently released idle full page; returns it and, when its entry
        still had a sliding page that nobody holds, that page too (both are free now)."""
        page, _ = self.idle_full.popitem(last=False)
        entry = self.entries.pop(self.name_of_full.pop(page))
        sliding = entry.sliding
        if sliding is None:
            return page, None
        del self.name_of_sliding[sliding]
        if sliding in self.idle_sliding:  # nobody holds it: freed with its entry
            del self.idle_sliding[sliding]
            return page, sliding
        return page, None  # still in a running sequence's ring: it stays there

    def evict_sliding(self, keep: frozenset[int] = frozenset()) -> int | None:
        """Forget the least recently released idle sliding page not in `keep`; None if none."""
        for page in self.idle_sliding:
            if page not in keep:
                self.drop_sliding(page)
                return page
        return None

    def clear(self) -> tuple[list[int], list[int]]:
        """Forget every name; returns the idle pages (full, sliding), which are free now.
        Pages that running requests hold stay theirs, private from now on."""
        freed = list(self.idle_full), list(self.idle_sliding)
        self.__init__()  # type: ignore[misc]
        return freed
