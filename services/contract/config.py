"""One YAML file describes a whole run: shards, learners, the sync schedule, the
syncer's outer loop, the learners' inner loop, the model and the data.

    cfg = load_config("examples/local-4-regions.yaml")

Loading validates everything up front. An unknown key, a wrong type or an
impossible value raises ConfigError naming the key (`sync.overlap_steps: ...`),
so a bad file never starts a process. Symbols from the papers are given beside
the keys: H, P, tau, alpha, K.
"""
from __future__ import annotations

import difflib
import functools
import importlib
import pathlib
import re
import tempfile
from typing import Annotated, Any, Callable, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

from diloco.services.contract.codecs import CODEC_NAMES


class ConfigError(ValueError):
    """A configuration file that cannot describe a run; the message names the key."""


class _Section(BaseModel):
    # strict: "4" is not 4 and 1.5 is not an int; extra="forbid": typos are errors.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
Port = Annotated[int, Field(ge=0, le=65535)]
HostPort = Annotated[str, Field(pattern=r"^[^\s:]+:\d{1,5}$|^\[[0-9a-fA-F:]+\]:\d{1,5}$")]
Identifier = Annotated[str, Field(pattern=r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$")]


class RunConfig(_Section):
    name: Identifier = "diloco"
    seed: NonNegativeInt = 0
    state_dir: str = ".diloco"  # shards and learners keep their state below this folder
    # The host every server of the run binds: shards' gRPC and health ports, /metrics of shards
    # and learners. None: every interface ([::] for gRPC, 0.0.0.0 for /metrics), which shards
    # reached from other regions need; gRPC is mutual TLS, health and /metrics are plaintext
    # (docs/security.md). The local cluster and `diloco sim` set 127.0.0.1.
    listen_host: str | None = None


class ShardConfig(_Section):
    address: HostPort  # host:port learners dial; the shard listens on this port
    metrics_port: Port = 9100  # 0 disables the /metrics endpoint
    # A plaintext port that serves grpc.health.v1 and nothing else, for probes that cannot
    # present a client certificate (Kubernetes gRPC probes, compose healthchecks). 0: none.
    health_port: Port = 0


class LinkConfig(_Section):
    """A learner's link to the syncer, as the local cluster emulates it (localcluster/wan.py:
    WanLink) and `diloco plan` models it: a rate each way and the one-way latency."""
    up_mbps: PositiveFloat | None = None  # pushes; None: rpc.wan_mbps, else uncapped
    down_mbps: PositiveFloat | None = None  # pulls; None: rpc.wan_mbps, else uncapped
    latency_ms: Annotated[float, Field(ge=0.0)] = 0.0  # one way: a call waits it out and back


class LearnerConfig(_Section):
    id: Identifier
    region: Identifier
    metrics_port: Port = 9100
    link: LinkConfig | None = None  # this learner's own link, instead of its region's (links)
    # Each inner step takes this many times as long as its compute (the learner sleeps the
    # rest): a slower hardware generation in the same run, for benchmarks and tests.
    slowdown: Annotated[float, Field(ge=1.0)] = 1.0


class SyncConfig(_Section):
    fragments: PositiveInt = 4  # P
    interval_steps: PositiveInt = 24  # H: each fragment is synced every H inner steps
    overlap_steps: NonNegativeInt = 2  # tau: apply a sync's result tau steps after it started
    mix_alpha: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0  # alpha: 0 overwrites, 0.5 averages
    # With tau > 0, how long the training loop waits for a result that is late before it
    # trains on and applies the result when it arrives (tau = 0 always waits: lockstep).
    # Bounded, because learners blocked on each other's rounds could otherwise wait forever.
    max_block_seconds: Annotated[float, Field(ge=0.0)] = 2.0
    # A learner whose own push and pull take longer than tau steps (a slow link) cannot have
    # its results in time: true waits for them all the same (late results cost quality,
    # docs/protocol.md); false trains on and merges them late, never idle for its own link.
    wait_for_own_link: bool = True
    codec: str = "int4"
    codec_block_size: PositiveInt = 128
    fragmentation: Literal["balanced", "strided"] = "balanced"


class GraceConfig(_Section):
    # fixed: wait `seconds` after quorum; adaptive: gamma * (tau*step - quorum - sync time),
    # from moving averages, capped by `seconds`.
    mode: Literal["fixed", "adaptive"] = "adaptive"
    seconds: Annotated[float, Field(ge=0.0)] = 1.0
    gamma: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.5


class OuterOptimizerConfig(_Section):
    lr: PositiveFloat = 0.7
    # auto: from the syncs each fragment gets in the run (Config.outer_momentum).
    momentum: Annotated[float, Field(ge=0.0, lt=1.0)] | Literal["auto"] = "auto"
    nesterov: bool = True


# Outer momentum remembers about 1 / (1 - momentum) sync periods. DiLoCo's 0.9 (ten periods)
# was tuned with H in the hundreds; at H of 10 to 50 it overshoots (the Llama-style model most),
# and with few syncs per fragment in a run a long memory carries outer gradients of an earlier
# stage of training into later ones. "auto" keeps the memory within a tenth of the run's syncs,
# between 0.5 and 0.7 (docs/protocol.md: the measurements that chose it).
MAX_AUTO_MOMENTUM = 0.7
MIN_AUTO_MOMENTUM = 0.5
MOMENTUM_MEMORY_SHARE = 0.1


class SyncerConfig(_Section):
    quorum: PositiveInt = 1  # K: contributions that may close a round once grace has passed
    # True: a round closes only once every learner still in the run (joined, not left)
    # contributed, also while one is down, and K have (those that left count), as
    # synchronous data parallel does.
    wait_for_all: bool = False
    grace: GraceConfig = GraceConfig()
    merge: Literal["rda", "mean"] = "rda"  # radial-directional averaging or weighted mean
    max_staleness: NonNegativeInt = 4  # versions; older contributions are refused
    stale_weight_decay: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0  # weight *= decay**staleness
    outer_optimizer: OuterOptimizerConfig = OuterOptimizerConfig()
    # L: encoded updates kept for catch-up pulls, at most; fewer while a chain of them would
    # be larger than the fp32 snapshot a learner pulls instead (about 7 in int4).
    history_versions: PositiveInt = 32
    # A fragment's state is written in full once the contributions logged since the last full
    # write reach this many times its size (16 bytes per parameter); a restart replays them.
    # 0: after every round.
    snapshot_log_ratio: Annotated[float, Field(ge=0.0)] = 1.0
    lease_seconds: PositiveFloat = 5.0
    max_update_norm: PositiveFloat = 1.0e4  # pushes whose decoded L2 norm is larger are refused
    # The most tokens one learner (every process of its island) trains on per inner step: bounds
    # what its pushes and heartbeats may claim (syncer/claims.py). None: Config.tokens_per_step()
    # (trainer.batch_size x trainer.grad_accum_steps x model.seq_len) x island.replica_groups, the
    # built-in GPT with one process per replica group; required with a model factory.
    max_tokens_per_step: PositiveInt | None = None


class InnerOptimizerConfig(_Section):
    lr: PositiveFloat = 4.0e-4
    weight_decay: Annotated[float, Field(ge=0.0)] = 0.1
    beta1: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.9
    beta2: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.95
    warmup_steps: NonNegativeInt = 50
    min_lr_ratio: Annotated[float, Field(ge=0.0, le=1.0)] = 0.1  # cosine decays to lr * ratio
    grad_clip: Annotated[float, Field(ge=0.0)] = 1.0  # 0 disables clipping


class TrainerConfig(_Section):
    batch_size: PositiveInt = 8  # sequences per micro-batch, per process
    grad_accum_steps: PositiveInt = 1  # micro-batches per inner step (their gradients are summed)
    max_steps: PositiveInt = 1000  # inner-step budget of each learner
    max_tokens: PositiveInt | None = None  # token budget; whichever budget ends first
    # The whole run's token budget, over all learners: each stops once the run's tokens, as the
    # shards count them from heartbeats (docs/protocol.md), reach it. Learners of different speeds then end together, each having trained
    # what it could, instead of the slow ones training on alone after the fast ones finished.
    max_run_tokens: PositiveInt | None = None
    inner_optimizer: InnerOptimizerConfig = InnerOptimizerConfig()
    heartbeat_seconds: PositiveFloat = 0.5
    # Budget spent: how long a learner keeps pushing its last contribution to a shard that
    # asks it to retry (down, restarting, its disk full) before it reports it undelivered.
    final_delivery_seconds: PositiveFloat = 60.0
    eval_every: PositiveInt = 100
    eval_batches: PositiveInt = 8
    checkpoint_every: PositiveInt = 200
    threads: PositiveInt = 1  # torch intra-op threads per learner process
    # Where the built-in learner trains (learner/trainer/device.py): auto is the local rank's GPU under
    # torchrun (GPU 0 alone) when CUDA is present, else cpu.
    device: Annotated[str, Field(pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$")] = "auto"
    # bf16: forward and loss under torch.autocast(bfloat16); weights and optimizer stay fp32.
    precision: Literal["fp32", "bf16"] = "fp32"


class IslandConfig(_Section):
    """Replica groups of each learner island (docs/reliability.md, "Losing a replica group"). One
    group is the island as one process (or one torchrun job) that fails as a whole. With R > 1
    each group is a process of its own, the groups average gradients every step through torchft,
    one of them leads (syncs), and any group may die and rejoin while the others train on."""
    replica_groups: PositiveInt = 1
    # How long a gradient average waits for a group that stopped answering before the step is
    # dropped and the island reconfigures without it.
    timeout_seconds: PositiveFloat = 10.0
    # The lighthouse (torchft's membership service) drops a group whose heartbeats stop for this
    # long: most of the pause the survivors see after a loss.
    heartbeat_timeout_seconds: PositiveFloat = 2.0
    # A group that has met no leader since it started waits this long for group 0, the island's
    # first leader, then leads itself: after every group died, group 0 may not come back.
    leader_wait_seconds: PositiveFloat = 60.0


class GPTConfig(_Section):
    """The built-in byte-level models: GPT (learner/trainer/model.py) or a Llama-style decoder
    (learner/trainer/model.py: RMSNorm, rotary positions, SwiGLU)."""
    family: Literal["gpt", "llama"] = "gpt"
    n_layer: PositiveInt = 2
    n_head: PositiveInt = 4
    n_embd: PositiveInt = 128
    seq_len: PositiveInt = 128
    dropout: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0


class TransformersModelConfig(_Section):
    """Any Hugging Face transformers causal LM (the `hf` extra), built from its config with random
    weights (nothing is downloaded) and trained on the built-in data's bytes as tokens: its
    class (a transformers class name, e.g. LlamaForCausalLM, or "pkg.module:Class"), the keyword
    arguments of that class's config (vocab_size at least 256), and the context it trains on."""
    transformers: Annotated[str, Field(pattern=r"^([A-Za-z_][\w.]*:)?[A-Za-z_]\w*$")]
    config: dict[str, Any] = {}
    seq_len: PositiveInt


Factory = Annotated[str, Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")]  # "pkg.module:factory"


def _model_kind(value: object) -> str:
    """Which form of `model:` a value is, so that an error speaks of that form's keys only (the
    tags are not keys: _key_path leaves them out)."""
    if isinstance(value, str):
        return "Factory"
    if isinstance(value, TransformersModelConfig) or (isinstance(value, dict) and "transformers" in value):
        return "TransformersModelConfig"
    return "GPTConfig"


ModelSpec = Annotated[Union[Annotated[Factory, Tag("Factory")],
                            Annotated[TransformersModelConfig, Tag("TransformersModelConfig")],
                            Annotated[GPTConfig, Tag("GPTConfig")]], Discriminator(_model_kind)]


class CorpusConfig(_Section):
    """The built-in corpus: the Python standard library's own .py sources."""
    corpus: Literal["python-stdlib"] = "python-stdlib"
    validation_fraction: Annotated[float, Field(gt=0.0, lt=0.5)] = 0.05
    max_bytes: PositiveInt | None = None  # read at most this much of the corpus


class RpcConfig(_Section):
    deadline_seconds: PositiveFloat = 60.0  # every unary call; streams get this per MiB too
    max_message_bytes: Annotated[int, Field(ge=4 << 20)] = 16 << 20
    keepalive_seconds: PositiveFloat = 30.0
    # Connections a shard closes (docs/security.md): one that has not finished its TLS and
    # HTTP/2 handshake after handshake_seconds, one without a call for idle_connection_seconds,
    # and every one after max_connection_age_seconds (its calls in flight finish first; the
    # client reconnects for the next). At most max_streams_per_connection calls at once on one.
    handshake_seconds: PositiveFloat = 10.0
    idle_connection_seconds: PositiveFloat = 300.0
    max_connection_age_seconds: PositiveFloat = 3600.0
    max_streams_per_connection: PositiveInt = 100
    # Emulated WAN: caps each learner's sync traffic to this many Mbit/s in each direction
    # (its client paces n bytes to n / rate seconds; localcluster/wan.py: WanLink), where the
    # learner's link (links, learners[].link) gives no rate. None: no cap.
    wan_mbps: PositiveFloat | None = None


class TlsConfig(_Section):
    # mtls: every connection is TLS with a certificate of the run's CA on both ends, and a
    # learner may only act as the learner id its certificate names. plaintext: neither
    # encryption nor authentication, for a network that is trusted as a whole; it must be
    # written out, the default is mtls.
    mode: Literal["mtls", "plaintext"] = "mtls"
    # Holds one folder per process (shard-<i>, learner-<id>, operator), each with ca.crt,
    # tls.crt and tls.key, as `diloco certs` writes them; None: <run.state_dir>/certs. A
    # process given --tls-dir reads its own folder from there instead (a mounted Secret).
    dir: str | None = None


class LimitsConfig(_Section):
    """What one peer may ask of a shard. Beyond a limit the call is refused (RESOURCE_EXHAUSTED,
    DEADLINE_EXCEEDED for a stalled push) and what it sent so far is discarded."""
    max_push_bytes: Annotated[int, Field(gt=0)] = 1 << 30  # encoded payload of one push
    max_chunks_per_push: PositiveInt = 4096
    # Longest gap between two messages of a push stream: a push that trickles (slow loris)
    # is cut off. A whole push may take rpc.deadline_seconds per MiB, as clients allow it.
    push_idle_seconds: PositiveFloat = 30.0
    # Pushes and pulls in flight at once from one client certificate (one connection
    # in plaintext mode).
    max_streams_per_peer: PositiveInt = 16
    # Largest model a Join may declare (sum of the manifest's tensor sizes): the first Join
    # fixes the plan, and every shard allocates its share of it.
    max_parameters: PositiveInt = 1 << 35


class Config(_Section):
    run: RunConfig = RunConfig()
    shards: Annotated[list[ShardConfig], Field(min_length=1)]
    learners: Annotated[list[LearnerConfig], Field(min_length=1)]
    # Each region's link to the syncer (region -> LinkConfig), emulated in the local cluster; a
    # learner's own learners[].link takes precedence. Regions not named here: rpc.wan_mbps.
    links: dict[Identifier, LinkConfig] = {}
    sync: SyncConfig = SyncConfig()
    syncer: SyncerConfig = SyncerConfig()
    trainer: TrainerConfig = TrainerConfig()
    island: IslandConfig = IslandConfig()
    model: ModelSpec = GPTConfig()
    data: Union[Factory, CorpusConfig] = CorpusConfig()
    rpc: RpcConfig = RpcConfig()
    tls: TlsConfig = TlsConfig()
    limits: LimitsConfig = LimitsConfig()

    def learner(self, learner_id: str) -> LearnerConfig:
        for learner in self.learners:
            if learner.id == learner_id:
                return learner
        raise ConfigError(f"learners: no learner with id {learner_id!r} "
                          f"(known: {', '.join(l.id for l in self.learners)})")

    def link(self, learner_id: str, region: str) -> LinkConfig | None:
        """The link a learner's sync traffic takes in the local cluster: its learners[] entry's
        `link`, else its region's in `links`, with rpc.wan_mbps for a rate neither gives. None:
        nothing to emulate (loopback as it is)."""
        own = next((l.link for l in self.learners if l.id == learner_id and l.link is not None), None)
        link = own or self.links.get(region) or LinkConfig()
        link = link.model_copy(update={"up_mbps": link.up_mbps or self.rpc.wan_mbps,
                                       "down_mbps": link.down_mbps or self.rpc.wan_mbps})
        return None if link == LinkConfig() else link

    def model_name(self) -> str:
        """The model in a word, for reports: a factory's spec, a transformers class or the
        built-in family."""
        if isinstance(self.model, str):
            return self.model
        if isinstance(self.model, TransformersModelConfig):
            return self.model.transformers
        return self.model.family

    def tokens_per_step(self) -> int:
        """What one process of the built-in learner trains on per inner step: trainer.batch_size x
        trainer.grad_accum_steps x model.seq_len. A model factory's seq_len is its own: then the
        bound syncer.max_tokens_per_step (required with a factory) stands in for it."""
        if isinstance(self.model, str):
            return self.syncer.max_tokens_per_step
        return self.trainer.batch_size * self.trainer.grad_accum_steps * self.model.seq_len

    def max_tokens_per_step(self) -> int:
        """T: syncer.max_tokens_per_step, or tokens_per_step() of every replica group of an island
        (one process each, the built-in GPT)."""
        if self.syncer.max_tokens_per_step is not None:
            return self.syncer.max_tokens_per_step
        return self.tokens_per_step() * self.island.replica_groups

    def syncs_per_fragment(self) -> float:
        """How often each fragment is synced in the run: a learner's inner steps, over H. The
        steps are trainer.max_steps, or fewer where trainer.max_run_tokens shared by the
        learners ends the run first."""
        steps = self.trainer.max_steps
        if self.trainer.max_run_tokens is not None and self.tokens_per_step():
            steps = min(steps, self.trainer.max_run_tokens / (len(self.learners) * self.tokens_per_step()))
        return steps / self.sync.interval_steps

    def outer_momentum(self) -> float:
        """syncer.outer_optimizer.momentum; "auto": 1 - 1 / (a tenth of syncs_per_fragment()),
        within [0.5, 0.7]."""
        momentum = self.syncer.outer_optimizer.momentum
        if momentum != "auto":
            return momentum
        memory = MOMENTUM_MEMORY_SHARE * self.syncs_per_fragment()  # in sync periods
        return min(MAX_AUTO_MOMENTUM, max(MIN_AUTO_MOMENTUM, 1.0 - 1.0 / memory))

    def shard(self, index: int) -> ShardConfig:
        if not 0 <= index < len(self.shards):
            raise ConfigError(f"shards: no shard with index {index} (the config has {len(self.shards)})")
        return self.shards[index]


def _check_relations(cfg: Config) -> None:
    """Constraints between keys that a per-field schema cannot express."""
    sync, syncer = cfg.sync, cfg.syncer
    if sync.overlap_steps >= sync.interval_steps:
        raise ConfigError(f"sync.overlap_steps: tau={sync.overlap_steps} must be smaller than "
                          f"sync.interval_steps (H={sync.interval_steps})")
    if sync.codec not in CODEC_NAMES:
        raise ConfigError(f"sync.codec: unknown codec {sync.codec!r} (valid: {', '.join(CODEC_NAMES)})")
    if syncer.quorum > len(cfg.learners):
        raise ConfigError(f"syncer.quorum: K={syncer.quorum} exceeds the number of learners "
                          f"(M={len(cfg.learners)})")
    if len(cfg.shards) > sync.fragments:
        raise ConfigError(f"shards: {len(cfg.shards)} shards but only sync.fragments={sync.fragments} "
                          f"fragments; a shard would own nothing")
    if cfg.trainer.heartbeat_seconds * 2 > syncer.lease_seconds:
        raise ConfigError(f"syncer.lease_seconds: {syncer.lease_seconds} must be at least twice "
                          f"trainer.heartbeat_seconds ({cfg.trainer.heartbeat_seconds})")
    for key, items, field in (("learners", cfg.learners, "id"), ("shards", cfg.shards, "address")):
        seen = set()
        for i, item in enumerate(items):
            value = getattr(item, field)
            if value in seen:
                raise ConfigError(f"{key}[{i}].{field}: duplicate value {value!r}")
            seen.add(value)
    regions = sorted({learner.region for learner in cfg.learners})
    for region in cfg.links:
        if region not in regions:
            raise ConfigError(f"links.{region}: no learner is in region {region!r} "
                              f"(the learners' regions: {', '.join(regions)})")
    for i, shard in enumerate(cfg.shards):
        if shard.health_port and str(shard.health_port) == shard.address.rsplit(":", 1)[1]:
            raise ConfigError(f"shards[{i}].health_port: {shard.health_port} is the port of "
                              f"shards[{i}].address; the plaintext health port needs a port of its own")
    if isinstance(cfg.model, str) and syncer.max_tokens_per_step is None:
        raise ConfigError("syncer.max_tokens_per_step: required with a model factory (a shard cannot know its "
                          "seq_len): trainer.batch_size x trainer.grad_accum_steps x seq_len x processes per "
                          "learner island")
    if isinstance(cfg.model, GPTConfig) and cfg.model.n_embd % cfg.model.n_head:
        raise ConfigError(f"model.n_embd: {cfg.model.n_embd} is not divisible by "
                          f"model.n_head ({cfg.model.n_head})")


# Mappings whose keys the user names (regions, which may hold dashes), unlike any other key.
NAMED_KEYS = ("links",)


def _key_path(loc: tuple, written: bool = False) -> str:
    # pydantic reports union members by type name ("GPTConfig", "constrained-str"):
    # they are not keys the user wrote, so drop them. `written`: the last part is a key as the
    # user wrote it (an unknown one: intervalSteps), kept whatever its spelling.
    parts, previous = [], None
    for i, part in enumerate(loc):
        if isinstance(part, int):
            parts.append(f"[{part}]")
        elif previous in NAMED_KEYS or re.fullmatch(r"[a-z_][a-z0-9_]*", part) or (written and i == len(loc) - 1):
            parts.append(("." if parts else "") + part)
        previous = part
    return "".join(parts) or "(top level)"


@functools.cache
def _known_keys() -> tuple[str, ...]:
    """Every key a config section has, for suggestions."""
    sections, seen = [_Section], set()
    while sections:
        section = sections.pop()
        seen.update(section.model_fields)
        sections.extend(section.__subclasses__())
    return tuple(sorted(seen))


def _suggestion(key: str) -> str:
    """ (did you mean interval_steps?) for intervalSteps, interval-steps or interval_step."""
    snake = re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", str(key)).replace("-", "_").lower()
    close = difflib.get_close_matches(snake, _known_keys(), n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""


def validation_message(exc: ValidationError) -> str:
    """pydantic's errors as one line, each naming the key the user wrote."""
    lines = []
    for err in exc.errors():
        detail = err["msg"]
        unknown = err["type"] in ("extra_forbidden", "unexpected_keyword_argument")  # models, dataclasses
        if unknown:
            detail = "unknown key" + _suggestion(err["loc"][-1])
        elif "input" in err and err["type"] != "missing" and not isinstance(err["input"], (dict, list)):
            detail += f" (got {err['input']!r})"
        lines.append(f"{_key_path(err['loc'], written=unknown)}: {detail}")
    return "; ".join(dict.fromkeys(lines))


def parse_config(data: object, source: str = "config") -> Config:
    """Validates an already-parsed YAML document."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        cfg = Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {validation_message(exc)}") from None
    try:
        _check_relations(cfg)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return cfg


class ConfigLoader(yaml.SafeLoader):
    """SafeLoader that reads 1e-4 as a float (YAML 1.1 would make it a string) and refuses a key
    given twice in one mapping (where the last would silently win)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def load_config(path: str | pathlib.Path) -> Config:
    path = pathlib.Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from None
    try:
        data = yaml.load(text, Loader=ConfigLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return parse_config(data, source=str(path))


def resolve_factory(spec: str, key: str) -> Callable:
    """The callable a "pkg.module:factory" string names: imports the module and looks the
    name up, calls nothing. ConfigError naming `key` (model, data) and what is wrong."""
    module_name, _, name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"{key}: {spec!r}: cannot import module {module_name!r}: {exc} "
                          f"(is it installed, or on PYTHONPATH?)") from None
    except Exception as exc:  # the module's own code failed: a SyntaxError, an error at import
        raise ConfigError(f"{key}: {spec!r}: importing module {module_name!r} failed: "
                          f"{type(exc).__name__}: {exc}") from None
    factory = getattr(module, name, None)
    if factory is None:
        raise ConfigError(f"{key}: {spec!r}: module {module_name!r} has no attribute {name!r}")
    if not callable(factory):
        raise ConfigError(f"{key}: {spec!r}: {name!r} is a {type(factory).__name__}, not callable")
    return factory


def check_factories(cfg: Config) -> None:
    """Resolves the model and data factories (or the transformers class) a config names instead
    of the built-in ones, so that a typo fails here rather than in every learner at start-up."""
    for key in ("model", "data"):
        spec = getattr(cfg, key)
        if isinstance(spec, str):
            resolve_factory(spec, key)
    if isinstance(cfg.model, TransformersModelConfig):
        transformers_config(cfg.model)


def transformers_class(spec: TransformersModelConfig) -> type:
    """The causal LM class `model.transformers` names. ConfigError naming the key."""
    if ":" in spec.transformers:
        return resolve_factory(spec.transformers, "model.transformers")
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"model.transformers: {spec.transformers!r} needs the transformers package "
                          "(pip install 'diloco[hf]')") from None
    model_class = getattr(transformers, spec.transformers, None)
    if not isinstance(model_class, type) or not hasattr(model_class, "config_class"):
        raise ConfigError(f"model.transformers: transformers has no model class {spec.transformers!r} "
                          "(e.g. LlamaForCausalLM, GPT2LMHeadModel)")
    return model_class


def transformers_config(spec: TransformersModelConfig):
    """The model's transformers config (a PretrainedConfig) from `model.config`. ConfigError
    naming the key that does not fit the byte-level data."""
    model_class = transformers_class(spec)
    try:
        config = model_class.config_class(**spec.config)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"model.config: {error}") from None
    config.architectures = [model_class.__name__]  # as save_pretrained writes it
    vocab_size = getattr(config, "vocab_size", None)
    if not isinstance(vocab_size, int) or vocab_size < 256:
        raise ConfigError(f"model.config.vocab_size: {vocab_size!r}; the learner's tokens are bytes, so it must "
                          "be at least 256")
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and positions < spec.seq_len:
        raise ConfigError(f"model.seq_len: {spec.seq_len} is longer than model.config.max_position_embeddings "
                          f"({positions})")
    return config


def check_state_folder(folder: pathlib.Path) -> None:
    """Creates a process's state folder if need be, and a file in it: a process that cannot
    keep its state fails at start rather than at its first write. OSError naming the folder."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise OSError(error.errno, error.strerror, str(folder)) from None


def dump_config(cfg: Config) -> str:
    """YAML text that load_config reads back to an equal Config."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
