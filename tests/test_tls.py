"""`diloco certs` and the tls config: a CA and a folder per process with the names and uses
each needs, the CA kept when run again, and clear errors for a missing certificate or a
config that cannot work."""
import stat

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from diloco.cli import main
from diloco.services.contract.config import ConfigError, dump_config, parse_config
from diloco.services.contract.tls import OPERATOR, learner_name, load_identity, shard_name
from tests.cluster_config import tiny_cluster


def _cert(path):
    return x509.load_pem_x509_certificate(path.read_bytes())


def _sans(cert, kind):
    return cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(kind)


def test_certs_command_issues_a_folder_per_process(tmp_path, capsys):
    cfg = tiny_cluster(tmp_path / "state", shards=2, learners=2)
    data = cfg.model_dump(mode="json")
    data["shards"][1]["address"] = "syncer-1.example:50051"
    config = tmp_path / "cluster.yaml"
    config.write_text(dump_config(parse_config(data)))
    out = tmp_path / "certs"
    assert main(["certs", "--config", str(config), "--out", str(out), "--host", "10.1.2.3"]) == 0
    assert "learner-us-east-0" in capsys.readouterr().out

    ca = _cert(out / "ca" / "ca.crt")
    shard = _cert(out / shard_name(1) / "tls.crt")
    assert "syncer-1.example" in _sans(shard, x509.DNSName) and "localhost" in _sans(shard, x509.DNSName)
    assert {str(ip) for ip in _sans(shard, x509.IPAddress)} >= {"127.0.0.1", "10.1.2.3"}
    assert _sans(shard, x509.UniformResourceIdentifier) == ["spiffe://diloco/shard/1"]
    learner = _cert(out / learner_name("us-west-0") / "tls.crt")
    assert _sans(learner, x509.UniformResourceIdentifier) == ["spiffe://diloco/learner/us-west-0"]
    usage = learner.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.CLIENT_AUTH]  # a learner cannot pose as a server
    for name in (shard_name(0), learner_name("us-east-0"), OPERATOR):
        folder = out / name
        assert _cert(folder / "tls.crt").issuer == ca.subject
        assert (folder / "ca.crt").read_bytes() == (out / "ca" / "ca.crt").read_bytes()
        assert stat.S_IMODE((folder / "tls.key").stat().st_mode) == 0o600
    assert not (out / shard_name(0) / "ca.key").exists()

    # Run again (say, for a new learner): the CA stays, so certificates issued before stay valid.
    assert main(["certs", "--config", str(config), "--out", str(out)]) == 0
    assert _cert(out / "ca" / "ca.crt") == ca


def test_tls_config_errors_name_the_key(tmp_path):
    cfg = tiny_cluster(tmp_path, shards=1, learners=1)
    with pytest.raises(ConfigError, match=r"tls.dir: cannot read .*shard-0/ca.crt .*diloco certs"):
        load_identity(cfg, shard_name(0))
    with pytest.raises(ConfigError, match=r"--tls-dir: cannot read .*nowhere/ca.crt"):
        load_identity(cfg, shard_name(0), tmp_path / "nowhere")
    plaintext = tiny_cluster(tmp_path, shards=1, learners=1, tls={"mode": "plaintext"})
    assert load_identity(plaintext, shard_name(0)) is None
    with pytest.raises(ConfigError, match=r"tls.mode: Input should be 'mtls' or 'plaintext'"):
        tiny_cluster(tmp_path, tls={"mode": "none"})
    data = cfg.model_dump(mode="json")
    data["shards"][0]["health_port"] = int(cfg.shards[0].address.rsplit(":", 1)[1])
    with pytest.raises(ConfigError, match=r"shards\[0\].health_port: \d+ is the port of shards\[0\].address"):
        parse_config(data)
    with pytest.raises(ConfigError, match=r"limits.push_idle_seconds: Input should be greater than 0"):
        tiny_cluster(tmp_path, limits={"push_idle_seconds": 0.0})
