"""A restart: the core adopts what its journal read back, each fragment's last state written in
full, then its log replayed with the same arithmetic as the first time, so that it reaches the
same bits (syncer/store.py says why nothing acknowledged is lost).
"""
from __future__ import annotations

import logging

from diloco.services.contract.state import same_state
from diloco.services.contract.wire import pb
from diloco.syncer.admission import Admission
from diloco.syncer.claims import ClaimBounds
from diloco.syncer.counters import Counters
from diloco.syncer.fragment_state import FragmentState
from diloco.syncer.journal import LoggedClose, LoggedContribution, Restored
from diloco.syncer.owned import OwnedFragments
from diloco.syncer.refusal import Refusal

log = logging.getLogger(__name__)


class JournalReplay:
    def __init__(self, owned: OwnedFragments, admission: Admission, claims: ClaimBounds, counters: Counters):
        self.owned, self.admission, self.claims, self.counters = owned, admission, claims, counters

    def restore(self, restored: Restored) -> None:
        """Adopts the manifest, each fragment's last state written in full, then its log:
        contributions re-admitted and rounds closed again, in their original order."""
        if restored.manifest is None:
            return
        self.owned.fix(restored.manifest, durable=True)
        plan = self.owned.plan
        if plan.digest != restored.plan_digest:
            raise ValueError(f"the stored state was written under fragment plan {restored.plan_digest[:12]}, "
                             f"this config makes plan {plan.digest[:12]}: sync settings or shards changed")
        for fid, snapshot in restored.snapshots.items():
            state = self.owned.get(fid)
            state.restorable = False
            if snapshot.value.numel() != state.fragment.numel:
                raise ValueError(f"fragment {fid}: stored state has {snapshot.value.numel()} elements, "
                                 f"the plan {state.fragment.numel}")
            state.install(snapshot)
        for fid, entries in restored.log.items():
            self._replay(self.owned.get(fid), entries)

    def _replay(self, state: FragmentState, entries: list[LoggedContribution | LoggedClose]) -> None:
        snapshot_version = state.version
        for entry in entries:
            round_number = entry.closed.round if isinstance(entry, LoggedClose) else entry.round
            if state.committed is None or round_number != state.round.number:
                raise ValueError(f"fragment {state.id}: journal holds a record of round {round_number}, "
                                 f"but the open round is {state.round.number}")
            if isinstance(entry, LoggedClose):
                committed = state.committed
                if not same_state(committed.value, committed.state_hash, entry.base_state_hash):
                    raise ValueError(f"fragment {state.id}: replaying the journal reached version {state.version} "
                                     f"with state hash {state.committed.state_hash[:16]}, but round "
                                     f"{round_number} closed on {entry.base_state_hash[:16]}")
                state.close(entry.closed)
                self.counters.add("replayed_rounds")
                continue
            header = self._in_range(state.id, entry.header)
            self.admission.admit(state, header, entry.payload, state.version - header.base_version, 0.0)
            self.counters.add("contributions.restored")
        log.info("fragment %d: restored version %d: snapshot of version %d, %d rounds replayed from the log, "
                 "%d contributions in the open round", state.id, state.version, snapshot_version,
                 state.version - snapshot_version, state.round.count)

    def _in_range(self, fragment_id: int, header: pb.PushHeader) -> pb.PushHeader:
        """A logged contribution was acknowledged: one whose claims are out of range (logged
        before they were checked, or under a larger bound) is merged with them clamped."""
        try:
            self.claims.check_push(header)
            return header
        except Refusal as refusal:
            log.warning("fragment %d: round.log holds learner %r's contribution from base version %d with a "
                        "claim out of range (%s): merging it with its claims clamped", fragment_id,
                        header.learner_id, header.base_version, refusal.message)
            self.counters.add("contributions.clamped")
            return self.claims.clamped(header)
