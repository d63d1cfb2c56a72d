"""What a (re)joining learner learns of the run from a shard's Status, and what it tells its
user: a spent token budget, or progress it did not resume from its own checkpoint and did not
see made (rerunning against an old state folder continues the run that it holds). Learners
started together need no word: the progress a join finds is then theirs."""
from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from diloco.services.contract.wire import pb

log = logging.getLogger(__name__)

NEW_RUN = ("to start a new run instead, start the shards with `diloco syncer --new-run` (or give the config "
           "another run.state_dir)")


def others_tokens(status: pb.StatusResponse | None, learner_id: str) -> int:
    """The tokens the other learners trained, as far as a shard knows (0: none answered). A
    restarted shard forgot the learners; its fragments' merged tokens it keeps."""
    if status is None:
        return 0
    return max(sum(l.tokens for l in status.learners if l.learner_id != learner_id),
               max((f.merged_tokens for f in status.fragments), default=0))


def started_beside(status: pb.StatusResponse | None, learner_id: str, age: float) -> bool:
    """Whether the run's progress is the live learners' since about when this learner's process
    started, `age` seconds ago: what they could have trained meanwhile at their rate, twice over
    (it varies), or any progress where one of them started about then (within twice that age;
    an incarnation is its start's time.time_ns()) and has yet to report a rate."""
    if status is None:
        return False
    now, others = time.time_ns(), [l for l in status.learners if l.alive and l.learner_id != learner_id]
    if any(l.tokens_per_second == 0 and now - l.incarnation <= 2 * age * 1e9 for l in others):
        return True
    return others_tokens(status, learner_id) <= 2 * age * sum(l.tokens_per_second for l in others)


def tell_what_it_joined(learner_id: str, run_name: str, max_run_tokens: int | None, run_over: bool,
                        versions: Mapping[int, int], tokens: int, others: int, beside: bool, resumed: bool) -> None:
    """The one warning a join may call for (none for a start beside the others or a resume)."""
    run = f"run {run_name!r}"
    if run_over:
        log.warning("learner %s joined %s, whose token budget is spent (%d tokens trained of "
                    "trainer.max_run_tokens %d): it trains nothing; %s", learner_id, run, others + tokens,
                    max_run_tokens, NEW_RUN)
    elif not resumed and max(versions.values()) > 0 and not beside:
        log.warning("learner %s joined %s, which already has progress (fragments %s; %d tokens trained): it "
                    "trains on from the run's global model, not from its own weights; %s", learner_id, run,
                    ", ".join(f"{fid}: v{v}" for fid, v in sorted(versions.items())), others, NEW_RUN)
