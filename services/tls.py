"""Mutual TLS between learners and shards: who each process is, and the local CA that says so.

Every process of a run has a name and a certificate signed by the run's CA:

    shard-<i>        serves the Syncer service       spiffe://diloco/shard/<i>
    learner-<id>     pushes as learner <id>           spiffe://diloco/learner/<id>
    operator         reads Status (`diloco status`)   spiffe://diloco/operator

The identity is the certificate's one URI SAN, a SPIFFE ID, which gRPC hands the server as
`peer_spiffe_id`; the shard lets a caller act only as the learner id it names. Each process
reads its own folder, `<tls.dir>/<name>/` with `ca.crt`, `tls.crt` and `tls.key` (the layout
of a Kubernetes TLS Secret with its CA, as cert-manager writes it), or the folder given with
--tls-dir. `diloco certs` (`issue_cluster_certs`) makes a CA and every folder of a config.
"""
from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import pathlib
import sys
from dataclasses import dataclass
from typing import Iterable

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from diloco.services.config import Config, ConfigError, load_config

SPIFFE_PREFIX = "spiffe://diloco/"
LEARNER_PREFIX = SPIFFE_PREFIX + "learner/"
OPERATOR = "operator"
CA_FOLDER = "ca"  # the CA's key stays here, in no process's folder
CA_FILE, CERT_FILE, KEY_FILE = "ca.crt", "tls.crt", "tls.key"
# Every host a shard may be dialled by on one machine, besides its configured address.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def shard_name(index: int) -> str:
    return f"shard-{index}"


def learner_name(learner_id: str) -> str:
    return f"learner-{learner_id}"


def spiffe_id(name: str) -> str:
    """shard-0 -> spiffe://diloco/shard/0, learner-a -> spiffe://diloco/learner/a."""
    kind, _, rest = name.partition("-")
    return SPIFFE_PREFIX + (f"{kind}/{rest}" if rest else kind)


def learner_of(peer_id: str | None) -> str | None:
    """The learner id a peer's SPIFFE ID names, None if it names no learner."""
    if peer_id and peer_id.startswith(LEARNER_PREFIX):
        return peer_id[len(LEARNER_PREFIX):]
    return None


def peer_spiffe_id(context: grpc.ServicerContext) -> str | None:
    """The SPIFFE ID of the client certificate of a call (None in plaintext or without one)."""
    values = context.auth_context().get("peer_spiffe_id")
    return values[0].decode() if values else None


# ---- loading ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Identity:
    """One process's certificate and key, and the CA it trusts (PEM bytes)."""
    ca: bytes
    cert: bytes
    key: bytes

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


def certs_dir(cfg: Config) -> pathlib.Path:
    return pathlib.Path(cfg.tls.dir if cfg.tls.dir is not None else pathlib.Path(cfg.run.state_dir) / "certs")


def load_identity(cfg: Config, name: str, folder: str | os.PathLike | None = None) -> Identity | None:
    """The identity process `name` presents, from `folder` if given (a --tls-dir), else from
    <tls.dir>/<name>; None when the config says tls.mode: plaintext."""
    if cfg.tls.mode == "plaintext":
        return None
    if folder is not None:
        return read_identity(pathlib.Path(folder), "--tls-dir")
    return read_identity(certs_dir(cfg) / name, "tls.dir")


def read_identity(folder: pathlib.Path, source: str) -> Identity:
    """ca.crt, tls.crt and tls.key of `folder`; one missing is a ConfigError naming `source`,
    the key or flag that chose the folder."""
    parts = []
    for file in (CA_FILE, CERT_FILE, KEY_FILE):
        try:
            parts.append((folder / file).read_bytes())
        except OSError as error:
            raise ConfigError(f"{source}: cannot read {folder / file} ({error.strerror}); tls.mode is "
                              "mtls: make certificates with `diloco certs`, or write "
                              "`tls: {mode: plaintext}` to run without") from None
    return Identity(*parts)


# ---- issuing ---------------------------------------------------------------------------

@dataclass(frozen=True)
class _Authority:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write(path: pathlib.Path, data: bytes, private: bool = False) -> None:
    """Atomically, so a process reading the folder never sees half a file; keys 0600."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


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
