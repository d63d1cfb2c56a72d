"""The certificates a run's CA revoked, as the shards apply them (docs/security.md).

`diloco certs revoke` adds a certificate's serial to the CA's certificate revocation list
(X.509 CRL, `crl.pem`, signed with the CA's key) and copies the list into every shard's TLS
folder beside its `ca.crt`. A shard reads it at start and again whenever the file changes; a
list not signed by a CA the shard trusts is not taken (the last good one stays), so only the
CA's holder can shut a learner out. A restarted shard reads the same file: revocation lasts.
"""
from __future__ import annotations

import datetime
import logging
import os
import pathlib
import threading

from cryptography import x509

log = logging.getLogger(__name__)

CRL_FILE = "crl.pem"


def load_certificates(pem: bytes) -> list[x509.Certificate]:
    """Every certificate of a PEM bundle (a ca.crt holds two while its CA is rotated)."""
    return x509.load_pem_x509_certificates(pem)


class RevocationList:
    """The serials revoked by the CRL at `path` (missing: none). `refresh(ca)` reads the file
    again if it changed since, and takes it if one of the CAs of the `ca` bundle signed it."""

    def __init__(self, path: pathlib.Path, ca: bytes):
        self.path = path
        self._lock = threading.Lock()
        self._seen: tuple[int, int] | None = None  # the file's (mtime_ns, size) last read
        self._revoked: dict[int, datetime.datetime] = {}
        self.refresh(ca)

    def refresh(self, ca: bytes) -> bool:
        """Reads the list again if the file changed; whether the revoked serials changed."""
        try:
            stat = os.stat(self.path)
            seen = (stat.st_mtime_ns, stat.st_size)
        except FileNotFoundError:
            seen = None
        if seen == self._seen:
            return False
        self._seen = seen
        revoked = self._read(load_certificates(ca)) if seen is not None else {}
        if revoked is None:
            return False
        with self._lock:
            changed, self._revoked = revoked != self._revoked, revoked
        if changed:
            log.info("%s: %d certificate(s) revoked", self.path, len(revoked))
        return changed

    def revoked_on(self, serial: int) -> datetime.datetime | None:
        """When the certificate of `serial` was revoked; None if it is not."""
        with self._lock:
            return self._revoked.get(serial)

    def __len__(self) -> int:
        with self._lock:
            return len(self._revoked)

    def _read(self, cas: list[x509.Certificate]) -> dict[int, datetime.datetime] | None:
        try:
            crl = x509.load_pem_x509_crl(self.path.read_bytes())
        except (OSError, ValueError) as error:
            log.error("%s: not a revocation list (%s): the last one read stays", self.path, error)
            return None
        if not any(crl.issuer == ca.subject and crl.is_signature_valid(ca.public_key()) for ca in cas):
            log.error("%s: not signed by a CA this process trusts: the last list read stays", self.path)
            return None
        return {entry.serial_number: entry.revocation_date_utc for entry in crl}
