"""The state hash of each fragment value this learner holds, computed or checked once: a pull
names its base by it (docs/protocol.md, "The downlink") and reports ask it at every checkpoint,
and hashing a large fragment is not free."""
from __future__ import annotations

import threading
import weakref

import torch

from diloco.services.contract.state import state_hash


class KnownHashes:
    """Per fragment, the last values hashed and their hashes. Two: the anchor a learner holds
    and a pulled value it has not adopted yet. Weak references: a value the learner dropped
    is not kept alive here."""
    KEPT = 2

    def __init__(self):
        self._known: dict[int, list[tuple[weakref.ref, str]]] = {}
        self._lock = threading.Lock()

    def remember(self, fragment_id: int, value: torch.Tensor, digest: str) -> None:
        """`digest` is `value`'s state hash (a pull checked it)."""
        with self._lock:
            kept = [(ref, known) for ref, known in self._known.get(fragment_id, ())
                    if ref() is not None and ref() is not value]
            self._known[fragment_id] = [(weakref.ref(value), digest)] + kept[:self.KEPT - 1]

    def of(self, fragment_id: int, value: torch.Tensor) -> str:
        """`value`'s state hash: the one known, else computed (and remembered)."""
        with self._lock:
            known = next((digest for ref, digest in self._known.get(fragment_id, ()) if ref() is value), None)
        if known is None:
            known = state_hash(value)
            self.remember(fragment_id, value, known)
        return known
