"""The whole file: Config, its sections' relations, and loading and dumping it (ConfigError
naming the key, as written, with a suggestion for a typo)."""
from __future__ import annotations

import difflib
import functools
import pathlib
import re
import tempfile
import typing
from typing import Annotated, Union

import yaml
from pydantic import Field, ValidationError

from diloco.services.contract.codecs import CODEC_NAMES
from diloco.services.contract.config.base import ConfigError, Identifier, Section
from diloco.services.contract.config.learner import (CorpusConfig, Factory, GPTConfig, IslandConfig, ModelSpec,
                                                      TrainerConfig, TransformersModelConfig, resolve_factory,
                                                      transformers_config)
from diloco.services.contract.config.links import LinkConfig
from diloco.services.contract.config.shared import (MAX_AUTO_MOMENTUM, MIN_AUTO_MOMENTUM, MOMENTUM_MEMORY_SHARE,
                                                     MOMENTUM_WARNING_MARGIN, LearnerConfig, LimitsConfig, RpcConfig, RunConfig, ShardConfig,
                                                     SyncConfig, SyncerConfig, TlsConfig)


class Config(Section):
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
        return self.auto_momentum() if momentum == "auto" else momentum

    def auto_momentum(self) -> float:
        memory = MOMENTUM_MEMORY_SHARE * self.syncs_per_fragment()  # in sync periods
        return min(MAX_AUTO_MOMENTUM, max(MIN_AUTO_MOMENTUM, 1.0 - 1.0 / memory))

    def momentum_warning(self) -> str | None:
        """What an outer momentum set well above `auto` for this run's length is likely to
        cost (docs/protocol.md, "Outer momentum"); None when it is not."""
        momentum, auto = self.outer_momentum(), self.auto_momentum()
        if self.syncer.outer_optimizer.momentum == "auto" or momentum <= auto + MOMENTUM_WARNING_MARGIN:
            return None
        return (f"syncer.outer_optimizer.momentum: {momentum:g} remembers about {1 / (1 - momentum):.0f} sync "
                f"periods, where the run syncs each fragment {self.syncs_per_fragment():.0f} times; `auto` would "
                f"choose {auto:.2f}. A memory that long carries an earlier stage of training's outer gradients into "
                f"later ones and overshoots: measured against data parallel in docs/protocol.md, \"Outer momentum\"")

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
    if isinstance(cfg.data, CorpusConfig) and (cfg.data.corpus == "files") != bool(cfg.data.files):
        raise ConfigError("data.files: glob patterns are needed with corpus 'files', and read only with it "
                          f"(corpus {cfg.data.corpus!r}, {len(cfg.data.files)} pattern(s))")
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
def _known_paths() -> dict[str, tuple[str, ...]]:
    """Every key of the config by name: the dotted paths where it is (interval_steps:
    sync.interval_steps), for suggestions."""
    paths: dict[str, list[str]] = {}
    pending: list[tuple[str, type[Section]]] = [("", Config)]
    while pending:
        prefix, section = pending.pop()
        for name, field in section.model_fields.items():
            path = f"{prefix}{name}"
            paths.setdefault(name, []).append(path)
            for inner in _sections_in(field.annotation):
                pending.append((f"{path}[]." if _is_list(field.annotation) else f"{path}.", inner))
    return {name: tuple(sorted(found)) for name, found in paths.items()}


def _sections_in(annotation: object) -> list[type[Section]]:
    """The config sections an annotation holds (itself, in a list, a union or a mapping)."""
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return [annotation]
    return [inner for arg in typing.get_args(annotation) for inner in _sections_in(arg)]


def _is_list(annotation: object) -> bool:
    return typing.get_origin(annotation) is list or any(_is_list(arg) for arg in typing.get_args(annotation))


def _suggestion(key: str, where: str) -> str:
    """ (did you mean sync.interval_steps?) for intervalSteps, interval-steps or interval_step
    written in sync, or for interval_steps written at the top level: the closest key, where it is."""
    snake = re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", str(key)).replace("-", "_").lower()
    close = difflib.get_close_matches(snake, _known_paths(), n=1, cutoff=0.75)
    if not close:
        return ""
    paths = _known_paths()[close[0]]
    section = re.sub(r"\[\d+\]", "[]", where.rpartition(".")[0] if "." in where else "")
    here = [path for path in paths if path.rpartition(".")[0] == section]
    return f" (did you mean {(here or paths)[0]}?)"


# Keys only a `diloco plan` input file has (planner/inputs.py; tests/test_config.py keeps them so).
PLAN_FILE_KEYS = ("chips", "chip_mtbf_hours", "model_parameters", "step_seconds", "wan_gbps")


def validation_message(exc: ValidationError) -> str:
    """pydantic's errors as one line, each naming the key the user wrote."""
    lines = []
    for err in exc.errors():
        detail = err["msg"]
        unknown = err["type"] in ("extra_forbidden", "unexpected_keyword_argument")  # models, dataclasses
        if unknown:
            detail = "unknown key" + _suggestion(err["loc"][-1], _key_path(err["loc"], written=True))
        elif "input" in err and err["type"] != "missing" and not isinstance(err["input"], (dict, list)):
            detail += f" (got {err['input']!r})"
        lines.append(f"{_key_path(err['loc'], written=unknown)}: {detail}")
    return "; ".join(dict.fromkeys(lines))


def parse_config(data: object, source: str = "config") -> Config:
    """Validates an already-parsed YAML document."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    plan_keys = [key for key in PLAN_FILE_KEYS if key in data]
    if plan_keys and "shards" not in data:
        raise ConfigError(f"{source}: a `diloco plan` input file ({', '.join(plan_keys)}), not a cluster config: "
                          f"run `diloco plan --config {source}`")
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


def check_factories(cfg: Config) -> None:
    """Resolves the model and data factories (or the transformers class) a config names instead
    of the built-in ones, so that a typo fails here rather than in every learner at start-up."""
    for key in ("model", "data"):
        spec = getattr(cfg, key)
        if isinstance(spec, str):
            resolve_factory(spec, key)
    if isinstance(cfg.model, TransformersModelConfig):
        transformers_config(cfg.model)


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
