"""`diloco certs` for an operator: one shards' Secret that every shard pod can serve with, the
Helm chart's Secrets as manifests, and what is wrong named when it cannot make them."""
from __future__ import annotations

import base64

import yaml
from cryptography import x509

from diloco.cli import main
from diloco.services.contract.config import dump_config
from tests.cluster_config import tiny_cluster


def config(tmp_path):
    cfg = tiny_cluster(tmp_path / "state", shards=2, learners=3)
    path = tmp_path / "cluster.yaml"
    path.write_text(dump_config(cfg))
    return cfg, path


def test_a_shards_certificate_names_every_shards_host_so_one_secret_serves_every_shard_pod(tmp_path, capsys):
    cfg, path = config(tmp_path)
    assert main(["certs", "--config", str(path), "--out", str(tmp_path / "certs"), "--host", "shards.example"]) == 0
    assert main(["certs", "secrets", "--config", str(path), "--out", str(tmp_path / "certs")]) == 0
    secrets = {d["metadata"]["name"]: d for d in yaml.safe_load_all(capsys.readouterr().out)}
    assert set(secrets) == {"diloco-syncer-tls", *(f"diloco-learner-tls-{l.id}" for l in cfg.learners)}
    shards = secrets["diloco-syncer-tls"]
    cert = x509.load_pem_x509_certificate(base64.b64decode(shards["data"]["tls.crt"]))
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    hosts = set(names.get_values_for_type(x509.DNSName)) | {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}
    assert {s.address.rsplit(":", 1)[0] for s in cfg.shards} | {"shards.example"} <= hosts
    assert set(shards["data"]) == {"ca.crt", "tls.crt", "tls.key"} and shards["metadata"]["namespace"] == "diloco"


def test_secrets_for_one_cluster_hold_only_what_runs_there(tmp_path, capsys):
    cfg, path = config(tmp_path)
    assert main(["certs", "--config", str(path), "--out", str(tmp_path / "certs")]) == 0
    capsys.readouterr()
    region = cfg.learners[0].region
    assert main(["certs", "secrets", "--config", str(path), "--out", str(tmp_path / "certs"), "--region", region]) == 0
    names = {d["metadata"]["name"] for d in yaml.safe_load_all(capsys.readouterr().out)}
    assert names == {f"diloco-learner-tls-{l.id}" for l in cfg.learners if l.region == region}
    assert main(["certs", "secrets", "--config", str(path), "--out", str(tmp_path / "certs"), "--shards"]) == 0
    assert {d["metadata"]["name"] for d in yaml.safe_load_all(capsys.readouterr().out)} == {"diloco-syncer-tls"}


def test_secrets_without_certificates_name_the_command_that_makes_them(tmp_path, capsys):
    _, path = config(tmp_path)
    assert main(["certs", "secrets", "--config", str(path), "--out", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "cannot read" in err and f"diloco certs --config {path}" in err
