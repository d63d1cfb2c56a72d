"""The learner's own settings: the built-in learner's inner loop and island, the model it
builds (built-in, transformers, or a factory of the user's) and its data."""
from __future__ import annotations

import importlib
from typing import Annotated, Any, Callable, Literal, Union

from pydantic import Discriminator, Field, Tag

from diloco.services.contract.config.base import ConfigError, NonNegativeInt, PositiveFloat, PositiveInt, Section


class InnerOptimizerConfig(Section):
    lr: PositiveFloat = 4.0e-4
    weight_decay: Annotated[float, Field(ge=0.0)] = 0.1
    beta1: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.9
    beta2: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.95
    warmup_steps: NonNegativeInt = 50
    min_lr_ratio: Annotated[float, Field(ge=0.0, le=1.0)] = 0.1  # cosine decays to lr * ratio
    grad_clip: Annotated[float, Field(ge=0.0)] = 1.0  # 0 disables clipping


class TrainerConfig(Section):
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
    # A learner whose model holds NaN or Inf, or whose pushes the shards refuse as outliers this
    # many times in a row, takes the global model back (learner/sync/healing.py); sick again
    # within heal_window_steps of that (None: 4 sync periods), it stops.
    heal_after_refusals: PositiveInt = 2
    heal_window_steps: PositiveInt | None = None
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


class IslandConfig(Section):
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
    # At the island's start (its lease never taken) a group other than group 0 waits this long
    # for group 0 to lead, then leads itself. Once the island has had a leader, a free lease
    # means it left, and the first group to find it free leads at once.
    leader_wait_seconds: PositiveFloat = 60.0


class GPTConfig(Section):
    """The built-in byte-level models: GPT (learner/trainer/model.py) or a Llama-style decoder
    (learner/trainer/model.py: RMSNorm, rotary positions, SwiGLU)."""
    family: Literal["gpt", "llama"] = "gpt"
    n_layer: PositiveInt = 2
    n_head: PositiveInt = 4
    n_embd: PositiveInt = 128
    seq_len: PositiveInt = 128
    dropout: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0


class TransformersModelConfig(Section):
    """Any Hugging Face transformers causal LM (the `hf` extra), built from its config with random
    weights (nothing is downloaded) and trained on the built-in data's bytes as tokens: its
    class (a transformers class name, e.g. LlamaForCausalLM, or "pkg.module:Class"), the keyword
    arguments of that class's config (vocab_size at least 256), and the context it trains on."""
    transformers: Annotated[str, Field(pattern=r"^([A-Za-z_][\w.]*:)?[A-Za-z_]\w*$")]
    config: dict[str, Any] = {}
    seq_len: PositiveInt


Factory = Annotated[str, Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")]  # "pkg.module:factory"


def model_kind(value: object) -> str:
    """Which form of `model:` a value is, so that an error speaks of that form's keys only (the
    tags are not keys: _key_path leaves them out)."""
    if isinstance(value, str):
        return "Factory"
    if isinstance(value, TransformersModelConfig) or (isinstance(value, dict) and "transformers" in value):
        return "TransformersModelConfig"
    return "GPTConfig"


ModelSpec = Annotated[Union[Annotated[Factory, Tag("Factory")],
                            Annotated[TransformersModelConfig, Tag("TransformersModelConfig")],
                            Annotated[GPTConfig, Tag("GPTConfig")]], Discriminator(model_kind)]


class CorpusConfig(Section):
    """A byte-level corpus: the Python standard library's own .py sources (python-stdlib), or
    your own text files (files: glob patterns, "**" recursing, relative to the directory the
    learner starts in), read in sorted order."""
    corpus: Literal["python-stdlib", "files"] = "python-stdlib"
    files: list[str] = []
    validation_fraction: Annotated[float, Field(gt=0.0, lt=0.5)] = 0.05
    max_bytes: PositiveInt | None = None  # read at most this much of the corpus


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
