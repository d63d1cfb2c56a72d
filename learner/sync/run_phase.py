"""Where the learners already training are on the sync schedule: a learner that joins, or whose
training stood still, takes their phase from the first shard that answers Status
(learner/sync/schedule.py: LearnerSchedule.join_in_phase)."""
from __future__ import annotations

from typing import Sequence

import grpc

from diloco.learner.sync.joined_run import others_tokens
from diloco.learner.sync.schedule import LearnerSchedule
from diloco.learner.sync.session import ShardSession
from diloco.services.contract.config import Config
from diloco.services.contract.wire import pb


class RunPhase:
    def __init__(self, cfg: Config, learner_id: str, sessions: Sequence[ShardSession], schedule: LearnerSchedule):
        self.cfg, self.learner_id, self.sessions, self.schedule = cfg, learner_id, sessions, schedule

    def join(self, step: int, tokens: int) -> pb.StatusResponse | None:
        """Starts the sync schedule in phase with the learners already training, as the first
        shard that answers Status sees them (none answers: at this learner's own `step`), and
        counts the run's tokens from there until a heartbeat does. Returns that Status."""
        status = self.first_status()
        if status is None:
            return None
        self.schedule.join_in_phase(status.learners, self.learner_id, step)
        self.schedule.heard_run_tokens(others_tokens(status, self.learner_id) + tokens, 0.0, tokens, 0.0)
        return status

    def first_status(self) -> pb.StatusResponse | None:
        """The Status of the first shard that answers (None: none does)."""
        for session in self.sessions:
            try:
                return session.client.status(timeout=self.cfg.rpc.deadline_seconds)
            except grpc.RpcError:
                continue
        return None
