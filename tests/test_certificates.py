"""Certificates while the run goes on (docs/security.md), against real `diloco syncer` and
`diloco learner` processes and the `diloco certs` command: a learner revoked mid-run is cut
off within seconds while the other trains on, and a restarted shard still refuses it; renewed
certificates are taken up without a restart; an expired one is refused naming its expiry."""
from __future__ import annotations

import datetime
import json
import subprocess
import sys
import time

import grpc
import pytest
from cryptography import x509

from diloco.localcluster.cluster import LocalCluster
from diloco.localcluster.sim_summary import hashes_agree
from diloco.services.authority import authority, issue
from diloco.services.client import ShardClient
from diloco.services.contract.config import ConfigError, dump_config
from diloco.services.contract.tls import CERT_FILE, certs_dir, learner_name, load_identity, read_identity
from tests.cluster_config import tiny_cluster
from tests.cluster_watch import wait_until

pytestmark = pytest.mark.slow

TIMEOUT = 60.0
CUT_OFF_SECONDS = 10.0  # "within seconds": a poll of the folder (1 s), the Attend call's end, a heartbeat


def certs(cluster: LocalCluster, *args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "diloco", "certs", *args, "--config", str(cluster.config_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def status(cluster: LocalCluster):
    with ShardClient(cluster.cfg.shards[0].address, cluster.cfg.rpc, identity=cluster.operator) as client:
        return client.status(timeout=5)


def serial_of(cluster: LocalCluster, name: str) -> str:
    cert = x509.load_pem_x509_certificate((certs_dir(cluster.cfg) / name / CERT_FILE).read_bytes())
    return f"{cert.serial_number:x}"


def learner_alive(cluster: LocalCluster, learner_id: str) -> bool:
    return any(l.learner_id == learner_id and l.alive for l in status(cluster).learners)


def fragment_versions(cluster: LocalCluster) -> int:
    return sum(f.version for f in status(cluster).fragments)


@pytest.fixture
def cluster(tmp_path):
    started: list[LocalCluster] = []

    def start(steps: int) -> LocalCluster:
        cfg = tiny_cluster(tmp_path / "state", shards=1, learners=2, steps=steps,
                           trainer={"checkpoint_every": 1000, "eval_every": 1000})
        started.append(LocalCluster(cfg, tmp_path / "run"))
        started[-1].start_shards()
        started[-1].start_learners()
        return started[-1]

    yield start
    for c in started:
        c.stop(timeout=10)


def test_a_learner_revoked_mid_run_is_cut_off_within_seconds_and_a_restarted_shard_still_refuses_it(cluster):
    run = cluster(steps=100_000)
    wait_until(lambda: learner_alive(run, "us-east-0") and learner_alive(run, "us-west-0")
               and fragment_versions(run) > 0, TIMEOUT, "both learners to train and sync")
    revoked_serial = serial_of(run, learner_name("us-west-0"))
    assert revoked_serial in certs(run, "revoke", "us-west-0")
    revoked_at = time.monotonic()
    wait_until(lambda: not learner_alive(run, "us-west-0"), CUT_OFF_SECONDS, "the shard to stop counting it")
    cut_off = time.monotonic() - revoked_at
    wait_until(lambda: run.learners[1].returncode is not None, TIMEOUT, "the revoked learner to stop")
    assert run.learners[1].returncode != 0
    assert "revoked" in run.learners[1].log_tail(40)
    # The other learner's rounds go on.
    versions = fragment_versions(run)
    wait_until(lambda: fragment_versions(run) > versions, TIMEOUT, "a round after the revocation")
    assert learner_alive(run, "us-east-0")
    reply = status(run)
    assert reply.revoked_certificates == 1 and reply.counters["refusals.revoked"] >= 1
    assert [(c.serial, c.revoked) for c in reply.certificates if c.name.endswith("/us-west-0")] == [
        (revoked_serial, True)]
    assert cut_off < CUT_OFF_SECONDS
    # A shard restarted after the revocation reads it again from its folder.
    run.shards[0].terminate(10)
    run.restart_shard(0)
    identity = load_identity(run.cfg, learner_name("us-west-0"))
    with ShardClient(run.cfg.shards[0].address, run.cfg.rpc, "us-west-0", 99, identity=identity) as client:
        with pytest.raises(grpc.RpcError) as refused:
            client.join("us-west", [])
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "revoked" in refused.value.details() and revoked_serial in refused.value.details()


def test_certificates_renewed_mid_run_are_taken_up_and_the_learners_end_with_the_shards_bits(cluster):
    run = cluster(steps=80)
    wait_until(lambda: fragment_versions(run) > 0, TIMEOUT, "a first round")
    old = serial_of(run, learner_name("us-east-0"))
    certs(run, "renew", learner_name("us-east-0"), "shard-0")
    new = serial_of(run, learner_name("us-east-0"))
    assert new != old
    # The learner's next calls present the new certificate, on a connection the shard's new
    # certificate serves (the operator's status call dials it afresh).
    wait_until(lambda: any(c.name.endswith("/us-east-0") and c.serial == new for c in status(run).certificates),
               TIMEOUT, "the learner's calls to present its new certificate")
    # The shard reads its own folder within a poll of it (REVOCATION_POLL_SECONDS).
    wait_until(lambda: any(c.name == "shard-0" and c.serial == serial_of(run, "shard-0")
                           for c in status(run).certificates), TIMEOUT, "the shard to take its new certificate")
    for proc in run.learners:
        wait_until(lambda: json.loads(run.learner_report_path(proc.name).read_text()).get("steps", 0) >= 80
                   if run.learner_report_path(proc.name).exists() else False, TIMEOUT * 2, f"{proc.name} to train")
    run.stop_learners()
    reports = {l.id: json.loads(run.learner_report_path(l.id).read_text()) for l in run.cfg.learners}
    assert all(proc.returncode == 0 for proc in run.learners)
    assert hashes_agree(reports, [status(run)])


def test_an_expired_certificate_is_refused_naming_its_expiry(tmp_path):
    cfg = tiny_cluster(tmp_path / "state", shards=1, learners=1)
    folder = tmp_path / "expired"
    ca = authority(tmp_path / "ca")
    issue(ca, folder, learner_name("us-east-0"), [], days=-0.002)  # expired 3 minutes ago
    with pytest.raises(ConfigError, match=r"expired on \d{4}-\d\d-\d\d.*diloco certs renew"):
        read_identity(folder, "--tls-dir")
    config = tmp_path / "c.yaml"
    config.write_text(dump_config(cfg))
    learner = subprocess.run([sys.executable, "-m", "diloco", "learner", "--config", str(config), "--learner-id",
                              "us-east-0", "--tls-dir", str(folder)], capture_output=True, text=True, timeout=120)
    assert learner.returncode == 2 and "expired on" in learner.stderr
    assert datetime.date.today().isoformat()[:4] in learner.stderr
