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
"""
from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass

import grpc

from diloco.services.contract.config import Config, ConfigError

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
