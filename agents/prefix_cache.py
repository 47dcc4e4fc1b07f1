"""Keys and values of sequences the HF backend decoded, kept for prompts that continue them.

A multi-turn episode's prompt at turn ``t + 1`` is its prompt at turn ``t``, the tokens generated for it, and the
next observation (``LLMAgent``'s ``"full"`` context, token-in/token-out). Without reuse every turn runs the whole
history through the model again, so an episode's prompt cost grows with the square of its turns. ``PrefixCache``
keeps, after each generation, the keys and values of ``prompt + generated[:-1]`` (the last sampled token was
never fed to the model) under those token ids; a later prompt that starts with a kept sequence runs only the
tokens after it (``StaticCacheDecoder.prefill(..., prefixes=...)``).

Validity: keys and values are a function of the weights, so the cache holds one weight state at a time
(``sync``): the backend's served version and adapter, and the version counter of every parameter tensor, which
any in-place write bumps (a loaded checkpoint, an optimizer step on a shared model). A different state empties
it.

Memory: at most ``max_bytes`` of tensors. An entry that a longer one continued (the same episode's previous
turn) is *superseded* and goes first; then the least recently used. A run whose live episodes' last turns fit
in the budget never evicts one, so which prompts hit depends on the run's calls alone, not on their timing.

Lookup is by token ids: the longest kept sequence that is a strict prefix of the prompt (a prompt needs at
least one token of its own, whose logits start its generation). Sequences are indexed by a hash chain over
blocks of ``_BLOCK`` tokens plus their tail, so a lookup costs a few hashes per distinct kept length, not the
length of every kept sequence; a candidate is compared token by token before it is used.

Only a whole kept sequence is reused, not a head shared with one (another episode's system message): a prompt's
own history is kept whatever the timing of the calls, whereas which other episodes' sequences are kept when a
prompt runs depends on the order the calls ran in, and the rest of a prompt that reused a head runs through the
explicit-mask attention, equal to the whole prompt pass to float rounding only. Shared heads made a synchronous
run's losses differ in their last bits between two runs on a loaded machine (measured); whole sequences do not.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

_BLOCK = 32


@dataclass(frozen=True)
class CachedPrefix:
    """The keys and values of ``tokens``: per layer ``[kv_heads, len(tokens), head_dim]``, rotated keys."""

    tokens: tuple[int, ...]
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


def _chain(tokens: Sequence[int], blocks: int) -> list[int]:
    """``chain[b]`` = the hash of the first ``b`` whole blocks of ``tokens`` (``chain[0]`` = 0)."""
    out = [0]
    for b in range(blocks):
        out.append(hash((out[-1], tuple(tokens[b * _BLOCK : (b + 1) * _BLOCK]))))
    return out


def _index_key(length: int, chain: list[int], tokens: Sequence[int]) -> tuple[int, int, tuple[int, ...]]:
    whole = length // _BLOCK
    return length, chain[whole], tuple(tokens[whole * _BLOCK : length])


class PrefixCache:
    """The kept sequences of one weight state (module doc). ``hits``, ``misses`` and ``reused_tokens`` count
    lookups since construction."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._state: Hashable = None
        self._live: OrderedDict[tuple[int, int, tuple[int, ...]], CachedPrefix] = OrderedDict()
        self._superseded: OrderedDict[tuple[int, int, tuple[int, ...]], CachedPrefix] = OrderedDict()
        self._lengths: dict[int, int] = {}  # kept length -> entries of that length
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.reused_tokens = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._live) + len(self._superseded)

    def sync(self, state: Hashable) -> None:
        """Empty the cache unless ``state`` (the weights' identity) is the one its entries were computed with."""
        if state != self._state:
            self.clear()
            self._state = state

    def clear(self) -> None:
        self._live.clear()
        self._superseded.clear()
        self._lengths.clear()
        self.bytes = 0

    def lookup(self, prompt: Sequence[int]) -> CachedPrefix | None:
        """The longest kept sequence that is a strict prefix of ``prompt``, or ``None``."""
        if not self._lengths:
            self.misses += 1
            return None
        candidates = sorted((n for n in self._lengths if n < len(prompt)), reverse=True)
        if candidates:
            chain = _chain(prompt, candidates[0] // _BLOCK)
            for length in candidates:
                key = _index_key(length, chain, prompt)
                for table in (self._live, self._superseded):
                    entry = table.get(key)
                    if entry is not None and entry.tokens == tuple(prompt[:length]):
                        if table is self._live:
                            table.move_to_end(key)
                        self.hits += 1
                        self.reused_tokens += length
                        return entry
        self.misses += 1
        return None

    def store(self, entry: CachedPrefix, continues: CachedPrefix | None = None) -> None:
        """Keep ``entry``; ``continues`` (the entry its prompt was found to start with) is superseded by it."""
        if continues is not None:
            old = self._key(continues.tokens)
            if old in self._live:
                self._superseded[old] = self._live.pop(old)
        size = entry.nbytes
        if size > self.max_bytes or entry.length == 0:
            return
        key = self._key(entry.tokens)
        for table in (self._live, self._superseded):
            if key in table:
                self._drop(table, key)
        self._live[key] = entry
        self._lengths[entry.length] = self._lengths.get(entry.length, 0) + 1
        self.bytes += size
        while self.bytes > self.max_bytes:
            self._drop(self._superseded if self._superseded else self._live, None)
            self.evicted += 1

    @staticmethod
    def _key(tokens: Sequence[int]) -> tuple[int, int, tuple[int, ...]]:
        return _index_key(len(tokens), _chain(tokens, len(tokens) // _BLOCK), tokens)

    def _drop(
        self,
        table: OrderedDict[tuple[int, int, tuple[int, ...]], CachedPrefix],
        key: tuple[int, int, tuple[int, ...]] | None,
    ) -> None:
        """Remove ``key`` (``None`` = the oldest) from ``table``."""
        if key is None:
            _, entry = table.popitem(last=False)
        else:
            entry = table.pop(key)
        self.bytes -= entry.nbytes
        count = self._lengths[entry.length] - 1
        if count:
            self._lengths[entry.length] = count
        else:
            del self._lengths[entry.length]
