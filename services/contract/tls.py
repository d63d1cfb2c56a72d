"""Mutual TLS between learners and shards: who each process is, and the local CA that says so.

Every process of a run has a name and a certificate signed by the run's CA:

    shard-<i>        serves the Syncer service       spiffe://diloco/shard/<i>
    learner-<id>     pushes as learner <id>           spiffe://diloco/learner/<id>
    operator         reads Status (`diloco status`)   spiffe://diloco/operator

The identity is the certificate's one URI SAN, a SPIFFE ID, which gRPC hands the server as
`peer_spiffe_id`; the shard lets a caller act only as the learner id it names. Each process
reads its own folder, `<tls.dir>/<name>/` with `ca.crt`, `tls.crt` and `tls.key` (the layout
of a Kubernetes TLS Secret with its CA, as cert-manager writes it), or the folder given with
--tls-dir. `diloco certs` (services/cli/certs.py) makes a CA and every folder of a config.

Certificates change while the run goes on (docs/security.md): a process reads its folder again
when its files change (a shard for each new connection, a client for each call), so a renewed
certificate or a CA bundle of two CAs (a CA rotation) takes effect without a restart. An
expired certificate is refused where it is read, naming its expiry.
"""
from __future__ import annotations

import datetime
import logging
import os
import pathlib
from dataclasses import dataclass, field

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from diloco.services.contract.config import Config, ConfigError

log = logging.getLogger(__name__)

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
    """One process's certificate and key, and the CA (or CAs) it trusts (PEM bytes); `folder`:
    where they were read, to be read again when they change (None: given in memory)."""
    ca: bytes
    cert: bytes
    key: bytes
    folder: pathlib.Path | None = None
    # The folder's files as they were when read (files_stamp): unchanged, they are not read again.
    stamp: tuple = field(default=(), compare=False)

    @property
    def certificate(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.cert)

    def server_credentials(self) -> grpc.ServerCredentials:
        """Each new connection's handshake takes the folder's files as they are then."""
        if self.folder is None:
            return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                               require_client_auth=True)
        current = [self]

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            renewed = current[0].reloaded()
            if renewed is None:
                return None
            current[0] = renewed
            return renewed._server_configuration()

        return grpc.dynamic_ssl_server_credentials(self._server_configuration(), fetch,
                                                   require_client_authentication=True)

    def _server_configuration(self) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(self.key, self.cert)], root_certificates=self.ca)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def reloaded(self) -> Identity | None:
        """The identity its folder holds now, if that differs from this one; None if it does
        not, if there is no folder, or if the folder is half-written (a key that does not
        match its certificate, a file missing) or holds an expired certificate: this one stays
        until the next look."""
        if self.folder is None or files_stamp(self.folder) == self.stamp:
            return None  # a client asks before every call: a stat of three files, no read
        try:
            now = read_identity(self.folder, "tls")
        except ConfigError as error:
            log.warning("certificates in %s not taken: %s", self.folder, error)
            return None
        if now == self:
            return None
        if now.certificate.public_key() != _private_key(now.key).public_key():
            return None  # the key written, its certificate not yet
        log.info("certificates in %s changed: serial %x from now on", self.folder, now.certificate.serial_number)
        return now


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
    stamp = files_stamp(folder)  # before reading: a write in between shows at the next look
    parts = []
    for file in (CA_FILE, CERT_FILE, KEY_FILE):
        try:
            parts.append((folder / file).read_bytes())
        except OSError as error:
            raise ConfigError(f"{source}: cannot read {folder / file} ({error.strerror}); tls.mode is "
                              "mtls: make certificates with `diloco certs`, or write "
                              "`tls: {mode: plaintext}` to run without") from None
    identity = Identity(*parts, folder=folder, stamp=stamp)
    try:
        expires = identity.certificate.not_valid_after_utc
    except ValueError as error:
        raise ConfigError(f"{source}: {folder / CERT_FILE} is not a PEM certificate ({error})") from None
    if expires <= datetime.datetime.now(datetime.timezone.utc):
        raise ConfigError(f"{source}: the certificate {folder / CERT_FILE} expired on {expires:%Y-%m-%d %H:%M} UTC; "
                          f"issue it again with `diloco certs renew --config CONFIG {folder.name}`")
    return identity


def files_stamp(folder: pathlib.Path) -> tuple:
    """What changes when one of the folder's three files is written (atomically: a new inode)."""
    stamp = []
    for file in (CA_FILE, CERT_FILE, KEY_FILE):
        try:
            stat = os.stat(folder / file)
            stamp.append((stat.st_ino, stat.st_mtime_ns, stat.st_size))
        except OSError:
            stamp.append(None)
    return tuple(stamp)


def _private_key(pem: bytes):
    return serialization.load_pem_private_key(pem, password=None)
