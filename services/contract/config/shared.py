"""The settings both roles read: the run, its shards and learners, the sync schedule, the
syncer's outer loop, the RPC limits and TLS. A shard sends the sync settings to every learner
that joins and the learner checks them against its own (services/contract/settings.py)."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from diloco.services.contract.config.base import (HostPort, Identifier, NonNegativeInt, Port, PositiveFloat,
                                                   PositiveInt, Section)
from diloco.services.contract.config.links import LinkConfig


class RunConfig(Section):
    name: Identifier = "diloco"
    seed: NonNegativeInt = 0
    state_dir: str = ".diloco"  # shards and learners keep their state below this folder
    # The host every server of the run binds: shards' gRPC and health ports, /metrics of shards
    # and learners. None: every interface ([::] for gRPC, 0.0.0.0 for /metrics), which shards
    # reached from other regions need; gRPC is mutual TLS, health and /metrics are plaintext
    # (docs/security.md). The local cluster and `diloco sim` set 127.0.0.1.
    listen_host: str | None = None


class ShardConfig(Section):
    address: HostPort  # host:port learners dial; the shard listens on this port
    metrics_port: Port = 9100  # 0 disables the /metrics endpoint
    # A plaintext port that serves grpc.health.v1 and nothing else, for probes that cannot
    # present a client certificate (Kubernetes gRPC probes, compose healthchecks). 0: none.
    health_port: Port = 0


class LearnerConfig(Section):
    id: Identifier
    region: Identifier
    metrics_port: Port = 9100
    link: LinkConfig | None = None  # this learner's own link, instead of its region's (links)
    # Each inner step takes this many times as long as its compute (the learner sleeps the
    # rest): a slower hardware generation in the same run, for benchmarks and tests.
    slowdown: Annotated[float, Field(ge=1.0)] = 1.0


class SyncConfig(Section):
    fragments: PositiveInt = 4  # P
    interval_steps: PositiveInt = 24  # H: each fragment is synced every H inner steps
    overlap_steps: NonNegativeInt = 2  # tau: apply a sync's result tau steps after it started
    mix_alpha: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0  # alpha: 0 overwrites, 0.5 averages
    # With tau > 0, how long the training loop waits for a result that is late before it
    # trains on and applies the result when it arrives (tau = 0 always waits: lockstep).
    # Bounded, because learners blocked on each other's rounds could otherwise wait forever.
    max_block_seconds: Annotated[float, Field(ge=0.0)] = 2.0
    # And at most this many of the learner's own step times (a moving average), where set: a
    # result late by the learners' jitter is merged a step late rather than waited for.
    max_block_steps: Annotated[float, Field(ge=0.0)] | None = None
    # A learner whose own push and pull take longer than tau steps (a slow link) cannot have
    # its results in time: true waits for them all the same (late results cost quality,
    # docs/protocol.md); false trains on and merges them late, never idle for its own link.
    wait_for_own_link: bool = True
    codec: str = "int4"
    codec_block_size: PositiveInt = 128
    fragmentation: Literal["balanced", "strided"] = "balanced"


class GraceConfig(Section):
    # fixed: wait `seconds` after quorum; adaptive: gamma * (tau*step - quorum - sync time),
    # from moving averages, capped by `seconds`.
    mode: Literal["fixed", "adaptive"] = "adaptive"
    seconds: Annotated[float, Field(ge=0.0)] = 1.0
    gamma: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.5


class OuterOptimizerConfig(Section):
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
MOMENTUM_WARNING_MARGIN = 0.1  # a momentum this far above auto's is warned about


class SyncerConfig(Section):
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
    # Values a fragment keeps in memory of what it served learners (their anchors) besides its
    # committed value and the one before it: 4 B per owned parameter each, whatever the number
    # of learners (as many as learners keeps each one's newest).
    kept_anchors: NonNegativeInt = 0
    # Values of learners' newest anchors beyond kept_anchors go to <state folder>/anchors/ (4 B
    # per owned parameter each, read back for that learner's next pull, not durable). false:
    # they are dropped, and a learner whose anchor's value was dropped pulls the exact updates
    # since (or a snapshot) instead of one delta; raise kept_anchors then.
    spill_anchors: bool = True
    # A fragment's state is written in full once the contributions logged since the last full
    # write reach this many times its size (16 bytes per parameter); a restart replays them.
    # 0: after every round.
    snapshot_log_ratio: Annotated[float, Field(ge=0.0)] = 1.0
    lease_seconds: PositiveFloat = 5.0
    max_update_norm: PositiveFloat = 1.0e4  # pushes whose decoded L2 norm is larger are refused
    # A push whose L2 norm is more than this many times the norm of the fragment's global value
    # is refused as an outlier (syncer/outliers.py). None: off.
    outlier_norm_factor: PositiveFloat | None = 10.0
    # The most tokens one learner (every process of its island) trains on per inner step: bounds
    # what its pushes and heartbeats may claim (syncer/claims.py). None: Config.tokens_per_step()
    # (trainer.batch_size x trainer.grad_accum_steps x model.seq_len) x island.replica_groups, the
    # built-in GPT with one process per replica group; required with a model factory.
    max_tokens_per_step: PositiveInt | None = None


class RpcConfig(Section):
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


class TlsConfig(Section):
    # mtls: every connection is TLS with a certificate of the run's CA on both ends, and a
    # learner may only act as the learner id its certificate names. plaintext: neither
    # encryption nor authentication, for a network that is trusted as a whole; it must be
    # written out, the default is mtls.
    mode: Literal["mtls", "plaintext"] = "mtls"
    # Holds one folder per process (shard-<i>, learner-<id>, operator), each with ca.crt,
    # tls.crt and tls.key, as `diloco certs` writes them; None: <run.state_dir>/certs. A
    # process given --tls-dir reads its own folder from there instead (a mounted Secret).
    dir: str | None = None


class LimitsConfig(Section):
    """What one peer may ask of a shard. Beyond a limit the call is refused (RESOURCE_EXHAUSTED,
    DEADLINE_EXCEEDED for a stalled push) and what it sent so far is discarded."""
    max_push_bytes: Annotated[int, Field(gt=0)] = 1 << 30  # encoded payload of one push
    # At least 16: a seed of up to 16 MiB comes in 16 chunks (services/contract/payload.py).
    max_chunks_per_push: Annotated[int, Field(ge=16)] = 4096
    # Longest gap between two messages of a push stream: a push that trickles (slow loris)
    # is cut off. A whole push may take rpc.deadline_seconds per MiB, as clients allow it.
    push_idle_seconds: PositiveFloat = 30.0
    # Pushes and pulls in flight at once from one client certificate (one connection
    # in plaintext mode).
    max_streams_per_peer: PositiveInt = 16
    # Largest model a Join may declare (sum of the manifest's tensor sizes): the first Join
    # fixes the plan, and every shard allocates its share of it.
    max_parameters: PositiveInt = 1 << 35
