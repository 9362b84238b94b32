"""Pins a resumed session's state holds until its turn is admitted.

A paused session whose state is on the device (kept, or prefetched back)
holds a pin on its radix path. If the resume let go of it at once, the
blocks would turn cold while the turn waits in the queue: the admission
ceiling counts a match's cold blocks as new (admitting makes them active),
so the turn would wait longer, and LRU could evict what was kept or
prefetched. So the resume hands its pin over here, and the scheduler lets
go of it once a request's match locks the same path (the node is held by
more than the pin: the turn was admitted), or the owner cancels it (the
session's turn ended, it paused again or closed). Under the ceiling the
holds of turns other than the queue head's yield (as unpinned state did),
so waiting turns' state cannot keep the head out.

Shared by the engine's SessionManager and the simulator's PauseController,
which both drive the real Scheduler and KVCacheManager."""
from __future__ import annotations

from trajserve.kv.radix_cache import RadixCache, RadixNode


class AdmissionHolds:
    def __init__(self, radix: RadixCache) -> None:
        self.radix = radix
        self._held: dict[int, tuple[object, RadixNode]] = {}  # id(owner) -> (owner, pinned node)
        self.num_yielded = 0  # holds let go under the ceiling before their turn was admitted

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, owner: object, node: RadixNode) -> None:
        """Take over owner's pin on node (a lock made with KVCacheManager.pin)."""
        self.cancel(owner)
        self._held[id(owner)] = (owner, node)

    def cancel(self, owner: object) -> bool:
        """Let go of owner's pin now; False if it held none."""
        got = self._held.pop(id(owner), None)
        if got is not None:
            self.radix.unlock(got[1])
        return got is not None

    def release_admitted(self) -> int:
        """After admissions: let go of the pins whose path a request now
        locks too (ref_count above the pin's own 1). How many went."""
        return self._release([k for k, (_, node) in self._held.items() if node.ref_count > 1 or node.detached])

    def yield_except(self, node: RadixNode | None) -> int:
        """The queue head is over the ceiling: let go of every hold but the
        ones on the head's matched path (ancestors of node, node included)."""
        path = set()
        while node is not None:
            path.add(id(node))
            node = node.parent
        n = self._release([k for k, (_, held) in self._held.items() if id(held) not in path])
        self.num_yielded += n
        return n

    def release_all(self) -> int:
        """Nothing can run: every held pin goes (its turn recomputes what is evicted)."""
        return self._release(list(self._held))

    def _release(self, keys: list[int]) -> int:
        for k in keys:
            self.radix.unlock(self._held.pop(k)[1])
        return len(keys)
