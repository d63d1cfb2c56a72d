"""One YAML file describes a whole run: shards, learners, the sync schedule, the
syncer's outer loop, the learners' inner loop, the model and the data.

    cfg = load_config("examples/local-4-regions.yaml")

Loading validates everything up front. An unknown key, a wrong type or an
impossible value raises ConfigError naming the key (`sync.overlap_steps: ...`),
so a bad file never starts a process. Symbols from the papers are given beside
the keys: H, P, tau, alpha, K.

The sections live by who reads them: shared.py (both roles), learner.py (the learner's model,
data and inner loop), links.py (the local cluster's emulated links); loading.py holds Config
and reads the file. Import from here.
"""
from diloco.services.contract.config.base import ConfigError, Identifier
from diloco.services.contract.config.learner import (CorpusConfig, GPTConfig, InnerOptimizerConfig, IslandConfig,
                                                      TrainerConfig, TransformersModelConfig, resolve_factory,
                                                      transformers_class, transformers_config)
from diloco.services.contract.config.links import LinkConfig
from diloco.services.contract.config.loading import (Config, ConfigLoader, check_factories, check_state_folder,
                                                      dump_config, load_config, parse_config, validation_message)
from diloco.services.contract.config.shared import (GraceConfig, LearnerConfig, LimitsConfig, OuterOptimizerConfig,
                                                     RpcConfig, RunConfig, ShardConfig, SyncConfig, SyncerConfig,
                                                     TlsConfig)

__all__ = ["Config", "ConfigError", "ConfigLoader", "CorpusConfig", "GPTConfig", "GraceConfig", "Identifier",
           "InnerOptimizerConfig", "IslandConfig", "LearnerConfig", "LimitsConfig", "LinkConfig",
           "OuterOptimizerConfig", "RpcConfig", "RunConfig", "ShardConfig", "SyncConfig", "SyncerConfig", "TlsConfig",
           "TrainerConfig", "TransformersModelConfig",
           "check_factories", "check_state_folder", "dump_config", "load_config", "parse_config",
           "resolve_factory", "transformers_class", "transformers_config", "validation_message"]
