"""The fragments a shard owns: the fragment plan the run's first join fixes from the model's
manifest, and the state of each fragment the plan gives this shard.
"""
from __future__ import annotations

import pathlib
import threading

from diloco.services.contract.config import Config
from diloco.services.contract.fragments import Fragment, FragmentPlan, plan_for_config
from diloco.syncer.anchor_spill import AnchorSpill
from diloco.syncer.counters import Counters
from diloco.syncer.fragment_state import FragmentState
from diloco.syncer.journal import Journal, Manifest
from diloco.syncer.outer import OuterOptimizer
from diloco.syncer.refusal import Refusal


class OwnedFragments:
    """`anchor_folder`: where each fragment keeps the values of its learners' anchors that leave
    memory (syncer/anchor_spill.py); None: they are dropped."""

    def __init__(self, cfg: Config, shard_index: int, journal: Journal, counters: Counters,
                 anchor_folder: pathlib.Path | None = None):
        self.cfg, self.shard_index, self.journal = cfg, shard_index, journal
        self.counters, self.anchor_folder = counters, anchor_folder
        self._lock = threading.Lock()
        self.manifest: Manifest | None = None
        self.plan: FragmentPlan | None = None
        self.states: dict[int, FragmentState] = {}

    def fix(self, manifest: Manifest, durable: bool = False) -> None:
        """Plans the fragments of `manifest`, the first time; refuses another manifest after
        it. `durable`: read back from the journal, so not written to it again."""
        with self._lock:
            if self.manifest is not None:
                if manifest != self.manifest:
                    raise Refusal("manifest_mismatch", "FAILED_PRECONDITION",
                                  f"manifest differs from the one this run started with (this learner's model is not "
                                  f"the run's): {_difference(self.manifest, manifest)}")
                return
            try:
                plan = plan_for_config(self.cfg, manifest)
            except ValueError as error:
                raise Refusal("bad_manifest", "INVALID_ARGUMENT", f"cannot plan fragments: {error}") from None
            if not durable:
                self.journal.fix_manifest(manifest, plan.digest)
            # Readers take no lock: they must never see the plan without its fragments.
            optimizer = OuterOptimizer.of_run(self.cfg)
            self.states = {f.id: FragmentState(f, self.cfg.sync, self.cfg.syncer, optimizer,
                                               [l.id for l in self.cfg.learners], self._spill(f))
                           for f in plan.for_shard(self.shard_index)}
            self.plan, self.manifest = plan, manifest

    def _spill(self, fragment: Fragment) -> AnchorSpill | None:
        if self.anchor_folder is None:
            return None
        return AnchorSpill(self.anchor_folder / f"fragment-{fragment.id}", fragment.numel, self.counters)

    def get(self, fragment_id: int) -> FragmentState:
        if self.plan is None:
            raise Refusal("no_plan", "FAILED_PRECONDITION",
                          "no learner has joined yet, so this shard has no fragment plan")
        state = self.states.get(fragment_id)
        if state is None:
            if fragment_id < len(self.plan.fragments):
                owner = self.plan.fragments[fragment_id].shard
                message = f"fragment {fragment_id} belongs to shard {owner}, not shard {self.shard_index}"
            else:
                message = f"fragment {fragment_id} does not exist (the plan has {len(self.plan.fragments)})"
            raise Refusal("unknown_fragment", "NOT_FOUND", message)
        return state


def _difference(expected: Manifest, got: Manifest) -> str:
    for index, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            return f"tensor {index} is {b[0]!r} {list(b[1])}, expected {a[0]!r} {list(a[1])}"
    return f"{len(got)} tensors, expected {len(expected)}"
