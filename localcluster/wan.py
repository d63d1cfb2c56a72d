"""The WAN of the local cluster: each learner's link to the shards (Config.link: its own, its
region's, or rpc.wan_mbps) emulated in its shard clients. The cluster starts a learner whose
link is capped as `python -m diloco.localcluster.wan (-m MODULE | SCRIPT) ARGS...`, which hands
the links in (services.client.emulate_links) and runs the learner in the same interpreter. Each direction paces the bytes of
every chunk at its rate, and every call waits the one-way latency on its way out and again on
its way back (ShardClient: before a push's first message and a pull's request, and before its
reply is taken in), so a call costs one round trip more than its bytes. Heartbeats and joins
are not paced: the emulated link carries the sync traffic only."""
from __future__ import annotations

import sys
import threading
import time
from typing import Callable

from diloco.localcluster.standby import run_life
from diloco.services.client import emulate_links
from diloco.services.contract.config import Config, ConfigError, LinkConfig


class PacedDirection:
    """One direction of an emulated link: n bytes occupy it for n / rate seconds, one
    transfer after another, as serialisation on a real link does (no burst credit). The
    latency does not occupy it: calls in flight at once each wait it in parallel."""

    def __init__(self, mbps: float | None, latency_seconds: float,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        self.bytes_per_second = mbps * 1e6 / 8 if mbps else None  # None: uncapped
        self.latency_seconds = latency_seconds
        self._clock = clock
        self._sleep = sleep
        self._busy_until = 0.0
        self._lock = threading.Lock()

    def book(self, count: int) -> float:
        """Takes the link for n bytes after what it carries already; the clock's time when
        they are through (now, uncapped)."""
        now = self._clock()
        if self.bytes_per_second is None:
            return now
        with self._lock:
            self._busy_until = max(now, self._busy_until) + count / self.bytes_per_second
            return self._busy_until

    def consume(self, count: int) -> None:
        if self.bytes_per_second is not None:
            self._sleep(max(0.0, self.book(count) - self._clock()))

    def wait_latency(self) -> None:
        if self.latency_seconds:
            self._sleep(self.latency_seconds)


class WanLink:
    """An emulated WAN link of one learner, shared by its clients of every shard: `up` carries
    its pushes, `down` its pulls."""

    def __init__(self, link: LinkConfig, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        latency = link.latency_ms / 1000
        self.up = PacedDirection(link.up_mbps, latency, clock, sleep)
        self.down = PacedDirection(link.down_mbps, latency, clock, sleep)



def emulated_wan_link(cfg: Config, learner_id: str, region: str) -> WanLink | None:
    link = cfg.link(learner_id, region)
    return None if link is None else WanLink(link)


def launcher(argv: list[str]) -> list[str]:
    """A learner's command (`python -m MODULE ...` or `python SCRIPT ...`) run behind its
    emulated link."""
    return [argv[0], "-m", "diloco.localcluster.wan", *argv[1:]]

def apply_link_flags(data: dict, wan_mbps: str | None, wan_latency_ms: str | None, regions: list[str]) -> None:
    """Writes `diloco sim --wan-mbps` and `--wan-latency-ms` into a config's dict (parse_config
    judges the values). Each flag is one number for every region, `REGION=VALUE` items, or both
    (`20,us-west=5`: 20 for every region but us-west); a rate may be `UP/DOWN`. One rate for
    all is rpc.wan_mbps; the rest goes into `links`. ConfigError naming the flag."""
    links = data.setdefault("links", {})
    if wan_mbps:
        every, own = _per_region(wan_mbps, "--wan-mbps", regions)
        if every is not None:
            data["rpc"]["wan_mbps"] = _number(every, "--wan-mbps", wan_mbps)
        for region, text in own.items():
            up, _, down = text.partition("/")
            links.setdefault(region, {}).update(up_mbps=_number(up, "--wan-mbps", wan_mbps),
                                                down_mbps=_number(down or up, "--wan-mbps", wan_mbps))
    if wan_latency_ms:
        every, own = _per_region(wan_latency_ms, "--wan-latency-ms", regions)
        for region in regions:
            text = own.get(region, every)
            if text is not None:
                links.setdefault(region, {})["latency_ms"] = _number(text, "--wan-latency-ms", wan_latency_ms)


def _per_region(text: str, flag: str, regions: list[str]) -> tuple[str | None, dict[str, str]]:
    """A flag's value for every region (None: not given) and each named region's own."""
    every, own = None, {}
    for item in text.split(","):
        region, named, value = item.rpartition("=")
        if not named:
            if every is not None:
                raise ConfigError(f"{flag} {text!r}: two values for every region ({every} and {value})")
            every = value
        elif region not in regions:
            raise ConfigError(f"{flag} {text!r}: no learner is in region {region!r} "
                              f"(the run's regions: {', '.join(regions)})")
        else:
            own[region] = value
    return every, own


def _number(text: str, flag: str, whole: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{flag} {whole!r}: {text!r} is not a number (expected N, REGION=N or, for a rate, "
                          f"REGION=UP/DOWN, comma-separated)") from None


if __name__ == "__main__":
    emulate_links(emulated_wan_link)
    run_life(sys.argv[1:])
