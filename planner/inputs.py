"""What `diloco plan` simulates: the fleet, its failures, the algorithm's settings, the model,
the links and the run's length, validated with errors that name the key (or flag) at fault.

A YAML file (--config) holds these keys at its top level; a flag of the same name, dashes for
underscores, overrides one. Times are in the unit their key names.
"""
from __future__ import annotations

import math
from typing import Annotated, Literal

import yaml
from pydantic import ConfigDict, Field, ValidationError
from pydantic.dataclasses import dataclass

from diloco.services.contract.codecs import CODEC_NAMES
from diloco.services.contract.config import (ConfigLoader, Identifier, LinkConfig, SyncConfig, SyncerConfig,
                                             validation_message)

Positive = Annotated[float, Field(gt=0)]
NonNegative = Annotated[float, Field(ge=0)]
PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
_STRICT = ConfigDict(extra="forbid", strict=True)
DEFAULT_HOURS = 2.0  # a run of a day or more is asked for: --hours 24
WAN_KEYS = ("wan_gbps", "wan_latency_ms")  # the links of numbered regions, which `links` replaces
# The plan's sync and syncer sections where they differ from a cluster config's: P = 24
# fragments (the paper's), and a dead learner waited for 10 s.
PLAN_DEFAULTS = {"sync": {"fragments": 24}, "syncer": {"lease_seconds": 10.0}}
# The keys of those sections a plan file or flag may give at its top level (--interval-steps),
# and where each is in the config.
FLAT_KEYS = {**{key: ("sync", key) for key in ("interval_steps", "fragments", "overlap_steps", "max_block_seconds",
                                               "max_block_steps", "wait_for_own_link", "codec", "codec_block_size")},
             **{key: ("syncer", key) for key in ("quorum", "max_staleness", "lease_seconds", "history_versions")},
             "grace_mode": ("syncer", "grace", "mode"), "grace_seconds": ("syncer", "grace", "seconds")}


class PlanError(ValueError):
    """Inputs that cannot describe a run; the message names the key."""


@dataclass(frozen=True, config=_STRICT)
class InjectedFailure:
    """One failure at a chosen virtual time, besides (or instead of) the random ones."""
    learner: NonNegativeInt  # the learner unit that fails: every slice of it (data parallel: its slices)
    at_seconds: NonNegative
    slice: NonNegativeInt | None = None  # only this slice of the learner (slices_per_learner)
    repair_minutes: NonNegative | None = None  # None: the run's repair_minutes


@dataclass(frozen=True, config=_STRICT)
class ShardOutage:
    """A syncer shard down for a while (Decoupled DiLoCo only): its fragments' pushes and results
    wait until it is back."""
    shard: NonNegativeInt
    at_seconds: NonNegative
    seconds: NonNegative


@dataclass(frozen=True, config=_STRICT)
class PlanInputs:
    # The defaults are the example of docs/planning.md at one fleet size, for two hours: a plan
    # in seconds that tells the modes apart. Longer runs and sweeps are asked for.
    # The fleet: `chips` cut into M learner units (or data-parallel slices) of equal size.
    chips: PositiveInt = 1_179_648
    learners: PositiveInt | None = None  # M; or give chips_per_learner (neither: M = 8)
    chips_per_learner: PositiveInt | None = None
    # Each learner unit is S slices (replica groups) of equal size, the units that fail: a
    # Decoupled DiLoCo learner is an elastic island that trains on without a failed slice
    # (planner/island.py), and data parallel runs in the same M x S slices. 1: a failure takes
    # its whole learner down.
    slices_per_learner: PositiveInt = 1
    # Failures: each chip fails after an exponential time of mean chip_mtbf_hours (None: never,
    # save `failures`); its unit is then down for the repair time (a fixed time, or lognormal
    # with that median and repair_sigma), which includes restarting its processes. By default
    # one interruption per 50,000 chip-hours, as Llama 3's fleet had.
    chip_mtbf_hours: Positive | None = 50_000.0
    repair_minutes: NonNegative = 5.0
    repair_distribution: Literal["fixed", "lognormal"] = "lognormal"
    repair_sigma: NonNegative = 0.5
    failures: tuple[InjectedFailure, ...] = ()
    # Speed: inner step time of each learner (one value: every learner), at a fixed share of
    # the global batch each (batch_tokens / M per step).
    step_seconds: tuple[Positive, ...] = (1.0,)
    batch_tokens: PositiveInt = 4 << 20
    # A learner's own costs besides its steps (Decoupled DiLoCo): the process's start before it
    # joins, at the run's start and after each repair (one value each, or one for all); seconds
    # per step of its loop's other work (bookkeeping: badput `other`). It evaluates every
    # evaluation_every_steps steps, for evaluation_seconds, and checkpoints every
    # checkpoint_steps steps, for checkpoint_seconds; a failure loses the steps since its last
    # checkpoint, where it resumes (checkpoint_steps None: the steps its fragments had not
    # delivered to the syncer).
    startup_seconds: tuple[NonNegative, ...] = (0.0,)
    step_overhead_seconds: tuple[NonNegative, ...] = (0.0,)
    # A push's own time besides the wire (compressing the outer gradient, the call, the shard's
    # durable write), before its bytes go out: the learner's schedule counts it with the wire.
    push_overhead_seconds: tuple[NonNegative, ...] = (0.0,)
    evaluation_every_steps: PositiveInt | None = None
    evaluation_seconds: NonNegative = 0.0
    checkpoint_steps: PositiveInt | None = None
    checkpoint_seconds: NonNegative = 0.0
    # At the run's start every learner but the first (which seeds the fragments) pulls the
    # global model before its first step, as a learner process does; False: each starts from
    # the same initialised model (loaded from its own storage).
    pull_at_start: bool = False
    # Decoupled DiLoCo (H, P, tau, K, ...): the cluster config's own sync and syncer sections
    # (services/contract/config), with the planner's defaults (PLAN_DEFAULTS). A plan file or
    # flag names a key of them by its key (FLAT_KEYS: interval_steps, grace_mode, ...).
    sync: SyncConfig = SyncConfig(**PLAN_DEFAULTS["sync"])
    syncer: SyncerConfig = SyncerConfig(**PLAN_DEFAULTS["syncer"])
    # How often learners report their step (the cluster config's trainer.heartbeat_seconds): a
    # rejoining learner takes its phase from these reports, so their age matters.
    heartbeat_seconds: Positive = 0.5
    # The model and its traffic: bytes per sync from sync.codec; links per region (learner i is
    # in region i mod the number of regions); the syncer closes a round at this many
    # parameters per second (by default a production shard's; one shard on 2 cores measured
    # 41e6: bench/history.md).
    model_parameters: PositiveInt = 12_000_000_000
    wan_gbps: tuple[Positive, ...] = (5.0,)
    wan_latency_ms: tuple[NonNegative, ...] = (30.0,)
    # Or each region's link as the cluster config's `links` writes it (region -> up_mbps,
    # down_mbps, latency_ms; both rates required), instead of wan_gbps and wan_latency_ms:
    # learner i is in the (i mod regions)-th region named, as `diloco sim --regions` spreads them.
    links: Annotated[dict[Identifier, LinkConfig], Field(min_length=1)] | None = None
    syncer_params_per_second: Positive = 1e9
    # The syncer's shards (fragment i is on shard i mod shards) and their outages; by default
    # the syncer does not fail.
    shards: PositiveInt = 1
    shard_outages: tuple[ShardOutage, ...] = ()
    # Data parallel across regions all-reduces its gradients over the links (planner/allreduce.py):
    # in this precision, overlapped with the backward pass, this share of a step.
    gradient_dtype: Literal["bf16", "fp32"] = "bf16"
    backward_share: Annotated[float, Field(ge=0, le=1)] = 2 / 3
    # Data parallel: checkpoint interval and reload; elastic: the pause to reconfigure (its
    # ranks restart).
    checkpoint_minutes: Positive = 10.0
    restore_minutes: NonNegative = 1.0
    reconfigure_seconds: NonNegative = 30.0
    # A learner of several slices (an island): the pause when a slice leaves or rejoins (its
    # replica groups agree a new quorum and build new communicators, no process restarts), and
    # the rate at which a repaired slice receives the learner's state from a peer slice in its
    # data centre (one host's NIC; a slice's hosts can copy their shards in parallel). One
    # slice leads (syncs with the shards and holds the sync's state): losing it fails over to
    # another slice, which rolls the learner back to its checkpoint and restores without a
    # repair or a start-up (`learner_failure`: the learner is down until the leader is
    # repaired: planner/island.py). After a pause the learner takes its phase from the others
    # again, as a rejoining learner does (the learner's rephase(); False: it syncs on at its
    # own step count, and with H = P nothing else brings it back in phase).
    island_reconfigure_seconds: NonNegative = 10.0
    island_gbps: Positive = 100.0
    island_leader_loss: Literal["failover", "learner_failure"] = "failover"
    island_rephase: bool = True
    # The run's length: one of hours (wall time), steps (global steps at the full batch) or
    # tokens (neither: DEFAULT_HOURS).
    hours: Positive | None = None
    steps: PositiveInt | None = None
    tokens: PositiveInt | None = None
    seed: NonNegativeInt = 0

    @property
    def num_learners(self) -> int:
        if self.chips_per_learner is not None:
            return self.chips // self.chips_per_learner
        return self.learners or 8

    @property
    def num_slices(self) -> int:
        """The fleet's failure units: M learners of S slices each."""
        return self.num_learners * self.slices_per_learner

    @property
    def slice_chips(self) -> int:
        return self.chips // self.num_slices

    def learner_step_seconds(self, index: int) -> float:
        return self.step_seconds[index % len(self.step_seconds)]

    def slice_step_seconds(self, index: int) -> float:
        """A slice trains at its learner's pace."""
        return self.learner_step_seconds(index // self.slices_per_learner)

    def learner_startup_seconds(self, index: int) -> float:
        return self.startup_seconds[index % len(self.startup_seconds)]

    def learner_step_overhead_seconds(self, index: int) -> float:
        return self.step_overhead_seconds[index % len(self.step_overhead_seconds)]

    def learner_push_overhead_seconds(self, index: int) -> float:
        return self.push_overhead_seconds[index % len(self.push_overhead_seconds)]

    def learner_tokens_per_step(self) -> int:
        return self.batch_tokens // self.num_learners

    def region(self, index: int) -> str:
        """The name of learner `index`'s region: region-<i> for wan_gbps' i-th link."""
        if self.links is not None:
            return list(self.links)[index % len(self.links)]
        return f"region-{index % len(self.wan_gbps)}"

    def link(self, index: int) -> LinkConfig:
        """Learner `index`'s link to the syncer."""
        return self.region_link(self.region(index))

    def region_link(self, region: str) -> LinkConfig:
        """A region's link (region-<i>: wan_gbps' i-th)."""
        if self.links is not None:
            return self.links[region]
        i = int(region.removeprefix("region-"))
        return LinkConfig(up_mbps=self.wan_gbps[i] * 1000, down_mbps=self.wan_gbps[i] * 1000,
                          latency_ms=self.wan_latency_ms[i % len(self.wan_latency_ms)])

    @property
    def target_tokens(self) -> int | None:
        """The run's token budget; None for a run of fixed wall time."""
        return self.tokens if self.tokens is not None else (self.steps * self.batch_tokens if self.steps else None)

    @property
    def duration_seconds(self) -> float:
        """A run of fixed wall time lasts this long; a budget run, at most this long."""
        if self.hours is not None:
            return self.hours * 3600
        if self.target_tokens is None:
            return DEFAULT_HOURS * 3600
        # A budget run that has not ended by then is stuck (every learner down for good).
        return math.inf


def load_inputs(data: object, source: str = "plan inputs") -> PlanInputs:
    """Validates a mapping (parsed YAML, or flags) into PlanInputs."""
    if not isinstance(data, dict):
        raise PlanError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    data = {key: tuple(value) if isinstance(value, list) else value for key, value in data.items()}
    for key, kind in (("failures", InjectedFailure), ("shard_outages", ShardOutage)):
        items = []
        for i, item in enumerate(data.get(key, ())):
            try:
                items.append(kind(**item) if isinstance(item, dict) else item)
            except ValidationError as error:
                raise PlanError(f"{source}: {key}[{i}]: {validation_message(error)}") from None
        if items:
            data[key] = tuple(items)
    data = nested(data)
    rates = [key for key in WAN_KEYS if key in data]
    if data.get("links") is not None and rates:
        raise PlanError(f"{source}: links: give each region's link in links or in {' and '.join(rates)}, not both")
    try:
        inputs = PlanInputs(**data)
        check_relations(inputs)
    except ValidationError as error:
        raise PlanError(f"{source}: {validation_message(error)}") from None
    except PlanError as error:
        raise PlanError(f"{source}: {error}") from None
    return inputs


def nested(data: dict) -> dict:
    """The plan's sync and syncer sections from the plan defaults, the sections given (a
    mapping, or a config's own section) and the top-level keys that name one of their keys."""
    data = dict(data)
    sections = {}
    for name, kind in (("sync", SyncConfig), ("syncer", SyncerConfig)):
        given = data.pop(name, None) or {}
        sections[name] = {**PLAN_DEFAULTS[name], **(given.model_dump() if isinstance(given, kind) else given)}
    for key, path in FLAT_KEYS.items():
        if key in data:
            section = sections[path[0]]
            for part in path[1:-1]:
                section = section.setdefault(part, {})
            section[path[-1]] = data.pop(key)
    return {**data, **sections}


def load_file(path: str) -> dict:
    """A YAML file of inputs (1e9 reads as a number, as in cluster configs); PlanError for a
    cluster config, which is not one."""
    with open(path) as file:
        data = yaml.load(file, Loader=ConfigLoader)
    data = data if data is not None else {}
    # learners and shards are numbers, or lists of them (a sweep), in plan inputs
    cluster_keys = [key for key in ("shards", "learners")
                    if isinstance(data.get(key), list) and any(isinstance(item, dict) for item in data[key])]
    cluster_keys += [key for key in ("trainer", "run") if isinstance(data.get(key), dict)]
    if cluster_keys:
        raise PlanError(f"{path}: a cluster config ({', '.join(cluster_keys)}), not plan inputs: `diloco config "
                        "check` checks it; `diloco plan --calibrate-from REPORT` plans the run a `diloco sim` "
                        "report describes (docs/planning.md)")
    return data


def check_relations(inputs: PlanInputs) -> None:
    """Constraints between keys that a per-key type cannot express."""
    if inputs.learners is not None and inputs.chips_per_learner is not None:
        raise PlanError("learners: give either learners (M) or chips_per_learner, not both")
    if inputs.chips_per_learner is not None and inputs.chips % inputs.chips_per_learner:
        raise PlanError(f"chips_per_learner: {inputs.chips_per_learner} does not divide chips={inputs.chips}")
    m = inputs.num_learners
    if m > inputs.chips or inputs.chips % m:
        raise PlanError(f"learners: M={m} does not divide chips={inputs.chips} into equal units")
    if inputs.chips % inputs.num_slices:
        raise PlanError(f"slices_per_learner: S={inputs.slices_per_learner} does not divide a learner's "
                        f"{inputs.chips // m} chips into equal slices")
    for key in ("step_seconds", "startup_seconds", "step_overhead_seconds", "push_overhead_seconds"):
        if len(getattr(inputs, key)) not in (1, m):
            raise PlanError(f"{key}: {len(getattr(inputs, key))} values for M={m} learners (give 1 or {m})")
    if len(inputs.wan_latency_ms) not in (1, len(inputs.wan_gbps)):
        raise PlanError(f"wan_latency_ms: {len(inputs.wan_latency_ms)} values for {len(inputs.wan_gbps)} regions "
                        f"(wan_gbps); give 1 or one per region")
    for region, link in (inputs.links or {}).items():
        for key in ("up_mbps", "down_mbps"):
            if getattr(link, key) is None:
                raise PlanError(f"links.{region}.{key}: required in a plan (a planned link has a rate each way)")
    sync, syncer = inputs.sync, inputs.syncer
    if sync.overlap_steps >= sync.interval_steps:
        raise PlanError(f"overlap_steps: tau={sync.overlap_steps} must be smaller than "
                        f"interval_steps (H={sync.interval_steps})")
    if inputs.heartbeat_seconds * 2 > syncer.lease_seconds:
        raise PlanError(f"lease_seconds: {syncer.lease_seconds} must be at least twice heartbeat_seconds "
                        f"({inputs.heartbeat_seconds})")
    if syncer.quorum > m:
        raise PlanError(f"quorum: K={syncer.quorum} exceeds the number of learners (M={m})")
    if sync.codec not in CODEC_NAMES:
        raise PlanError(f"codec: unknown codec {sync.codec!r} (valid: {', '.join(CODEC_NAMES)})")
    if inputs.batch_tokens < m:
        raise PlanError(f"batch_tokens: {inputs.batch_tokens} is less than one token per learner (M={m})")
    lengths = [key for key in ("hours", "steps", "tokens") if getattr(inputs, key) is not None]
    if len(lengths) > 1:
        raise PlanError(f"{lengths[1]}: give one run length (hours, steps or tokens), got {' and '.join(lengths)}")
    for i, failure in enumerate(inputs.failures):
        if failure.learner >= m:
            raise PlanError(f"failures[{i}].learner: {failure.learner} is not a learner unit (M={m})")
        if failure.slice is not None and failure.slice >= inputs.slices_per_learner:
            raise PlanError(f"failures[{i}].slice: {failure.slice} is not a slice of the learner "
                            f"(slices_per_learner={inputs.slices_per_learner})")
    for i, outage in enumerate(inputs.shard_outages):
        if outage.shard >= inputs.shards:
            raise PlanError(f"shard_outages[{i}].shard: {outage.shard} is not a shard (shards={inputs.shards})")
