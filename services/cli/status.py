"""`diloco status --syncer ADDR[,ADDR...]` (or `--config C`): the cluster as its shards see it.

Every shard answers the Status RPC for the fragments it owns and for the learners it tracks;
each shard holds every learner's lease itself (docs/protocol.md, Leases), so a learner is
listed once with the shards' views merged: alive on how many shards, staleness summed over the
shards' fragments, the latest step any shard heard of. Exit status 1 when a shard does not answer.

Status is read-only: a shard answers any client certificate of the run's CA. By default this
presents the operator's (`<tls.dir>/operator`, made by `diloco certs`); --tls-dir names another
folder. With --syncer there is no config to say plaintext: give --tls-dir or --plaintext.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time
from dataclasses import dataclass, field

import grpc

from diloco.services.client import ShardClient
from diloco.services.contract.config import ConfigError, RpcConfig, load_config
from diloco.services.contract.tls import OPERATOR, Identity, load_identity, read_identity
from diloco.services.contract.wire import pb

HASH_PREFIX = 12
# Refusals a healthy run has: learners racing to seed a fragment, a push retried after its
# reply was lost, a restore offered to a shard that already holds the version.
HARMLESS_REFUSALS = frozenset({"already_seeded", "duplicate", "not_restorable"})
EXPIRY_WARNING_DAYS = 14  # as the alert DilocoCertificateExpiresSoon (deploy/prometheus/diloco-rules.yml)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--syncer", help="comma-separated host:port of the shards to ask")
    source.add_argument("--config", help="cluster YAML file: ask every shard it lists")
    parser.add_argument("--tls-dir", help="folder with the ca.crt, tls.crt and tls.key to present "
                        "(default with --config: <tls.dir>/operator)")
    parser.add_argument("--plaintext", action="store_true",
                        help="with --syncer: the shards run with tls.mode plaintext")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds each shard may take to answer")


@dataclass
class LearnerRow:
    """One learner as all answering shards see it together."""
    id: str
    region: str
    incarnation: int
    alive_on: int = 0
    known_on: int = 0
    staleness: int = 0
    last_step: int = 0
    seconds_since_heartbeat: float = float("inf")


@dataclass
class ClusterView:
    replies: list[tuple[str, pb.StatusResponse]] = field(default_factory=list)
    failures: list[tuple[str, str]] = field(default_factory=list)  # (address, why)

    def learners(self) -> list[LearnerRow]:
        rows: dict[str, LearnerRow] = {}
        for _, reply in self.replies:
            for l in reply.learners:
                row = rows.setdefault(l.learner_id, LearnerRow(l.learner_id, l.region, l.incarnation))
                if l.incarnation > row.incarnation:  # a shard that heard of a newer process
                    row.incarnation, row.region = l.incarnation, l.region
                row.known_on += 1
                row.alive_on += l.alive
                row.staleness += l.staleness
                row.last_step = max(row.last_step, l.last_step)
                row.seconds_since_heartbeat = min(row.seconds_since_heartbeat, l.seconds_since_heartbeat)
        return sorted(rows.values(), key=lambda row: row.id)

    def fragments(self) -> list[tuple[int, pb.FragmentStatus]]:
        """(shard index, fragment) in fragment order."""
        return sorted(((reply.shard_index, f) for _, reply in self.replies for f in reply.fragments),
                      key=lambda item: item[1].fragment_id)

    def certificates(self) -> list[pb.CertificateStatus]:
        """Every certificate some shard reported (by name and serial), revoked if any says so."""
        merged: dict[tuple[str, str], pb.CertificateStatus] = {}
        for _, reply in self.replies:
            for c in reply.certificates:
                key = (c.name, c.serial)
                if key not in merged or c.revoked:
                    merged[key] = c
        return sorted(merged.values(), key=lambda c: (c.name, c.expires_unix_seconds))

    def counters(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for _, reply in self.replies:
            for name, value in reply.counters.items():
                total[name] = total.get(name, 0) + value
        return total


def ask(addresses: list[str], rpc: RpcConfig, identity: Identity | None, timeout: float) -> ClusterView:
    view = ClusterView()
    for address in addresses:
        try:
            with ShardClient(address, rpc, identity=identity) as client:
                view.replies.append((address, client.status(timeout=timeout)))
        except grpc.RpcError as error:
            view.failures.append((address, f"{error.code().name} {error.details() or ''}".strip()))
    return view


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows)]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip()
                     for line in [headers, *rows])


def _alive(row: LearnerRow) -> str:
    if row.alive_on == row.known_on:
        return "yes"
    return "no" if row.alive_on == 0 else f"{row.alive_on}/{row.known_on} shards"


def _last_round(fragment: pb.FragmentStatus, now: float) -> str:
    if not fragment.HasField("last_round"):
        return "-"
    r = fragment.last_round
    return (f"#{r.round} {r.close_reason}, contributors {r.contributors}, {r.duration_seconds:.2f}s, "
            f"{max(0.0, now - r.closed_unix_seconds):.0f}s ago")


def _by_reason(refusals: dict[str, float], real: bool) -> str:
    """'N (reason n, ...)' of the real refusals, or of those that races and retries cause in a
    healthy run (HARMLESS_REFUSALS)."""
    chosen = {reason: count for reason, count in refusals.items() if (reason not in HARMLESS_REFUSALS) == real}
    if not chosen:
        return "0"
    detail = ", ".join(f"{reason} {count:g}" for reason, count in sorted(chosen.items(), key=lambda kv: -kv[1]))
    return f"{sum(chosen.values()):g} ({detail})"


def _certificate_state(c: pb.CertificateStatus, now: float) -> str:
    if c.revoked:
        return "REVOKED"
    days = (c.expires_unix_seconds - now) / 86400
    return "EXPIRED" if days <= 0 else f"{days:.0f} days left" + (" (renew it)" if days < EXPIRY_WARNING_DAYS else "")


def render(view: ClusterView, asked: int, now: float) -> str:
    learners = view.learners()
    counters = view.counters()
    digests = {reply.plan_digest[:HASH_PREFIX] for _, reply in view.replies if reply.plan_digest}
    plan = ", ".join(sorted(digests)) + (" (shards disagree!)" if len(digests) > 1 else "") if digests else "none yet"
    lines = [f"shards    {len(view.replies)} of {asked} answering (fragment plan {plan})"]
    lines += [f"  {address}: {why}" for address, why in view.failures]
    lines.append(f"learners  {sum(row.alive_on > 0 for row in learners)} alive of {len(learners)} known")
    if learners:
        lines += ["", table(
            ["LEARNER", "REGION", "INCARNATION", "ALIVE", "STALENESS", "LAST STEP", "LAST HEARD", "OUTLIERS"],
            [[row.id, row.region, str(row.incarnation), _alive(row), str(row.staleness), str(row.last_step),
              f"{row.seconds_since_heartbeat:.1f}s ago", f"{counters.get(f'outliers.{row.id}', 0):g}"]
             for row in learners])]
    fragments = view.fragments()
    if fragments:
        lines += ["", table(
            ["FRAGMENT", "SHARD", "PARAMETERS", "VERSION", "HASH", "PENDING", "LAST ROUND"],
            [[str(f.fragment_id), str(shard), str(f.numel), str(f.version) if f.initialized else "unseeded",
              f.state_hash[:HASH_PREFIX] or "-", str(f.pending_contributions), _last_round(f, now)]
             for shard, f in fragments])]
    certificates = view.certificates()
    if certificates:
        revoked = max(reply.revoked_certificates for _, reply in view.replies)
        lines += ["", table(["CERTIFICATE", "SERIAL", "EXPIRES", "STATE"],
                            [[c.name, c.serial[:HASH_PREFIX] + "...", time.strftime("%Y-%m-%d", time.gmtime(c.expires_unix_seconds)),
                              _certificate_state(c, now)] for c in certificates]),
                  f"revoked   {revoked} certificate(s) in the shards' revocation list"]
    refused = counters.get("contributions.refused_stale", 0)
    refusals = {name.partition(".")[2]: count for name, count in counters.items()
                if name.startswith("refusals.") and count}
    lines += ["",
              f"totals    {sum(f.version for _, f in fragments)} outer steps over {len(fragments)} fragments",
              f"          contributions {counters.get('contributions.accepted', 0)} accepted, "
              f"{counters.get('contributions.stale_merged', 0)} stale-merged, {refused} refused as stale",
              f"          requests refused: {_by_reason(refusals, real=True)}; "
              f"races and retries: {_by_reason(refusals, real=False)}",
              f"          {counters.get('kept_compute_milliseconds', 0) / 1000:.1f} learner compute-seconds kept "
              f"(counted since each shard started)"]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        if args.config:
            cfg = load_config(args.config)
            addresses, rpc = [s.address for s in cfg.shards], cfg.rpc
            identity = load_identity(cfg, OPERATOR, args.tls_dir)
        else:
            addresses, rpc = [a.strip() for a in args.syncer.split(",") if a.strip()], RpcConfig()
            if args.plaintext == bool(args.tls_dir):
                raise ConfigError("--syncer: give --tls-dir (mutual TLS) or --plaintext, not both or neither")
            identity = None if args.plaintext else read_identity(pathlib.Path(args.tls_dir), "--tls-dir")
    except ConfigError as error:
        print(f"invalid: {error}", file=sys.stderr)
        return 2
    view = ask(addresses, rpc, identity, args.timeout)
    print(render(view, len(addresses), time.time()))
    return 1 if view.failures else 0
