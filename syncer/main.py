"""`diloco syncer --config C --shard-index I`: run one syncer shard until SIGTERM.

The shard restores its state from `<run.state_dir>/shard-<I>/` (or --state-dir), serves the
Syncer service with health and reflection, and on SIGTERM or SIGINT reports NOT_SERVING,
lets in-flight calls drain, closes its files and exits 0. A shard whose state holds a run's
progress says that it resumes it: a restart must, and a new run is asked for with --new-run,
which keeps the earlier run's state beside the new one.
"""
from __future__ import annotations

import argparse
import logging
import pathlib
import sys
import time

from diloco.services.contract.config import ConfigError, load_config
from diloco.services.metrics import serve
from diloco.syncer.metrics import SyncerMetrics
from diloco.services.memory import keep_freed_memory
from diloco.syncer.service import start_shard
from diloco.syncer.store_format import StoreError, shard_state_dir

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
    parser.add_argument("--new-run", action="store_true",
                        help="start a new run: move the state of the run shard-<I>/ holds aside to "
                             "shard-<I>.replaced-<time>/ (without it the shard resumes that run)")


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
    if args.new_run:
        set_aside_earlier_run(shard_state_dir(args.state_dir or cfg.run.state_dir, args.shard_index))
    try:
        handle = start_shard(cfg, args.shard_index, listen, args.state_dir, tls_dir=args.tls_dir,
                             health_listen=f"{host}:{health_port}" if health_port else None)
    except ConfigError as error:  # no certificate where the config says
        print(f"invalid: {error}", file=sys.stderr)
        return 2
    except (StoreError, ValueError, OSError) as error:  # damaged state, another plan, port taken
        log.error("shard %d cannot start: %s", args.shard_index, error)
        return 1
    resumed = [f for f in handle.core.status().fragments if f.version > 0]
    if resumed:
        log.warning("shard %d resumes run %r from its state in %s: fragments %s, %d tokens merged; to start "
                    "a new run instead, start it with --new-run", args.shard_index, cfg.run.name,
                    handle.store.directory, ", ".join(f"{f.id}: v{f.version}" for f in resumed),
                    max(f.merged_tokens for f in resumed))
    metrics_port = cfg.shard(args.shard_index).metrics_port
    if metrics_port:
        metrics = SyncerMetrics(handle.core.status, handle.servicer.certificates)
        handle.core.round_listeners.append(metrics.round_closed)
        serve(metrics.registry, metrics_port, cfg.run.listen_host)
    log.info("shard %d serving on %d", args.shard_index, handle.port)
    if warning := cfg.momentum_warning():
        log.warning("shard %d: %s", args.shard_index, warning)
    handle.server.serve_until_signal(args.drain_seconds)
    handle.stop()
    log.info("shard %d stopped", args.shard_index)
    return 0


def set_aside_earlier_run(folder: pathlib.Path) -> None:
    """Moves a shard's state folder aside (to <folder>.replaced-<unix time>), so the shard starts
    a new run, empty, and the earlier run's state is kept."""
    if not folder.is_dir() or not any(folder.iterdir()):
        return
    kept = folder.with_name(f"{folder.name}.replaced-{int(time.time())}")
    folder.rename(kept)
    log.warning("starting a new run: the earlier run's state of %s is kept in %s", folder.name, kept)


def _bracketed(host: str) -> str:
    """An IPv6 address as gRPC takes it in host:port."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
