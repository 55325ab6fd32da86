"""Where a request goes among data-parallel engines: to an engine whose prefix cache already holds
its prompt's first blocks, while that keeps the load balanced. `assign` places a batch of
requests at once (`LLM`'s steps), `pick_engine` one arriving alone (the server's); both read
the prefix keys (`prefix_keys`) that `PrefixHomes` remembers by engine."""
from collections import OrderedDict

from asynct.engine.block_manager import NO_HASH, chain_hash

MAX_HOMES = 1 << 18   # prefix keys remembered for routing (a key: a prompt's first j blocks)


def prefix_keys(ids: list[int], block_size: int) -> list[bytes]:
    """One key per full KV block of the prompt (what the engine's prefix cache holds once the
    prompt has run, its last block too when the prompt fills it), the j-th naming the prompt's
    first j blocks: the block manager's own chain hashes, so prompts share a key exactly where
    they share their blocks. A lookup may match a block that the prompt's own last token keeps
    from being served; the engine holding it holds all the blocks before it."""
    keys, h = [], NO_HASH
    for j in range(len(ids) // block_size):
        h = chain_hash(h, ids[j * block_size:(j + 1) * block_size])
        keys.append(h)
    return keys


class PrefixHomes:
    """The engines whose prefix caches got each prefix key, so that a later request sharing it
    (a question's other choices, say) goes where its blocks are cached while that keeps the load
    balanced. The oldest keys are forgotten."""

    def __init__(self, limit: int = MAX_HOMES):
        self.limit, self.engines = limit, OrderedDict()

    def remember(self, keys: list[int], engine: int):
        """A prompt's keys (prefix_keys), all now cached on `engine`; its deepest are the first
        forgotten, its shallow ones (shared more often) the last."""
        for key in reversed(keys):
            engines = self.engines.pop(key, [])
            self.engines[key] = engines if engine in engines else engines + [engine]
        while len(self.engines) > self.limit:
            self.engines.popitem(last=False)

    def best(self, key, loads, live) -> int | None:
        """The least-loaded of the live engines holding the key (loads: by engine), if any."""
        cached = [k for k in self.engines.get(key, ()) if k in live]
        return min(cached, key=lambda k: loads[k]) if cached else None

    def held(self, keys: list[int], loads, live):
        """(key, its least-loaded live holder) for each of a prompt's keys a live engine holds,
        deepest first (lazily: the first is often all a caller needs)."""
        for key in reversed(keys):
            k = self.best(key, loads, live)
            if k is not None:
                yield key, k

    def deepest(self, keys: list[int], loads, live):
        """(the deepest of a prompt's keys a live engine holds, the least-loaded such engine),
        or (None, None)."""
        return next(self.held(keys, loads, live), (None, None))

    def holders(self, keys: list[int], loads, live) -> list[int]:
        """The least-loaded live holder of each of a prompt's keys, deepest key first, each
        engine once: where its blocks are cached, the most first."""
        return list(dict.fromkeys(k for _, k in self.held(keys, loads, live)))


def pick_engine(keys: list[int], in_flight: list[int], live: list[int], homes: PrefixHomes) -> int:
    """The engine for one request arriving alone (the server's): of the live engines holding a
    prefix of it, the deepest such prefix whose least-loaded holder has at most a quarter of the
    mean load (at least one request) more in flight than the least-loaded engine of all; else
    that least-loaded engine, which then holds the prefix too: a prefix every request shares ends
    up cached everywhere, balanced."""
    least = min(live, key=lambda k: in_flight[k])
    slack = max(1, sum(in_flight[k] for k in live) // (4 * len(live)))
    within = [k for k in live if in_flight[k] <= in_flight[least] + slack]
    _, home = homes.deepest(keys, in_flight, within)
    k = least if home is None else home
    homes.remember(keys, k)
    return k


def assign(works: list[int], keys: list, loads: list[int], homes: dict | None = None) -> list[int]:
    """An engine (index into `loads`, their work in flight) per request: the requests of one key
    go to one engine, unless together they are more than an engine's share of all the work (one
    shared few-shot prefix, say), then in shares of about that size; the largest piece first, each
    to the first of its key's home engines (`homes`: the engines holding the key's deepest
    cached prefix, then those holding shallower ones) that stays within the share (or is as
    little loaded as any), else to the least-loaded."""
    share = (sum(loads) + sum(works)) / len(loads)
    groups: dict = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    pieces = []
    for members in groups.values():
        piece, work = [], 0
        for i in members:
            if piece and work + works[i] > share:
                pieces.append((work, piece))
                piece, work = [], 0
            piece.append(i)
            work += works[i]
        pieces.append((work, piece))
    loads, chosen, homes = list(loads), [0] * len(works), homes or {}
    for work, piece in sorted(pieces, key=lambda p: -p[0]):
        least = min(range(len(loads)), key=lambda j: loads[j])
        fits = (k for k in homes.get(keys[piece[0]], ()) if loads[k] + work <= share or loads[k] <= loads[least])
        k = next(fits, least)
        loads[k] += work
        for i in piece:
            chosen[i] = k
    return chosen
