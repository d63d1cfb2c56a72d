"""When a shard gives its freed memory back (syncer/memory.py IdleRelease), on a fake clock: the
ticker asks every tick, with the time of the last push or pull."""
from diloco.syncer.memory import IdleRelease

TICK = 0.05


def ticks(policy: IdleRelease, start: float, end: float, last_busy: float | None) -> list[float]:
    """The times in [start, end) at which the policy released, asked every tick."""
    released, now = [], start
    while now < end:
        if policy.due(now, last_busy):
            released.append(round(now, 2))
        now += TICK
    return released


def busy_bursts(policy: IdleRelease, every: float, count: int, length: float = 0.2) -> tuple[float, list[float]]:
    """`count` rounds `every` seconds apart, pushes and pulls every tick for `length` seconds of
    each; (when the last one ended, the releases meanwhile)."""
    released, now, last_busy = [], 0.0, None
    while now < (count - 1) * every + length:
        if now % every < length:
            last_busy = now
        if policy.due(now, last_busy):
            released.append(round(now, 2))
        now += TICK
    return last_busy, released


def test_nothing_is_released_before_the_first_push_or_pull():
    assert ticks(IdleRelease(), 0.0, 10.0, None) == []


def test_a_shard_idle_after_its_first_round_releases_after_the_minimum_once():
    policy = IdleRelease(min_seconds=1.0)
    released = ticks(policy, 0.0, 5.0, 0.0)
    assert len(released) == 1 and 1.0 <= released[0] < 1.0 + 2 * TICK


def test_rounds_a_few_seconds_apart_keep_their_memory_between_them():
    policy = IdleRelease(min_seconds=1.0, factor=2.0)
    _, released = busy_bursts(policy, every=3.0, count=10)
    # the first pause is longer than anything seen before it; from then on the pauses are known
    assert released[1:] == [] and len(released) <= 1
    assert policy.longest_pause >= 2.8


def test_a_shard_whose_learners_stopped_gives_its_memory_back_after_twice_the_longest_pause():
    policy = IdleRelease(min_seconds=1.0, factor=2.0)
    last_busy, _ = busy_bursts(policy, every=3.0, count=10)
    released = ticks(policy, last_busy + TICK, last_busy + 20.0, last_busy)
    assert len(released) == 1
    waited = released[0] - last_busy
    assert 2 * policy.longest_pause - 1e-6 <= waited < 2 * policy.longest_pause + 2 * TICK


def test_a_pause_of_hours_does_not_keep_memory_for_hours_after_the_next_one():
    policy = IdleRelease(min_seconds=1.0, factor=2.0, max_seconds=30.0)
    policy.due(0.0, 0.0)
    policy.due(7200.0, 7200.0)  # the run came back after two hours
    released = ticks(policy, 7200.0, 7300.0, 7200.0)
    assert len(released) == 1 and 30.0 <= released[0] - 7200.0 < 30.0 + 2 * TICK


def test_memory_is_released_once_per_pause_and_again_after_the_next_busy_moment():
    policy = IdleRelease(min_seconds=1.0, factor=2.0)
    assert len(ticks(policy, 0.0, 10.0, 0.0)) == 1
    assert ticks(policy, 10.0, 30.0, 0.0) == []
    after_next = ticks(policy, 30.0, 60.0, 30.0)  # busy again at 30 s after a 30 s pause: wait 60 s now
    assert after_next == [] and policy.longest_pause == 30.0
    assert len(ticks(policy, 60.0, 100.0, 30.0)) == 1
