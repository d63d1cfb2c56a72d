"""`diloco certs`: a CA and a certificate for every shard, learner and operator of a config, in
the folder layout services/contract/tls.py reads (a Kubernetes TLS Secret with its CA); and,
while the run goes on, renewing, revoking and rotating them (services/authority.py).

    diloco certs --config C                      a CA (kept if there) and every process's folder
    diloco certs renew --config C [NAME ...]     new certificates, the same CA (default: all)
    diloco certs revoke --config C ID|SERIAL     shut a learner (or any certificate) out
    diloco certs rotate-ca --config C --stage trust|issue|finish
    diloco certs list --config C                 every certificate, its serial and days left
    diloco certs secrets --config C | kubectl apply -f -    the Helm chart's TLS Secrets
"""
from __future__ import annotations

import argparse
import base64
import datetime
import pathlib
import sys

import yaml
from cryptography import x509

from diloco.services.authority import issue_cluster_certs, process_names, revoke, rotate_ca
from diloco.services.contract.config import ConfigError, load_config
from diloco.services.contract.revocations import CRL_FILE, RevocationList
from diloco.services.contract.tls import CA_FILE, CA_FOLDER, CERT_FILE, KEY_FILE, certs_dir, learner_name, shard_name

ACTIONS = ("renew", "revoke", "rotate-ca", "list", "secrets")
# The Helm chart's defaults (helm/diloco/values.yaml: tls.secretName, tls.learnerSecretPrefix).
SHARDS_SECRET, LEARNER_SECRET_PREFIX = "diloco-syncer-tls", "diloco-learner-tls-"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _common(parser, required=False)
    parser.add_argument("--host", action="append", default=[],
                        help="another DNS name or IP the shards are dialled by (repeatable)")
    parser.add_argument("--days", type=int, default=365, help="validity of the process certificates")
    actions = parser.add_subparsers(dest="action", metavar="ACTION",
                                    help="none: make the CA and every folder; or one of " + ", ".join(ACTIONS))
    renew = actions.add_parser("renew", help="issue new certificates from the same CA while the run goes on")
    _common(renew, required=True)
    renew.add_argument("names", nargs="*", metavar="NAME", help="shard-<i>, learner-<id> or operator (default: all)")
    renew.add_argument("--host", action="append", default=[], help="another DNS name or IP of the shards")
    renew.add_argument("--days", type=int, default=365, help="validity of the new certificates")
    revoke_parser = actions.add_parser("revoke", help="revoke a learner's certificate (or any, by serial); "
                                                     "the shards refuse it within seconds")
    _common(revoke_parser, required=True)
    revoke_parser.add_argument("target", metavar="ID|SERIAL", help="a learner id of the config, or a serial in hex")
    rotate = actions.add_parser("rotate-ca", help="replace the CA in three stages without stopping the run")
    _common(rotate, required=True)
    rotate.add_argument("--stage", required=True, choices=["trust", "issue", "finish"],
                        help="trust: every process trusts a next CA too; issue: it issues every certificate; "
                             "finish: the old CA is trusted no more")
    rotate.add_argument("--days", type=int, default=365, help="validity of the certificates the new CA issues")
    listing = actions.add_parser("list", help="every certificate of the config's folders: serial, expiry, revoked")
    _common(listing, required=True)
    secrets = actions.add_parser("secrets", help="the Helm chart's TLS Secrets as Kubernetes manifests, from the "
                                                 "folders: pipe them into `kubectl apply -f -`")
    _common(secrets, required=True)
    secrets.add_argument("--namespace", default="diloco", help="the releases' namespace")
    secrets.add_argument("--shards", action="store_true", help="only the shards' Secret (the syncer's cluster)")
    secrets.add_argument("--region", action="append", default=[],
                         help="only the learners of this region (its cluster; repeatable)")
    secrets.add_argument("--secret-name", default=SHARDS_SECRET, help="the chart's tls.secretName")
    secrets.add_argument("--learner-secret-prefix", default=LEARNER_SECRET_PREFIX,
                         help="the chart's tls.learnerSecretPrefix")


def _common(parser: argparse.ArgumentParser, required: bool) -> None:
    default = None if not required else argparse.SUPPRESS
    parser.add_argument("--config", required=required, default=default,
                        help="cluster YAML file: its shards and learners get certificates")
    parser.add_argument("--out", default=default,
                        help="folder of the processes' folders (default: tls.dir of the config, else "
                             "<run.state_dir>/certs)")
    parser.add_argument("--ca-dir", default=default, help="folder of the CA's ca.crt and ca.key (default: <out>/ca)")


def run(args: argparse.Namespace) -> int:
    try:
        if not args.config:
            raise ConfigError("--config: required")
        cfg = load_config(args.config)
        out = pathlib.Path(args.out) if getattr(args, "out", None) else certs_dir(cfg)
        ca_dir = pathlib.Path(args.ca_dir) if getattr(args, "ca_dir", None) else out / CA_FOLDER
        if args.action is None:
            names = issue_cluster_certs(cfg, out, args.host, args.days, ca_dir)
            print(f"CA in {ca_dir} (keep ca.key private); in {out}, a folder per process: {', '.join(names)}")
        elif args.action == "renew":
            names = issue_cluster_certs(cfg, out, args.host, args.days, ca_dir, names=args.names or None)
            print(f"renewed in {out}: {', '.join(names)}; running processes take them up at their next connection")
        elif args.action == "revoke":
            serial, learner = revoke(cfg, out, ca_dir, args.target)
            who = f"learner {learner}'s certificate" if learner else "certificate"
            print(f"revoked {who} {serial:x}: {ca_dir / CRL_FILE}, copied into every shard folder of {out}; "
                  "a running shard refuses it within seconds")
        elif args.action == "rotate-ca":
            print(rotate_ca(cfg, out, ca_dir, args.stage, args.days))
        elif args.action == "secrets":
            print(secrets_manifest(cfg, out, args), end="")
        else:
            print(listing(process_names(cfg), out, ca_dir))
    except (ConfigError, OSError) as error:  # a bad config; a folder we may not read or write
        print(f"invalid: {error}" if isinstance(error, ConfigError) else f"cannot write: {error}",
              file=sys.stderr)
        return 2 if isinstance(error, ConfigError) else 1
    return 0


def secrets_manifest(cfg, out: pathlib.Path, args: argparse.Namespace) -> str:
    """One Secret (ca.crt, tls.crt, tls.key) for every shard pod, from shard-0's folder, whose
    certificate names every shard's host; one per learner, <prefix><learner id>. With --shards
    or --region, only those: each goes to the Kubernetes cluster that runs them."""
    everything = not args.shards and not args.region
    chosen = [(args.secret_name, shard_name(0))] if args.shards or everything else []
    unknown = sorted(set(args.region) - {l.region for l in cfg.learners})
    if unknown:
        raise ConfigError(f"--region {', '.join(unknown)}: no learner of the config is in it")
    chosen += [(args.learner_secret_prefix + l.id, learner_name(l.id)) for l in cfg.learners
               if everything or l.region in args.region]
    documents = []
    for secret, folder in chosen:
        data = {}
        for file in (CA_FILE, CERT_FILE, KEY_FILE):
            path = out / folder / file
            try:
                data[file] = base64.b64encode(path.read_bytes()).decode()
            except OSError as error:
                raise ConfigError(f"--out: cannot read {path} ({error.strerror}): run `diloco certs --config "
                                  f"{args.config}` first") from None
        documents.append({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                          "metadata": {"name": secret, "namespace": args.namespace,
                                       "labels": {"app.kubernetes.io/name": "diloco"}}, "data": data})
    return yaml.safe_dump_all(documents, sort_keys=False)


def listing(names: list[str], out: pathlib.Path, ca_dir: pathlib.Path) -> str:
    """A line per certificate: the CA's and each process folder's (missing ones said)."""
    revoked = RevocationList(ca_dir / CRL_FILE, (ca_dir / CA_FILE).read_bytes())
    now = datetime.datetime.now(datetime.timezone.utc)
    lines, width = [], max(len(name) for name in names)
    for name, path in [("ca", ca_dir / CA_FILE), *((name, out / name / CERT_FILE) for name in names)]:
        if not path.exists():
            lines.append(f"{name:<{width}}  missing ({path})")
            continue
        cert = x509.load_pem_x509_certificate(path.read_bytes())
        left = (cert.not_valid_after_utc - now).total_seconds() / 86400
        state = "REVOKED" if revoked.revoked_on(cert.serial_number) else ("EXPIRED" if left <= 0 else f"{left:.0f} days left")
        lines.append(f"{name:<{width}}  serial {cert.serial_number:x}  expires {cert.not_valid_after_utc:%Y-%m-%d}  {state}")
    return "\n".join(lines)
