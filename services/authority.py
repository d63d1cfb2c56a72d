"""The run's CA on disk: it issues a certificate to every shard, learner and operator of a
config, renews them, revokes them and is itself rotated, all while the run goes on
(docs/security.md). `diloco certs` (services/cli/certs.py) is its command line.

Layout: the CA's `ca.crt`, `ca.key` and revocation list `crl.pem` in its folder (default
<out>/ca); a folder per process in <out> (services/contract/tls.py reads them) with `ca.crt`
(what the process trusts), `tls.crt`, `tls.key`, and for a shard a copy of `crl.pem`. A CA
rotation keeps the next CA in <ca>/next until it issues, then the old one in <ca>/previous
until every process trusts the new one alone.
"""
from __future__ import annotations

import datetime
import ipaddress
import pathlib
import shutil
import string
from dataclasses import dataclass
from typing import Iterable

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from diloco.services.contract.config import Config, ConfigError
from diloco.services.contract.revocations import CRL_FILE
from diloco.services.contract.tls import (CA_FILE, CERT_FILE, KEY_FILE, LOOPBACK_HOSTS, OPERATOR, learner_name,
                                          shard_name, spiffe_id)
from diloco.services.files import atomic_write

CA_KEY_FILE = "ca.key"
NEXT, PREVIOUS = "next", "previous"  # a CA rotation's folders inside the CA's
CA_DAYS = 3650
MIN_SERIAL_DIGITS = 16  # serials are random 159-bit numbers; a shorter "serial" is a typo


@dataclass(frozen=True)
class Authority:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write(path: pathlib.Path, data: bytes, private: bool = False) -> None:
    """Atomically, so a process reading the folder never sees half a file; keys 0600."""
    atomic_write(path, data, mode=0o600 if private else 0o644)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def authority(folder: pathlib.Path, create: bool = True) -> Authority:
    """The CA in `folder`, made there first if it is not (ConfigError if not `create`)."""
    cert_path, key_path = folder / CA_FILE, folder / CA_KEY_FILE
    if cert_path.exists() and key_path.exists():
        return Authority(x509.load_pem_x509_certificate(cert_path.read_bytes()),
                         serialization.load_pem_private_key(key_path.read_bytes(), password=None))
    if not create:
        raise ConfigError(f"--ca-dir: no CA in {folder} ({CA_FILE} and {CA_KEY_FILE}): make one with `diloco certs`")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "diloco run CA")])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
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
    return Authority(cert, key)


def _host_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return x509.DNSName(host)


def issue(ca: Authority, folder: pathlib.Path, name: str, hosts: Iterable[str], days: float,
          trust: bytes | None = None) -> x509.Certificate:
    """A key and a certificate for process `name` into `folder`, with what it trusts (`trust`,
    default the CA's certificate). Shards are servers (their host names as SANs), everyone else
    a client only. The key is written before its certificate: a process reading the folder
    meanwhile sees a key that does not match and keeps what it had (tls.Identity.reloaded)."""
    key = ec.generate_private_key(ec.SECP256R1())
    hosts = list(dict.fromkeys(hosts))
    names = [x509.UniformResourceIdentifier(spiffe_id(name))] + [_host_name(h) for h in hosts]
    usage = ExtendedKeyUsageOID.SERVER_AUTH if hosts else ExtendedKeyUsageOID.CLIENT_AUTH
    now = _now()
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
    _write(folder / CA_FILE, trust or ca.pem)
    _write(folder / KEY_FILE, _pem_key(key), private=True)
    _write(folder / CERT_FILE, cert.public_bytes(serialization.Encoding.PEM))
    return cert


def process_names(cfg: Config) -> list[str]:
    """Every process of the config that holds a certificate: shards, learners, the operator."""
    return ([shard_name(i) for i in range(len(cfg.shards))] + [learner_name(l.id) for l in cfg.learners]
            + [OPERATOR])


def _hosts(cfg: Config, name: str, extra_hosts: Iterable[str]) -> list[str]:
    """A shard's host names: its own address's host first, every other shard's (one Secret
    serves every shard pod of the Helm chart), loopback and the extra ones; a client's: none."""
    if not name.startswith("shard-"):
        return []
    own = int(name.removeprefix("shard-"))
    hosts = [shard.address.rsplit(":", 1)[0] for shard in [cfg.shards[own], *cfg.shards]]
    return [*hosts, *LOOPBACK_HOSTS, *extra_hosts]


def issue_cluster_certs(cfg: Config, out: pathlib.Path, extra_hosts: Iterable[str] = (),
                        days: float = 365, ca_dir: pathlib.Path | None = None,
                        names: Iterable[str] | None = None) -> list[str]:
    """A CA in `ca_dir` (default <out>/ca; kept if it is there, so certificates issued before
    stay valid) and a folder per process of the config in `out` (or only those `names`):
    every shard (its address's host, loopback and `extra_hosts` as SANs), every learner, and
    the operator. What each trusts stays as it is (both CAs during a rotation). Returns the
    names issued."""
    ca_dir = ca_dir or out / "ca"
    ca = authority(ca_dir)
    known = process_names(cfg)
    chosen = known if names is None else list(names)
    unknown = [name for name in chosen if name not in known]
    if unknown:
        raise ConfigError(f"{', '.join(unknown)}: not a process of the config (its processes: {', '.join(known)})")
    trust = _trusted(ca_dir)
    for name in chosen:
        issue(ca, out / name, name, _hosts(cfg, name, extra_hosts), days, trust)
    if (ca_dir / CRL_FILE).exists():
        _copy_crl(cfg, out, ca_dir)
    return chosen


def _trusted(ca_dir: pathlib.Path) -> bytes:
    """What every process trusts: the CA, and the other CA of a rotation in progress."""
    bundle = (ca_dir / CA_FILE).read_bytes()
    for other in (NEXT, PREVIOUS):
        if (ca_dir / other / CA_FILE).exists():
            bundle += (ca_dir / other / CA_FILE).read_bytes()
    return bundle


# ---- revocation --------------------------------------------------------------------------

def revoke(cfg: Config, out: pathlib.Path, ca_dir: pathlib.Path, target: str) -> tuple[int, str | None]:
    """Revokes a learner's current certificate (`target` a learner id of the config) or the
    certificate of a serial (hex, as `diloco status` shows it): the CA's revocation list gains
    it and every shard folder in `out` gets the new list. Returns (serial, learner id or None)."""
    ca = authority(ca_dir, create=False)
    if target in {l.id for l in cfg.learners}:
        path = out / learner_name(target) / CERT_FILE
        try:
            serial = x509.load_pem_x509_certificate(path.read_bytes()).serial_number
        except OSError as error:
            raise ConfigError(f"learner {target}: cannot read its certificate {path} ({error.strerror})") from None
        learner = target
    else:
        digits = target.removeprefix("0x")
        if len(digits) < MIN_SERIAL_DIGITS or any(c not in string.hexdigits for c in digits):
            raise ConfigError(f"{target!r}: neither a learner id of the config ({', '.join(l.id for l in cfg.learners)}) "
                              f"nor a certificate serial (hex, {MIN_SERIAL_DIGITS} digits or more: "
                              "`diloco certs list` shows them)")
        serial, learner = int(digits, 16), None
    entries = {entry.serial_number: entry.revocation_date_utc for entry in _crl_entries(ca_dir)}
    entries.setdefault(serial, _now())
    _sign_crl(ca, ca_dir, entries)
    _copy_crl(cfg, out, ca_dir)
    return serial, learner


def _crl_entries(ca_dir: pathlib.Path) -> list[x509.RevokedCertificate]:
    path = ca_dir / CRL_FILE
    return list(x509.load_pem_x509_crl(path.read_bytes())) if path.exists() else []


def _sign_crl(ca: Authority, ca_dir: pathlib.Path, entries: dict[int, datetime.datetime]) -> None:
    now = _now()
    builder = (x509.CertificateRevocationListBuilder().issuer_name(ca.cert.subject).last_update(now)
               .next_update(now + datetime.timedelta(days=CA_DAYS)))
    for serial, when in sorted(entries.items()):
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(when).build())
    _write(ca_dir / CRL_FILE, builder.sign(ca.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))


def _copy_crl(cfg: Config, out: pathlib.Path, ca_dir: pathlib.Path) -> None:
    """The CA's list into every shard's folder that is in `out` (the shards read it there)."""
    crl = (ca_dir / CRL_FILE).read_bytes()
    for index in range(len(cfg.shards)):
        if (out / shard_name(index)).is_dir():
            _write(out / shard_name(index) / CRL_FILE, crl)


# ---- CA rotation -------------------------------------------------------------------------

def rotate_ca(cfg: Config, out: pathlib.Path, ca_dir: pathlib.Path, stage: str, days: float = 365) -> str:
    """One stage of replacing the CA while the run goes on; what it did, in a sentence.

    trust   a next CA is made (<ca>/next) and every process trusts both
    issue   the next CA becomes the CA (the old one kept in <ca>/previous, still trusted) and
            issues every process a certificate; the revocation list is signed again by it
    finish  every process trusts the new CA alone; the old one is deleted"""
    current = authority(ca_dir, create=False)
    if stage == "trust":
        authority(ca_dir / NEXT)
        names = _retrust(cfg, out, _trusted(ca_dir))
        return f"a next CA in {ca_dir / NEXT}; {len(names)} processes trust both CAs: {', '.join(names)}"
    if stage == "issue":
        if not (ca_dir / NEXT / CA_FILE).exists():
            raise ConfigError("rotate-ca --stage issue: no next CA: run `diloco certs rotate-ca --stage trust` first")
        shutil.rmtree(ca_dir / PREVIOUS, ignore_errors=True)
        (ca_dir / PREVIOUS).mkdir()
        for file in (CA_FILE, CA_KEY_FILE):
            shutil.copy2(ca_dir / file, ca_dir / PREVIOUS / file)
        for file in (CA_KEY_FILE, CA_FILE):
            shutil.copy2(ca_dir / NEXT / file, ca_dir / file)
        shutil.rmtree(ca_dir / NEXT)
        _sign_crl(authority(ca_dir, create=False), ca_dir,
                  {entry.serial_number: entry.revocation_date_utc for entry in _crl_entries(ca_dir)})
        names = issue_cluster_certs(cfg, out, days=days, ca_dir=ca_dir)
        return (f"the new CA issued {len(names)} certificates; the old one ({current.cert.serial_number:x}) "
                f"is still trusted, in {ca_dir / PREVIOUS}")
    if stage == "finish":
        shutil.rmtree(ca_dir / PREVIOUS, ignore_errors=True)
        names = _retrust(cfg, out, current.pem)
        return f"{len(names)} processes trust the CA alone ({current.cert.serial_number:x})"
    raise ConfigError(f"--stage {stage!r}: one of trust, issue, finish")


def _retrust(cfg: Config, out: pathlib.Path, trust: bytes) -> list[str]:
    """Writes what every process folder in `out` trusts; the names written."""
    names = [name for name in process_names(cfg) if (out / name).is_dir()]
    for name in names:
        _write(out / name / CA_FILE, trust)
    return names
