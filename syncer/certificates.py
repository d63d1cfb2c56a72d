"""What a shard knows of certificates (tls.mode mtls; docs/security.md): the revocation list
beside its own certificate, read again when it changes; the certificate each caller presented;
and when each of them, its own and its CAs' expires, for `diloco status` and Prometheus.

A call whose client certificate is revoked is refused PERMISSION_DENIED (reason "revoked",
counted as revoked.<learner>); the shard's RevocationWatch ends the open calls of a learner
whose certificate the list now revokes (syncer/service.py).
"""
from __future__ import annotations

import datetime
import threading
from dataclasses import dataclass

import grpc
from cryptography import x509

from diloco.services.contract.revocations import CRL_FILE, RevocationList, load_certificates
from diloco.services.contract.tls import Identity, learner_of, peer_spiffe_id
from diloco.syncer.counters import Counters
from diloco.syncer.refusal import Refusal

PEM_PROPERTY = "x509_pem_cert"  # the auth context's property holding the client's certificate


@dataclass(frozen=True)
class CertificateView:
    name: str  # "ca", "shard-0", or a caller's SPIFFE ID
    serial: int
    expires: datetime.datetime
    revoked: bool


@dataclass(frozen=True)
class Presented:
    """A client certificate as a call presented it."""
    peer: str  # its SPIFFE ID
    serial: int
    expires: datetime.datetime


class ShardCertificates:
    def __init__(self, identity: Identity, own_name: str, counters: Counters):
        self.identity, self.own_name, self.counters = identity, own_name, counters
        self.revocations = RevocationList(identity.folder / CRL_FILE, identity.ca)
        self._lock = threading.Lock()
        self._parsed: dict[bytes, Presented] = {}  # by PEM: a call's certificate is parsed once
        self._seen: dict[str, Presented] = {}  # the last certificate each peer presented

    def refresh(self) -> bool:
        """Takes the shard's files as they are now; whether the revoked serials changed."""
        self.identity = self.identity.reloaded() or self.identity
        return self.revocations.refresh(self.identity.ca)

    def presented(self, context: grpc.ServicerContext) -> Presented | None:
        """The client certificate of a call (None without one: plaintext)."""
        pem = next(iter(context.auth_context().get(PEM_PROPERTY, ())), None)
        if pem is None:
            return None
        with self._lock:
            presented = self._parsed.get(pem)
        if presented is None:
            cert = x509.load_pem_x509_certificate(pem)
            presented = Presented(peer_spiffe_id(context) or "", cert.serial_number, cert.not_valid_after_utc)
        with self._lock:
            if len(self._parsed) > 1024:  # certificates renewed over a long run
                self._parsed.clear()
            self._parsed[pem] = presented
            self._seen[presented.peer] = presented
        return presented

    def refusal(self, context: grpc.ServicerContext) -> Refusal | None:
        """PERMISSION_DENIED for a call whose client certificate is revoked, counted."""
        presented = self.presented(context)
        if presented is None:
            return None
        return self.refusal_of(presented)

    def refusal_of(self, presented: Presented) -> Refusal | None:
        when = self.revocations.revoked_on(presented.serial)
        if when is None:
            return None
        learner = learner_of(presented.peer)
        if learner is not None:
            self.counters.add(f"revoked.{learner}")
        return Refusal("revoked", "PERMISSION_DENIED",
                       f"the client certificate {presented.serial:x} of {presented.peer} was revoked on "
                       f"{when:%Y-%m-%d %H:%M} UTC (`diloco certs revoke`); the run's operator issues a new one")

    def views(self) -> list[CertificateView]:
        """The CAs this shard trusts, its own certificate, and the last one each caller presented."""
        identity = self.identity
        own = identity.certificate
        views = [CertificateView("ca", ca.serial_number, ca.not_valid_after_utc, False)
                 for ca in load_certificates(identity.ca)]
        views.append(CertificateView(self.own_name, own.serial_number, own.not_valid_after_utc, False))
        with self._lock:
            seen = sorted(self._seen.values(), key=lambda p: p.peer)
        views += [CertificateView(p.peer, p.serial, p.expires, self.revocations.revoked_on(p.serial) is not None)
                  for p in seen]
        return views
