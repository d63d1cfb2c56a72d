"""`diloco certs`: a CA and a certificate for every shard, learner and operator of a config,
in the folder layout services/contract/tls.py reads (a Kubernetes TLS Secret with its CA)."""
from __future__ import annotations

import argparse
import datetime
import ipaddress
import pathlib
import sys
from dataclasses import dataclass
from typing import Iterable

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from diloco.services.contract.config import Config, ConfigError, load_config
from diloco.services.contract.tls import (CA_FILE, CA_FOLDER, CERT_FILE, KEY_FILE, LOOPBACK_HOSTS, OPERATOR,
                                          certs_dir, learner_name, shard_name, spiffe_id)
from diloco.services.files import atomic_write


@dataclass(frozen=True)
class _Authority:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write(path: pathlib.Path, data: bytes, private: bool = False) -> None:
    """Atomically, so a process reading the folder never sees half a file; keys 0600."""
    atomic_write(path, data, mode=0o600 if private else 0o644)


def _authority(folder: pathlib.Path, days: int) -> _Authority:
    """The CA in `folder`, made there first if it is not."""
    cert_path, key_path = folder / CA_FILE, folder / "ca.key"
    if cert_path.exists() and key_path.exists():
        return _Authority(x509.load_pem_x509_certificate(cert_path.read_bytes()),
                          serialization.load_pem_private_key(key_path.read_bytes(), password=None))
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "diloco run CA")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    folder.mkdir(parents=True, exist_ok=True)
    _write(key_path, _pem_key(key), private=True)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return _Authority(cert, key)


def _host_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return x509.DNSName(host)


def _issue(ca: _Authority, folder: pathlib.Path, name: str, hosts: Iterable[str], days: int) -> None:
    """A key and a certificate for process `name`, with the CA's certificate, into `folder`.
    Shards are servers (their host names as SANs), everyone else a client only."""
    key = ec.generate_private_key(ec.SECP256R1())
    hosts = list(dict.fromkeys(hosts))
    names = [x509.UniformResourceIdentifier(spiffe_id(name))] + [_host_name(h) for h in hosts]
    usage = ExtendedKeyUsageOID.SERVER_AUTH if hosts else ExtendedKeyUsageOID.CLIENT_AUTH
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca.cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(min(now + datetime.timedelta(days=days), ca.cert.not_valid_after_utc))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()),
                           critical=False)
            .sign(ca.key, hashes.SHA256()))
    folder.mkdir(parents=True, exist_ok=True)
    _write(folder / KEY_FILE, _pem_key(key), private=True)
    _write(folder / CERT_FILE, cert.public_bytes(serialization.Encoding.PEM))
    _write(folder / CA_FILE, ca.cert.public_bytes(serialization.Encoding.PEM))


def issue_cluster_certs(cfg: Config, out: pathlib.Path, extra_hosts: Iterable[str] = (),
                        days: int = 365, ca_dir: pathlib.Path | None = None) -> list[str]:
    """A CA in `ca_dir` (default <out>/ca; kept if it is there, so certificates issued before
    stay valid) and a folder per process of the config in `out`: every shard (its address's
    host, loopback and `extra_hosts` as SANs), every learner, and the operator. Returns the
    names issued."""
    ca = _authority(ca_dir or out / CA_FOLDER, days=max(days, 3650))
    names = []
    for index, shard in enumerate(cfg.shards):
        host = shard.address.rsplit(":", 1)[0]
        _issue(ca, out / shard_name(index), shard_name(index), [host, *LOOPBACK_HOSTS, *extra_hosts], days)
        names.append(shard_name(index))
    for learner in cfg.learners:
        _issue(ca, out / learner_name(learner.id), learner_name(learner.id), [], days)
        names.append(learner_name(learner.id))
    _issue(ca, out / OPERATOR, OPERATOR, [], days)
    return names + [OPERATOR]


# ---- `diloco certs` --------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="cluster YAML file: its shards and learners get certificates")
    parser.add_argument("--out", help="folder to write (default: tls.dir of the config, else <run.state_dir>/certs)")
    parser.add_argument("--host", action="append", default=[],
                        help="another DNS name or IP the shards are dialled by (repeatable)")
    parser.add_argument("--ca-dir", help="folder of the CA's ca.crt and ca.key, made if missing (default: <out>/ca)")
    parser.add_argument("--days", type=int, default=365, help="validity of the process certificates")


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config)
        out = pathlib.Path(args.out) if args.out else certs_dir(cfg)
        ca_dir = pathlib.Path(args.ca_dir) if args.ca_dir else out / CA_FOLDER
        names = issue_cluster_certs(cfg, out, args.host, args.days, ca_dir)
    except (ConfigError, OSError) as error:  # a bad config; a folder we may not write
        print(f"invalid: {error}" if isinstance(error, ConfigError) else f"cannot write: {error}",
              file=sys.stderr)
        return 2 if isinstance(error, ConfigError) else 1
    print(f"CA in {ca_dir} (keep ca.key private); in {out}, a folder per process: {', '.join(names)}")
    return 0
