"""`diloco syncer --config C --shard-index I`: run one syncer shard until SIGTERM.

The shard restores its state from `<run.state_dir>/shard-<I>/` (or --state-dir), serves the
Syncer service with health and reflection, and on SIGTERM or SIGINT reports NOT_SERVING,
lets in-flight calls drain, closes its files and exits 0.
"""
from __future__ import annotations

import argparse
import logging
import sys

from diloco.services.contract.config import ConfigError, load_config
from diloco.services.metrics import serve
from diloco.syncer.metrics import SyncerMetrics
from diloco.syncer.memory import keep_freed_memory
from diloco.syncer.service import start_shard
from diloco.syncer.store import StoreError

log = logging.getLogger("syncer")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="path to the cluster YAML file")
    parser.add_argument("--shard-index", type=int, required=True, help="which of the config's shards this is")
    parser.add_argument("--listen", help="host:port to bind (default: run.listen_host, else every interface, on the port of the shard's address)")
    parser.add_argument("--state-dir", help="folder holding shard-<I>/ (default: run.state_dir of the config)")
    parser.add_argument("--tls-dir", help="folder with this shard's ca.crt, tls.crt and tls.key "
                        "(default: <tls.dir>/shard-<I> of the config)")
    parser.add_argument("--drain-seconds", type=float, default=5.0,
                        help="how long in-flight calls may finish after SIGTERM")


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config)
        address = cfg.shard(args.shard_index).address
    except ConfigError as error:
        print(f"invalid: {error}", file=sys.stderr)
        return 2
    host = _bracketed(cfg.run.listen_host or "::")
    listen = args.listen or f"{host}:{address.rsplit(':', 1)[1]}"
    health_port = cfg.shard(args.shard_index).health_port
    keep_freed_memory()
    try:
        handle = start_shard(cfg, args.shard_index, listen, args.state_dir, tls_dir=args.tls_dir,
                             health_listen=f"{host}:{health_port}" if health_port else None)
    except ConfigError as error:  # no certificate where the config says
        print(f"invalid: {error}", file=sys.stderr)
        return 2
    except (StoreError, ValueError, OSError) as error:  # damaged state, another plan, port taken
        log.error("shard %d cannot start: %s", args.shard_index, error)
        return 1
    metrics_port = cfg.shard(args.shard_index).metrics_port
    if metrics_port:
        metrics = SyncerMetrics(handle.core.status)
        handle.core.round_listeners.append(metrics.round_closed)
        serve(metrics.registry, metrics_port, cfg.run.listen_host)
    log.info("shard %d serving on %d", args.shard_index, handle.port)
    handle.server.serve_until_signal(args.drain_seconds)
    handle.stop()
    log.info("shard %d stopped", args.shard_index)
    return 0


def _bracketed(host: str) -> str:
    """An IPv6 address as gRPC takes it in host:port."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
