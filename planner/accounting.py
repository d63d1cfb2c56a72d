"""Where a Decoupled DiLoCo plan's time went: each learner's phases booked as badput, the work it
loses, the fleet's uptime and failures, and the PlanResult they make at the end (planner/outcome.py
keeps the ledger every mode shares)."""
from __future__ import annotations

from diloco.planner.events import VirtualClock
from diloco.planner.inputs import PlanInputs
from diloco.planner.learner_model import PEAK_WINDOW_SECONDS, Learner
from diloco.planner.outcome import Bandwidth, Ledger, PlanResult, SyncerFacts, Uptime, staleness_counts
from diloco.planner.syncer_model import SyncerModel


class RunAccounts:
    def __init__(self, inputs: PlanInputs, clock: VirtualClock, ledger: Ledger, learners: list[Learner]):
        self.inputs, self.clock, self.ledger, self.learners = inputs, clock, ledger, learners
        self.uptime = Uptime()
        self.failures = 0  # the moments a slice failed, as the data-parallel modes count them
        self._failed_at = -1.0

    def slice_failed(self, at: float) -> None:
        """Slices failing at the same moment are one failure, as the data-parallel modes see it."""
        self.failures += at != self._failed_at
        self._failed_at = at

    def lose(self, learner: Learner, seconds: float, rolled_back: bool = False) -> None:
        """Steps already counted as kept that the run will not keep (`rolled_back`: already
        taken off the learner's own step and token counts)."""
        self.ledger.kept -= seconds
        self.ledger.add("lost", seconds)
        if not rolled_back:
            learner.lost_seconds += seconds

    def enter_phase(self, learner: Learner, phase: str) -> None:
        """Ends the learner's current phase: time starting, restoring or down is badput of that name."""
        if learner.phase in ("startup", "restore", "down"):
            self.ledger.add(learner.phase, self.clock.now - learner.phase_since)
        learner.phase, learner.phase_since = phase, self.clock.now

    def training_changed(self) -> None:
        self.uptime.training(self.clock.now, any(l.training for l in self.learners))

    def result(self, syncer: SyncerModel) -> PlanResult:
        """The run's result at its end: every learner still provisioned stops here."""
        end = self.clock.now
        for learner in self.learners:
            if learner.phase == "finished":
                self.ledger.provisioned += learner.phase_since
                continue
            if learner.training and learner.blocked_since is not None:
                self.ledger.add("blocked", learner.island.share_seconds(learner.blocked_since, end))
            learner.island.stopped()
            self.enter_phase(learner, "finished")
            self.ledger.provisioned += end
        core = syncer.core
        counters = core.counters_snapshot()
        facts = SyncerFacts(int(counters["state.merged_contributions"]), int(counters.get("rounds.all", 0)),
                            int(counters.get("rounds.quorum_grace", 0)),
                            sum(s.version for s in core.fragments.values()),
                            int(counters.get("contributions.refused_stale", 0)))
        kept_tokens = sum(l.tokens - l.lost_seconds / l.step_seconds * l.tokens_per_step for l in self.learners)
        failure_free = sum(l.tokens_per_step / l.step_seconds for l in self.learners)
        return PlanResult("diloco", self.inputs.chips, len(self.learners), end, self.ledger.goodput(),
                          self.uptime.share(end), round(kept_tokens), failure_free, self.failures,
                          self._bandwidth(end), staleness_counts(syncer.staleness, syncer.refused_stale), facts,
                          slices=self.inputs.slices_per_learner)

    def _bandwidth(self, end: float) -> Bandwidth:
        links = [(l.up, l.down) for l in self.learners]
        total = sum(up.bytes_total + down.bytes_total for up, down in links)
        peak = max((up.bytes_by_window[w] + down.bytes_by_window[w] for up, down in links
                    for w in set(up.bytes_by_window) | set(down.bytes_by_window)), default=0)
        return Bandwidth(total * 8 / 1e9 / end / len(links) if end else 0.0,
                         peak * 8 / 1e9 / PEAK_WINDOW_SECONDS, total, sum(up.bytes_total for up, _ in links),
                         sum(down.bytes_total for _, down in links))
