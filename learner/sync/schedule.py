"""The learner's decisions, with no I/O: when each fragment syncs, when and how its result is
applied, when the schedule holds, and when the run is over.

With H = sync.interval_steps, P = sync.fragments, tau = sync.overlap_steps, alpha =
sync.mix_alpha and t_p the offset of fragment p in the plan:

    start      after inner step t when (t + sync_offset) % H == t_p, unless a sync of p is
               in flight or the schedule holds (a held step: hold -= 1, sync_offset -= 1)
    apply at   step t + tau; the training thread waits for the result there, tau = 0 as long
               as it takes, else at most max_block_seconds per sync in all, and at most
               max_block_steps times its step time where that is set (not at all with
               wait_for_own_link false while its own transfers outlast the overlap: own >=
               tau, below); a result still out is late: the fragment and its counters are
               kept as they are at that moment
    merge      anchor <- g,  theta <- alpha * theta_at_apply + (1 - alpha) * g
                                      (+ theta - theta_at_apply for a late result)
    counters   c_steps, c_tokens: reset by an applied result; a late one keeps what was
               trained since its apply step (the next outer gradient carries those steps)
    own link   own = 2 * (a push's upload seconds) / step seconds, a moving average: the steps
               one sync's own transfers take (its pull carries about a push's bytes)
    phase      lead = steps trained past the apply step + steps the wait was worth
                      - steps held since the sync started - max(0, own - tau)
               or, where larger, floor((early - grace) / step time) - 1 - steps held since
                      the start (early: how long its push waited in its round for the others';
                      grace: syncer.grace.seconds where K < M, what the round may wait anyway)
               hold = max(hold, min(lead, H // (2P)))
    done       a fragment none of whose syncs is in flight, and whose next start (held
               steps only delay it) comes too late for its apply step to be within
               trainer.max_steps: its last contribution comes at the end of training, and
               heartbeats report it skipped so that no round waits for it meanwhile
    budget     run_tokens = own tokens + the others' heard tokens
                            + the others' heard rate * (now - heard at)
               the run is over once run_tokens >= trainer.max_run_tokens (own tokens are
               exact; the others' rates are one step's, so only their part is a guess)

A result is late because the others reached its round after this learner did: holding the
schedule for the lead lets this learner's syncs fall back into phase with theirs instead of
waiting at every round. The cap keeps one very late round (a member that died holds it for
its lease) from stopping this learner syncing. Or it is late because this learner's own link
is slow: holding would push its syncs later still, so that part is no lead; and waiting
only idles it (its result cannot come sooner), so a run may choose (wait_for_own_link false)
to merge its results late instead, keeping the steps trained meanwhile, while the staleness
rules take its contributions as they come.

Time comes from an injected clock. Everything is called from the training thread, except
heard_run_tokens (heartbeat threads), which replaces one immutable record.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from diloco.services.contract.config import Config, SyncConfig
from diloco.services.contract.fragments import FragmentPlan
from diloco.services.contract.wire import pb

OWN_LINK_SMOOTHING = 0.2  # weight of the newest push in the own-link average
EARLY_MARGIN_STEPS = 1  # a push this early in its round is in phase: jitter, not drift


def merged_fragment(alpha: float, global_value: torch.Tensor, local: torch.Tensor,
                    local_at_apply: torch.Tensor | None = None) -> torch.Tensor:
    """theta_p <- alpha*theta_p + (1-alpha)*g_p. A late result (`local_at_apply` given) is
    merged with the fragment as it was at its apply step, and the steps trained since are
    added back: applying late then discards no more local progress than applying on time."""
    at_apply = local if local_at_apply is None else local_at_apply
    merged = global_value if alpha == 0 else alpha * at_apply + (1 - alpha) * global_value
    if local_at_apply is not None:
        merged = merged + (local - local_at_apply)
    return merged


def position_of_the_others(learners: Iterable[pb.LearnerStatus], learner_id: str,
                           interval_steps: int) -> float | None:
    """Where the live learners already training are on the sync schedule now, modulo H (None
    when there are none): each one's position is its sync_step at its last heartbeat, plus half
    a step, plus the steps since (a learner is at position n + 1 as its step n ends; its
    heartbeats keep their own time, not its steps', so one comes on average half a step into
    the step after the count it carries). Of these the median around the circle of H (read
    from the widest gap between them): a schedule taken from one learner ordered by step count,
    say one that regrouped a moment ago, hands its lag on, and rejoins drift the fleet apart."""
    positions = sorted(
        (l.sync_step + 0.5 + (l.seconds_since_heartbeat / l.step_seconds if l.step_seconds > 0 else 0.0))
        % interval_steps
        for l in learners if l.alive and l.learner_id != learner_id and l.last_step > 0)
    if not positions:
        return None
    gaps = [(positions[(i + 1) % len(positions)] - p) % interval_steps for i, p in enumerate(positions)]
    first = (max(range(len(gaps)), key=gaps.__getitem__) + 1) % len(positions)  # after the widest gap
    unwrapped = positions[first:] + [p + interval_steps for p in positions[:first]]
    return unwrapped[len(unwrapped) // 2] % interval_steps


@dataclass(frozen=True)
class CountersAtApply:
    """A late result's fragment counters as they were at its apply step."""
    steps: int
    tokens: int


class FragmentSchedule:
    """One fragment's part of the schedule: c_steps and c_tokens since its last delivered
    sync, and its sync in flight."""

    def __init__(self, sync: SyncConfig):
        self._tau = sync.overlap_steps
        self._max_block_seconds = sync.max_block_seconds
        self._max_block_steps = sync.max_block_steps
        self.steps_since_sync = 0  # c_steps
        self.tokens_since_sync = 0  # c_tokens
        self.in_flight = False
        self.apply_at = -1  # the step after which the in-flight result is applied
        self.blocked_seconds = 0.0  # how long the training thread has waited for it
        self.held_since_start = 0  # steps the schedule held while it was in flight
        self.late: CountersAtApply | None = None  # set once it missed its apply step

    def trained(self, tokens: int) -> None:
        self.steps_since_sync += 1
        self.tokens_since_sync += tokens

    def start(self, step: int) -> None:
        self.in_flight = True
        self.apply_at = step + self._tau
        self.blocked_seconds = 0.0
        self.held_since_start = 0

    def held(self) -> None:
        if self.in_flight:
            self.held_since_start += 1

    def due_for_apply(self, step: int) -> bool:
        return self.in_flight and self.apply_at <= step

    def wait_limit(self, step_seconds: float = 0.0) -> float | None:
        """How long the training thread may wait for the result now (None: as long as it
        takes), its steps taking `step_seconds` (0: not known yet)."""
        if self._tau == 0:
            return None
        limit = self._max_block_seconds
        if self._max_block_steps is not None and step_seconds > 0:
            limit = min(limit, self._max_block_steps * step_seconds)
        return max(0.0, limit - self.blocked_seconds)

    def waited(self, seconds: float) -> None:
        self.blocked_seconds += seconds

    def missed(self) -> bool:
        """The result was not in when the wait ended. True the first time: the shell keeps the
        fragment's local values as they are now, and the counters are kept here."""
        if self.late is not None:
            return False
        self.late = CountersAtApply(self.steps_since_sync, self.tokens_since_sync)
        return True

    def arrived(self, step: int, step_seconds: float, applied: bool) -> tuple[int, int]:
        """The result is in after step `step` (`applied`: it brought a new global value). Returns
        (steps trained past the apply step, the steps it was late or waited for, net of the
        steps held since the sync started)."""
        late_steps = step - self.apply_at
        late, self.late = self.late, None
        self.in_flight = False
        if not applied:  # skipped: the next outer gradient still carries every step
            return late_steps, 0
        self.steps_since_sync -= late.steps if late else self.steps_since_sync
        self.tokens_since_sync -= late.tokens if late else self.tokens_since_sync
        waited_steps = round(self.blocked_seconds / step_seconds) if step_seconds > 0 else 0
        return late_steps, late_steps + waited_steps - self.held_since_start


@dataclass(frozen=True)
class SyncStart:
    """A sync that starts now (in flight from here), with the counters its push carries."""
    fragment_id: int
    c_steps: int
    c_tokens: int


@dataclass(frozen=True)
class DueResult:
    """A result due now: wait for it up to `wait_limit` seconds (None: as long as it takes)."""
    fragment_id: int
    wait_limit: float | None


@dataclass(frozen=True)
class StepActions:
    """What the shell does after an inner step."""
    held: bool  # the schedule stood still: no sync fell due
    start: tuple[SyncStart, ...]
    apply: tuple[DueResult, ...]


@dataclass(frozen=True)
class HeardRunTokens:
    """The other learners' tokens and rate as the last heartbeat reply had them."""
    tokens: int
    per_second: float
    heard_at: float


class LearnerSchedule:
    """Every fragment's schedule, the hold and the run's token budget of one learner."""

    def __init__(self, cfg: Config, plan: FragmentPlan, clock: Callable[[], float] = time.monotonic):
        self.plan = plan
        self._clock = clock
        self._interval_steps = cfg.sync.interval_steps
        self._max_hold = cfg.sync.interval_steps // (2 * cfg.sync.fragments)
        self._max_run_tokens = cfg.trainer.max_run_tokens
        self._max_steps = cfg.trainer.max_steps
        self.fragments = {f.id: FragmentSchedule(cfg.sync) for f in plan.fragments}
        self.sync_offset = 0  # the schedule runs at step + sync_offset
        # (when, the others' step time, their position then): joined, not yet stepped
        self._phase_heard: tuple[float, float, float] | None = None
        self.hold = 0  # steps the schedule is yet to stand still
        # Fragments whose turn this period the phase taken at a (re)join had passed, until their
        # first sync starts: no round of theirs waits for this learner meanwhile (heartbeats
        # report them as skipped). Read by heartbeat threads: replaced, never changed in place.
        self.turns_passed: frozenset[int] = frozenset()
        # Fragments whose next sync could not start before the step budget ends, none in flight:
        # the learner's last contribution of each comes at its end (learner/sync/run_end.py),
        # and no round waits for it meanwhile (heartbeats report them as skipped). Read by
        # heartbeat threads: replaced, never changed in place.
        self.done_syncing: frozenset[int] = frozenset()
        self._tau = cfg.sync.overlap_steps
        self._wait_for_own_link = cfg.sync.wait_for_own_link
        # What a push may wait in its round by design, not for lack of phase: after a quorum
        # below the learners' count, the shards' grace window (syncer/grace.py), at most this.
        self._grace_seconds = 0.0 if cfg.syncer.quorum >= len(cfg.learners) else cfg.syncer.grace.seconds
        self.own_link_steps: float | None = None  # own, above: the steps its own transfers take per sync
        self._heard: HeardRunTokens | None = None
        # The fragment whose result training waits for, since when (waiting_elsewhere).
        self._waiting: tuple[int, float] | None = None
        self._heartbeat_seconds = cfg.trainer.heartbeat_seconds

    @property
    def first_step_pending(self) -> bool:
        """Joined in phase with the others and not yet stepped (see heard_again_before_first_step)."""
        return self._phase_heard is not None

    def step_done(self, step: int, tokens: int, step_seconds: float = 0.0) -> StepActions:
        """Inner step `step` (0-based) trained `tokens`, the learner's steps taking
        `step_seconds` (a moving average; 0: not known): the syncs that start now and the
        results that are due now."""
        for fragment in self.fragments.values():
            fragment.trained(tokens)
        if self._phase_heard is not None:  # the first step since joining
            heard_at, others_step_seconds, position = self._phase_heard
            self._phase_heard = None
            # This step takes the number of the others' step that ends nearest to it, and at the
            # earliest that of the step they were in when it joined (it began after that).
            nearest = math.floor(position + (self._clock() - heard_at) / others_step_seconds + 0.5) - 1
            ended = max(math.floor(position), nearest)
            self.sync_offset = (ended - step) % self._interval_steps
            self._pass_turns_before(step)
        held = self.hold > 0
        starting = ()
        if held:
            self.hold -= 1
            self.sync_offset -= 1
            for fragment in self.fragments.values():
                fragment.held()
        else:
            # Never two syncs of one fragment in flight (only possible if tau >= H, which the
            # config refuses). None whose result the step budget ends before or at: the
            # fragment's progress goes out as the learner's last contribution instead
            # (learner/sync/run_end.py), which the shards average plainly.
            starting = tuple(SyncStart(f.id, self.fragments[f.id].steps_since_sync,
                                       self.fragments[f.id].tokens_since_sync)
                             for f in self.plan.due_at(step + self.sync_offset)
                             if not self.fragments[f.id].in_flight and self._applied_within_budget(step))
            for sync in starting:
                self.fragments[sync.fragment_id].start(step)
            if starting and self.turns_passed:
                self.turns_passed = self.turns_passed - {sync.fragment_id for sync in starting}
        self._mark_done_syncing(step)
        due = tuple(DueResult(fid, self.wait_limit(fid, step_seconds))
                    for fid, f in self.fragments.items() if f.due_for_apply(step))
        return StepActions(held, starting, due)

    def _mark_done_syncing(self, step: int) -> None:
        """After step `step`: the fragments not in flight whose earliest next start (held steps
        only delay it) is too late for its result to be applied within trainer.max_steps."""
        after, interval = step + 1, self._interval_steps
        self.done_syncing = frozenset(
            f.id for f in self.plan.fragments if not self.fragments[f.id].in_flight
            and not self._applied_within_budget(after + (f.offset_step - after - self.sync_offset) % interval))

    def _applied_within_budget(self, start_step: int) -> bool:
        """Whether a sync starting after step `start_step` is applied before the step budget ends."""
        return start_step + self._tau + 1 < self._max_steps

    def wait_limit(self, fragment_id: int, step_seconds: float = 0.0) -> float | None:
        """How long the training thread may wait for the fragment's due result now, its steps
        taking `step_seconds` (None: as long as it takes; 0: train on, the result is merged
        late)."""
        if (not self._wait_for_own_link and self._tau > 0 and self.own_link_steps is not None
                and self.own_link_steps >= self._tau):
            return 0.0
        return self.fragments[fragment_id].wait_limit(step_seconds)

    def pushed(self, upload_seconds: float, step_seconds: float) -> None:
        """A push of this learner took `upload_seconds` from its start until the shard held it,
        while a step took `step_seconds`."""
        if step_seconds <= 0:
            return
        sample = 2 * upload_seconds / step_seconds
        own = self.own_link_steps
        self.own_link_steps = sample if own is None else own + OWN_LINK_SMOOTHING * (sample - own)

    def since_last_sync(self, fragment_id: int) -> SyncStart:
        """A push now of the fragment: the steps and tokens trained since its last applied sync
        (a push that did not get through, pushed again, carries them all)."""
        fragment = self.fragments[fragment_id]
        return SyncStart(fragment_id, fragment.steps_since_sync, fragment.tokens_since_sync)

    def join_in_phase(self, learners: Iterable[pb.LearnerStatus], learner_id: str, step: int) -> None:
        """(Re)joining at `step`: the schedule starts in phase with the others of a Status reply,
        and stays in phase however long the learner takes to train its first step (pulls,
        checkpoint): the others train on meanwhile, at their median step time, and the first
        step_done numbers its step as theirs that ends nearest to it. A learner behind its phase
        pushes after the round it belongs to closed (it joined after that round opened, so the
        round does not wait for it) and then waits for a round nobody else reaches before a
        period has passed."""
        position, self._phase_heard = self._phase_of_the_others(learners, learner_id)
        # Alone: its own step count; else its next step is their next.
        self.sync_offset = 0 if position is None else (math.floor(position) - step) % self._interval_steps
        self._pass_turns_before(step)

    def _pass_turns_before(self, step: int) -> None:
        """Joined in phase at `step`: the fragments whose offset this period is behind it synced
        without this learner; its next push of each comes a period later."""
        position = (step + self.sync_offset) % self._interval_steps
        self.turns_passed = frozenset(f.id for f in self.plan.fragments if f.offset_step < position)

    def heard_again_before_first_step(self, learners: Iterable[pb.LearnerStatus], learner_id: str) -> None:
        """Fresher heartbeats than the join's, just before the first step_done: that step is
        numbered from them instead of from the join's, extrapolated over the pulls, restore and
        regroup between. No learner heard: the join's stand."""
        if self._phase_heard is not None:
            self._phase_heard = self._phase_of_the_others(learners, learner_id)[1] or self._phase_heard

    def _phase_of_the_others(self, learners: Iterable[pb.LearnerStatus], learner_id: str) \
            -> tuple[float | None, tuple[float, float, float] | None]:
        """The others' position now, and (now, their median step time, that position) for the
        first step_done (None where no step time was heard)."""
        learners = [l for l in learners if l.alive and l.learner_id != learner_id and l.last_step > 0]
        position = position_of_the_others(learners, learner_id, self._interval_steps)
        times = sorted(l.step_seconds for l in learners if l.step_seconds > 0)
        if position is None or not times:
            return position, None
        return position, (self._clock(), times[len(times) // 2], position)

    def waiting_began(self, fragment_id: int) -> None:
        """The training thread waits for the fragment's result from now."""
        self._waiting = (fragment_id, self._clock())

    def waiting_ended(self) -> bool:
        """The wait is over; whether heartbeats may have reported it (then the shards count this
        learner as waiting elsewhere until a heartbeat says otherwise)."""
        reported = self.waiting_elsewhere() is not None
        self._waiting = None
        return reported

    def waiting_elsewhere(self) -> int | None:
        """The fragment whose result training has waited for at least a heartbeat interval:
        long enough that the shards' other rounds should not wait for this learner (a circular
        wait, say after a restart). Shorter waits are the schedule's ordinary ones: reported,
        they would close rounds without this learner, whose pushes then land a round late."""
        waiting = self._waiting  # read by heartbeat threads: one read of an immutable pair
        if waiting is None or self._clock() - waiting[1] < self._heartbeat_seconds:
            return None
        return waiting[0]

    def result_still_out(self, fragment_id: int, waited: float) -> bool:
        """The training thread waited `waited` seconds for a due result and it is still out.
        True the first time: the shell keeps the fragment's local values as they are now (a
        late result is merged with them), and the counters are kept here."""
        fragment = self.fragments[fragment_id]
        fragment.waited(waited)
        return fragment.missed()

    def result_arrived(self, fragment_id: int, step: int, step_seconds: float, applied: bool,
                       waited: float = 0.0, early_seconds: float = 0.0) -> bool:
        """Fragment's result is in after step `step`, the training thread having waited
        `waited` seconds for it just now, its push having waited `early_seconds` in the round
        for the others' (SyncOutcome.early_seconds); whether it came past its apply step. A
        result that came after it was needed (waited for, or late) means the others reached
        the round that much later, and so does a push that waited in its round for two steps
        or more even when the result came in time: the schedule holds for that lead before it
        grows into a wait (learners' step times differ by a few percent, which adds up)."""
        fragment = self.fragments[fragment_id]
        fragment.waited(waited)
        held = fragment.held_since_start
        late_steps, lead_steps = fragment.arrived(step, step_seconds, applied)
        lead_steps -= max(0, round(self.own_link_steps or 0) - self._tau)  # the own link's part is no lead
        if applied and step_seconds > 0:
            early_steps = math.floor((early_seconds - self._grace_seconds) / step_seconds)
            lead_steps = max(lead_steps, early_steps - EARLY_MARGIN_STEPS - held)
        if lead_steps > 0:
            self.hold = max(self.hold, min(lead_steps, self._max_hold))
        return late_steps > 0

    def heard_run_tokens(self, tokens: int, per_second: float, own_tokens: int, own_per_second: float) -> None:
        """A heartbeat reply's run tokens and rate, which count the `own_tokens` and
        `own_per_second` its request reported."""
        self._heard = HeardRunTokens(max(0, tokens - own_tokens), max(0.0, per_second - own_per_second),
                                     self._clock())

    def run_tokens(self, own_tokens: int) -> int:
        """The whole run's tokens now: this learner's `own_tokens` and the others' count at the
        last heartbeat, grown at their rate since."""
        heard = self._heard
        if heard is None:
            return own_tokens
        return own_tokens + round(heard.tokens + heard.per_second * (self._clock() - heard.heard_at))

    def run_over(self, own_tokens: int) -> bool:
        """The run's token budget (trainer.max_run_tokens) is spent."""
        return self._max_run_tokens is not None and self.run_tokens(own_tokens) >= self._max_run_tokens
