"""The downlink (docs/protocol.md, "The downlink"): a pull is one delta from the anchor the
shard served the learner, whatever number of rounds closed since; the learner then holds
exactly the bits the shard served it, within one encoding of the shard's value. The shard's
core on a fake clock, no gRPC."""
import hashlib

import pytest
import torch

from diloco.services.contract.codecs import get_codec
from diloco.services.contract.payload import decode_payload
from diloco.services.contract.state import StateHashMismatch, apply_update, check_pulled, state_hash
from diloco.syncer.core import ShardCore
from diloco.syncer.refusal import Refusal
from diloco.syncer.store import ShardStore
from tests.shard_harness import Shard, delta, make_config

INT4 = get_codec("int4")


class Puller:
    """A learner that only pulls (it is in the config, not joined: rounds do not wait for it),
    applying what it gets as the learner does."""

    def __init__(self, shard: Shard, learner_id: str = "b"):
        self.shard, self.id = shard, learner_id
        plan = shard.core.pull(0, None, learner_id)
        assert plan.snapshot
        self.value, self.version = decode_payload(plan.items[0].header, plan.items[0].payload), plan.items[0].version

    def pull(self, exact=False):
        plan = self.shard.core.pull(0, self.version, self.id, state_hash(self.value), exact=exact)
        value = self.value.clone()
        for item in plan.items:
            value = decode_payload(item.header, item.payload) if plan.snapshot else apply_update(
                value, decode_payload(item.header, item.payload))
        assert state_hash(value) == plan.state_hash  # the bits the shard served, as it recorded them
        self.value, self.version = value, self.shard.version()
        return plan


def rounds(shard: Shard, count: int, scale: float = 0.01) -> None:
    """`count` rounds closed by learner a alone (the only one joined)."""
    for _ in range(count):
        version = shard.version()
        shard.push("a", 0, delta(version + 7, shard.numel(), scale), base=version)
    assert shard.version() == version + 1


def anchor_values_missed(shard: Shard) -> int:
    """Pulls the shard answered with updates or a snapshot because their anchor's value was dropped."""
    return shard.core.counters.snapshot().get("anchor_values_missed", 0)


@pytest.fixture
def anchors(tmp_path):
    """The folder a shard process keeps its anchors' values in beyond syncer.kept_anchors."""
    return tmp_path / "anchors"


def int4_shard(anchor_folder, **syncer) -> Shard:
    """None: a shard that drops the values beyond syncer.kept_anchors (syncer.spill_anchors false)."""
    return Shard(make_config(codec="int4", **syncer), joined=("a",), anchor_folder=anchor_folder)


def test_a_learner_several_rounds_behind_pulls_one_delta_the_size_of_one_update_not_one_per_round(anchors):
    shard = int4_shard(anchors)
    learner = Puller(shard)
    rounds(shard, 6)
    plan = learner.pull()
    update_bytes = len(shard.core.fragments[0].committed.history[-1].payload)
    assert not plan.snapshot and len(plan.items) == 1 and plan.items[0].version == 6
    assert len(plan.items[0].payload) == update_bytes


def test_after_a_pull_the_learner_is_one_encoding_of_the_delta_away_from_the_shards_value(anchors):
    shard = int4_shard(anchors)
    learner = Puller(shard)
    for behind in (3, 1, 5, 2):
        rounds(shard, behind)
        asked = shard.value() - learner.value
        learner.pull()
        left = shard.value() - learner.value
        encoding_error = asked - INT4.decode(INT4.encode(asked, 128), asked.numel(), 128)
        assert torch.allclose(left, encoding_error, atol=1e-6)  # that delta's error, none carried over
        assert 0 < left.norm() < 0.2 * asked.norm()
        recorded = shard.core.fragments[0].pulls.served.records()["b"]
        assert recorded.state_hash == state_hash(learner.value) and recorded.offset == pytest.approx(float(left.norm() / asked.norm()), rel=1e-4)


def test_errors_do_not_accumulate_over_many_pulls(anchors):
    shard = int4_shard(anchors)
    learner = Puller(shard)
    offsets = []
    for _ in range(20):
        rounds(shard, 2)
        asked = (shard.value() - learner.value).norm()
        learner.pull()
        offsets.append(float((shard.value() - learner.value).norm() / asked))
    assert max(offsets) < 0.2  # each pull's own error, not a sum of them


def test_a_learner_on_the_lineage_one_version_behind_gets_the_shared_update_and_the_shards_bits(anchors):
    shard = int4_shard(anchors)
    learner = Puller(shard)
    for _ in range(3):
        rounds(shard, 1)
        plan = learner.pull()
        assert plan.items == (shard.core.fragments[0].committed.history[-1],)
        assert torch.equal(learner.value, shard.value())


def test_a_learner_already_at_the_current_value_gets_nothing(anchors):
    shard = int4_shard(anchors)
    learner = Puller(shard)
    rounds(shard, 2)
    learner.pull()
    assert learner.pull().items == ()


def test_a_learner_holding_the_seed_at_version_0_pulls_nothing_and_then_deltas(anchors):
    shard = int4_shard(anchors)
    seed = shard.seeds[0]
    plan = shard.core.pull(0, 0, "b", state_hash(seed))
    assert plan.items == () and plan.state_hash == state_hash(seed)
    rounds(shard, 3)
    plan = shard.core.pull(0, 0, "b", state_hash(seed))
    assert len(plan.items) == 1 and not plan.snapshot


def test_an_anchor_the_shard_did_not_serve_gets_a_snapshot(anchors):
    shard = int4_shard(anchors)
    learner = Puller(shard)
    rounds(shard, 2)
    plan = shard.core.pull(0, 0, "b", state_hash(learner.value + 1))  # not what it was served
    assert plan.snapshot and torch.equal(decode_payload(plan.items[0].header, plan.items[0].payload), shard.value())
    plan = shard.core.pull(0, 0, "c", state_hash(learner.value))  # another learner's anchor
    assert plan.snapshot


def test_a_request_without_an_anchor_hash_gets_the_updates_as_before(anchors):
    shard = int4_shard(anchors)
    rounds(shard, 3)
    assert [u.version for u in shard.core.pull(0, 0, "b").items] == [1, 2, 3]
    plan = shard.core.pull(0, 0, "stranger", "f" * 32)  # not a learner of the run: no record is kept
    assert [u.version for u in plan.items] == [1, 2, 3]


def test_a_learner_and_a_shard_of_the_older_sha256_hashes_refuse_each_other_by_name(anchors):
    """Before xxh3-128 the state hash was a sha256: a learner of that code names its anchor by
    one, and a shard of that code serves them; each side says the other runs older code."""
    shard = int4_shard(anchors)
    learner = Puller(shard)
    rounds(shard, 1)
    sha256 = hashlib.sha256(learner.value.numpy().data).hexdigest()
    with pytest.raises(Refusal, match="the learner runs an older diloco") as refused:
        shard.core.pull(0, learner.version, "b", sha256)
    assert refused.value.status == "FAILED_PRECONDITION"
    assert learner.pull().items  # nothing was recorded: its anchor still gets its delta
    with pytest.raises(StateHashMismatch, match="the shard runs an older diloco"):
        check_pulled(0, learner.version, learner.value, sha256)


def test_after_a_restart_the_next_pull_is_a_snapshot_of_the_bits_served_before(tmp_path):
    shard = Shard(make_config(codec="int4"), journal=ShardStore(tmp_path), joined=("a",),
                  anchor_folder=tmp_path / "anchors")
    learner = Puller(shard)
    rounds(shard, 3)
    learner.pull()
    before = shard.value().clone()
    core = ShardCore(shard.cfg, 0, clock=shard.clock, journal=ShardStore(tmp_path), anchor_folder=tmp_path / "anchors")
    core.restore(ShardStore(tmp_path).load())
    shard.core = core
    plan = learner.pull()
    assert plan.snapshot and torch.equal(learner.value, before)


def test_a_learner_that_never_took_its_last_pull_still_gets_a_delta_from_the_anchor_before():
    shard = int4_shard(None, kept_anchors=2)  # the anchor before and the one it never took
    learner = Puller(shard)
    rounds(shard, 2)
    shard.core.pull(0, learner.version, "b", state_hash(learner.value))  # its answer is lost
    rounds(shard, 2)
    plan = learner.pull()  # from the anchor it still holds
    assert not plan.snapshot and len(plan.items) == 1


def test_sixteen_learners_holding_the_same_bits_cost_one_encode_and_then_share_one_anchor(anchors):
    from diloco.services.contract.config import parse_config
    pullers = [f"p{i}" for i in range(16)]
    cfg = parse_config({"shards": [{"address": "127.0.0.1:1"}],
                        "learners": [{"id": learner, "region": "r"} for learner in ("a", *pullers)],
                        "sync": {"fragments": 2, "interval_steps": 4, "overlap_steps": 1, "codec": "int4"},
                        "syncer": {"grace": {"mode": "fixed", "seconds": 1.0}}})
    shard = Shard(cfg, joined=("a",), anchor_folder=anchors)
    learners = [Puller(shard, learner_id) for learner_id in pullers]
    pulls = shard.core.fragments[0].pulls
    delta_bytes = 0
    for expected in (1, 2):
        rounds(shard, 3)  # several rounds: a delta from each one's anchor, not the lineage's last update
        plans = [learner.pull() for learner in learners]
        delta_bytes += len(plans[0].items[0].payload)
        counters = shard.core.counters_snapshot()  # one encode per (anchor, value) pair, whoever asks
        assert (counters["pulls.delta_encoded"], counters["pulls.delta_reused"]) == (expected, 15 * expected)
        # each of the sixteen got that one delta's bytes (diloco_syncer_pull_bytes_total)
        assert counters["pull_bytes.delta_encoded"] + counters["pull_bytes.delta_reused"] == 16 * delta_bytes
        held = {state_hash(learner.value) for learner in learners}
        assert len(held) == 1
        assert {anchor.state_hash for anchor in pulls.served.records().values()} == held
        on_disk = {path.name for path in (anchors / "fragment-0").iterdir()}
        assert on_disk == held  # one value for the sixteen


def test_a_shard_keeps_at_most_kept_anchors_values_and_a_learner_whose_value_went_pulls_exact_bits():
    """syncer.kept_anchors bounds the values a fragment keeps of its learners' anchors, whatever
    their number: a learner whose lineage value was dropped gets the exact updates since, one
    whose off-lineage value was dropped a snapshot; either then holds the shard's bits."""
    shard = int4_shard(None, kept_anchors=1)
    b, c = Puller(shard, "b"), Puller(shard, "c")
    fragment = shard.core.fragments[0]

    def kept() -> int:
        return fragment.pulls.served.values_kept(fragment.committed.value)

    rounds(shard, 1)
    assert c.pull().answer == "lineage_update"
    rounds(shard, 2)
    assert b.pull().answer == "delta_encoded"  # from the seed's value, still kept
    assert kept() == 1  # b's new value; the lineage's older ones went first
    assert anchor_values_missed(shard) == 0
    plan = c.pull()
    assert plan.answer == "updates" and [u.version for u in plan.items] == [2, 3]
    assert torch.equal(c.value, shard.value())
    assert anchor_values_missed(shard) == 1  # counted apart from an older client's updates
    rounds(shard, 2)
    assert c.pull().answer == "delta_encoded"  # from version 3's value, kept until now
    assert kept() == 1  # c's new value: b's went
    plan = b.pull()
    assert plan.answer == "snapshot" and torch.equal(b.value, shard.value())
    assert kept() == 1
    assert anchor_values_missed(shard) == 2


def test_a_learners_newest_anchor_outlasts_a_more_recent_one_only_a_lost_reply_would_need():
    """With a value kept per learner, each one's newest anchor stays: the value b held before
    its last pull (needed only had that reply been lost) goes first, though c's is older."""
    shard = int4_shard(None, kept_anchors=2)
    b, c = Puller(shard, "b"), Puller(shard, "c")
    rounds(shard, 2)
    assert c.pull().answer == "delta_encoded"  # c's newest: the oldest value served
    assert b.pull().answer == "delta_reused"  # the same bits as c's: the same delta
    rounds(shard, 2)
    b.pull()  # b's newest now; the value it held before is c's
    rounds(shard, 2)
    b.pull()  # b's value before its newest is referenced by b alone
    assert c.pull().answer == "delta_encoded"
    assert anchor_values_missed(shard) == 0


def test_values_beyond_kept_anchors_go_to_the_disk_and_their_learners_still_pull_one_delta(anchors):
    """With an anchor folder, a value that leaves memory while a learner's newest anchor refers
    to it is written there and read back for that learner's next pull: one delta, the bits the
    shard recorded, where without the folder it was the updates since or a snapshot."""
    shard = int4_shard(anchors, kept_anchors=1)
    b, c = Puller(shard, "b"), Puller(shard, "c")
    fragment = shard.core.fragments[0]
    served = fragment.pulls.served
    on_disk = lambda: sorted(p.name for p in (anchors / "fragment-0").iterdir())  # noqa: E731

    rounds(shard, 1)
    assert c.pull().answer == "lineage_update"
    c_first = state_hash(c.value)
    rounds(shard, 2)
    assert b.pull().answer == "delta_encoded"  # from the seed's value
    assert served.values_kept(fragment.committed.value) == 1  # b's new value in memory; c's went to the disk
    assert on_disk() == [c_first]
    plan = c.pull()
    assert (plan.answer, len(plan.items)) == ("delta_encoded", 1)  # not the updates 2 and 3
    rounds(shard, 2)
    assert b.pull().answer == "delta_encoded"  # its value was on the disk: not a snapshot
    assert served.values_kept(fragment.committed.value) == 1
    assert on_disk() == [state_hash(c.value)]  # what no newest anchor refers to is gone
    assert c.pull().answer == "delta_encoded"
    assert on_disk() == [state_hash(b.value)]
    counters = shard.core.counters_snapshot()
    assert anchor_values_missed(shard) == 0
    assert counters["anchor_values_loaded"] == 3
    assert counters["anchor_values_spilled"] == 4  # c's, b's, c's, b's
    assert counters["anchor_spill_bytes"] == 4 * 4 * shard.numel()


def test_a_value_the_disk_refuses_is_dropped_and_its_learner_still_pulls_exact_bits(anchors):
    shard = int4_shard(anchors, kept_anchors=1)
    b, c = Puller(shard, "b"), Puller(shard, "c")
    rounds(shard, 1)
    c.pull()
    rounds(shard, 2)
    (anchors / "fragment-0").rmdir()  # the disk fails
    assert b.pull().answer == "delta_encoded"
    plan = c.pull()  # its value could not be written
    assert plan.answer == "updates" and torch.equal(c.value, shard.value())
    assert anchor_values_missed(shard) == 1
    assert "anchor_values_spilled" not in shard.core.counters_snapshot()


def test_a_shard_starts_with_no_anchor_values_on_disk(anchors):
    """Anchors are not durable: what an earlier process left in the folder is nobody's now."""
    leftover = anchors / "fragment-0" / "0123abcd"
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"x" * 64)
    int4_shard(anchors)
    assert not leftover.exists()


def test_an_exact_pull_takes_the_updates_on_the_lineage_and_a_snapshot_off_it_never_a_delta(anchors):
    """A learner ending its run asks for the shards' exact bits: from the lineage the updates
    since (a delta would leave it a snapshot short of them), from off it a snapshot."""
    shard = int4_shard(anchors)
    on, off = Puller(shard, "b"), Puller(shard, "c")
    rounds(shard, 2)
    assert off.pull().answer == "delta_encoded"  # off the lineage now
    rounds(shard, 3)
    plan = on.pull(exact=True)
    assert plan.answer == "updates" and [u.version for u in plan.items] == [1, 2, 3, 4, 5]
    assert torch.equal(on.value, shard.value())
    plan = off.pull(exact=True)
    assert plan.snapshot and torch.equal(off.value, shard.value())
