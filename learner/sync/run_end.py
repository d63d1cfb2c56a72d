"""The end of a learner's training, over the fragments StreamingSync (learner/sync/streaming.py) runs:
its last contributions delivered, then the run followed until it is quiet, ending with the
shards' exact final values (docs/protocol.md, "The downlink")."""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Mapping, Sequence

import grpc
import torch

from diloco.learner.sync.pipeline import FragmentPipeline
from diloco.learner.sync.schedule import LearnerSchedule
from diloco.learner.sync.session import ShardSession
from diloco.learner.sync.shard_errors import RETRY_INITIAL_SECONDS, Remedy, backoff_delays, remedy
from diloco.services.client import PullResult
from diloco.learner.sync.stats import SyncStats
from diloco.services.contract.config import Config
from diloco.services.contract.state import StateHashMismatch
from diloco.services.contract.wire import pb

log = logging.getLogger(__name__)

# How long the last pull after training keeps retrying a shard that is down.
FINAL_PULL_SECONDS = 60.0
# How often a learner that finished asks the shards whether the run is still changing.
CATCH_UP_POLL_SECONDS = 0.2


class RunEnd:
    """`fragments` is StreamingSync's own dict (filled as it starts); `stop` ends the waits
    between retries when the sync closes, `should_stop` when the process is asked to stop."""

    def __init__(self, cfg: Config, learner_id: str, fragments: Mapping[int, FragmentPipeline],
                 sessions: Sequence[ShardSession], schedule: LearnerSchedule, stats: SyncStats,
                 stop: threading.Event, should_stop: Callable[[], bool]):
        self.cfg = cfg
        self.learner_id = learner_id
        self.fragments = fragments
        self.sessions = sessions
        self.schedule = schedule
        self.stats = stats
        self.stop = stop
        self.should_stop = should_stop

    def deliver(self, step_seconds: float) -> dict[int, str]:
        """Budget spent: delivers the learner's last contributions, waiting until every push
        has been answered but not for the rounds to close. A sync in flight carries its
        fragment's progress to its start; every other fragment's progress since its last
        applied sync is pushed now, so no trained step is left out of the global model. The
        shards hold these contributions durably, the rounds close without this learner once
        it has left, and catch_up pulls what they made. A push the shard asked to retry
        (down, restarting, its disk full) is pushed again, with all the fragment trained
        since its last applied sync, for up to trainer.final_delivery_seconds. Returns why
        each of those is still undelivered then ({fragment: reason}), which it also logs."""
        for pipeline in self.fragments.values():
            if pipeline.in_flight is not None:
                pipeline.pushed.wait()
        deadline = time.monotonic() + self.cfg.trainer.final_delivery_seconds
        # Refused for good (counted, warned about) is not retried: only what the shard asked to retry.
        retry = lambda p: p.undelivered is not None and p.undelivered[0] is not Remedy.STOP  # noqa: E731
        since = lambda p: self.schedule.since_last_sync(p.fragment.id)  # noqa: E731
        pending = [p for p in self.fragments.values()
                   if retry(p) or (p.in_flight is None and since(p).c_steps > 0)]
        delays = backoff_delays()
        while pending and time.monotonic() < deadline and not self.should_stop():
            for pushed in [p.push_last(since(p), step_seconds) for p in pending]:
                pushed.result()
            pending = [p for p in pending if retry(p)]
            if pending:
                self.stop.wait(min(next(delays), max(0.0, deadline - time.monotonic())))
        undelivered = {p.fragment.id: p.undelivered[1] for p in pending}
        if undelivered:
            log.error("learner %s: its last contributions to fragments %s were not delivered (%s): the "
                      "steps they carry are lost to the run", self.learner_id, sorted(undelivered),
                      "; ".join(f"fragment {fid}: {why}" for fid, why in sorted(undelivered.items())))
        self.stats.undelivered = undelivered
        return undelivered

    def catch_up(self, quiet_seconds: float, should_stop: Callable[[], bool] = lambda: False) -> None:
        """After training: follow the run until no fragment changed for `quiet_seconds` or until
        stopped, then pull once, reaching every shard (one that is restarting is retried for up
        to FINAL_PULL_SECONDS), so this learner ends holding the run's final global values. It
        follows the shards' Status, not their values: one pull per fragment at the end, however
        many rounds the others close meanwhile, and to the shards' exact bits (the updates
        since where it is on their lineage, else a snapshot)."""
        quiet_since, seen = time.monotonic(), None
        while not should_stop() and time.monotonic() - quiet_since < quiet_seconds:
            versions = self._shard_versions()
            if versions is None or versions != seen:  # a shard that is down is not quiet
                quiet_since, seen = time.monotonic(), versions
            self.stop.wait(CATCH_UP_POLL_SECONDS)
        deadline = time.monotonic() + FINAL_PULL_SECONDS
        past_deadline = lambda: time.monotonic() >= deadline  # noqa: E731
        while not self._pull_newer_versions(give_up=past_deadline) and not past_deadline():
            self.stop.wait(RETRY_INITIAL_SECONDS)
        self._take_the_shards_bits()

    def _take_the_shards_bits(self) -> None:
        """After the final pulls: a fragment that had no newer version, whose last pull was a
        delta from an anchor off the shards' lineage, holds the shards' value less that delta's
        encoding error (docs/protocol.md, "The downlink"); one snapshot of each such fragment,
        once per run, leaves the learner holding the shards' exact bits, the global model an
        export from the shards gives."""
        for session in self.sessions:
            try:
                status = session.client.status(timeout=self.cfg.rpc.deadline_seconds)
                exact = {f.fragment_id: (f.version, f.state_hash) for f in status.fragments}
                for pipeline in self.fragments.values():
                    fid = pipeline.fragment.id
                    if pipeline.session is session and fid in exact and pipeline.hash() != exact[fid]:
                        result, value = self.stats.counted_pull(lambda: session.pull_checked(fid, None, None))
                        self.stats.exact_end_bytes += result.payload_bytes
                        pipeline.adopt(value, result.version)
            except (grpc.RpcError, StateHashMismatch) as error:  # the shard left: keep what was served
                log.warning("shard %d: not taking its exact final values: %s", session.index, error)

    def _shard_versions(self) -> dict[int, int] | None:
        """Every fragment's version as its shard reports it now; None if a shard did not answer."""
        versions = {}
        for session in self.sessions:
            try:
                status = session.client.status(timeout=self.cfg.rpc.deadline_seconds)
            except grpc.RpcError:
                return None
            versions.update({f.fragment_id: f.version for f in status.fragments})
        return versions

    def _pull_newer_versions(self, give_up: Callable[[], bool]) -> bool:
        """Pulls every fragment's newer versions, retrying a shard that is down until
        `give_up()`; whether every shard answered. A snapshot among them is the end's cost of
        the shards' exact bits, counted in exact_end_bytes as _take_the_shards_bits' snapshots are."""
        reached_all = True
        for pipeline in self.fragments.values():
            session = pipeline.session
            try:
                result, value = self.stats.counted_pull(
                    lambda: session.retry(lambda: pull_newer(pipeline), give_up))
            except grpc.RpcError as error:
                if remedy(error) is not Remedy.RETRY_LATER:
                    raise
                reached_all = False
                continue
            except StateHashMismatch as mismatch:  # a snapshot too
                log.error("%s", mismatch)
                reached_all = False
                continue
            if result.items:
                pipeline.adopt(value, result.version)
                if result.items[0].kind == pb.PAYLOAD_KIND_SNAPSHOT:
                    self.stats.exact_end_bytes += result.payload_bytes
        return reached_all


def pull_newer(pipeline: FragmentPipeline) -> tuple[PullResult, torch.Tensor | None]:
    """The fragment's versions after the pipeline's, as the shards' exact bits (the updates
    since where it is on their lineage, else a snapshot: a delta would leave it a snapshot
    short of them), or the shard's value where it serves the fragment below that version
    (re-anchored; an unseeded one: the pipeline keeps its own)."""
    session, fid, version = pipeline.session, pipeline.fragment.id, pipeline.version
    try:
        return session.pull_checked(fid, version, pipeline.anchor, min_version=version + 1, max_wait_seconds=0.0,
                                    exact=True)
    except grpc.RpcError as error:
        if remedy(error) is not Remedy.REJOIN:
            raise
        log.warning("fragment %d: shard %d: %s", fid, session.index, error.details())
    try:
        result, value = session.pull_checked(fid, None, None)
    except grpc.RpcError as error:
        if remedy(error) is not Remedy.REJOIN:
            raise
        log.warning("fragment %d: shard %d serves no value: keeping ours at version %d", fid, session.index, version)
        return PullResult(fid, [], "", 0), None
    pipeline.context.stats.reanchored_fragment(fid, version, result.version)
    pipeline.feedback.residual.zero_()
    return result, value
