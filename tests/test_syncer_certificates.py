"""A shard's certificates under mTLS (syncer/certificates.py), one shard in this process over
real gRPC: a revoked certificate is refused on every call once the shard reads its folder, a
list another CA signed is not taken, a CA rotation keeps every process served, and the
certificates it knows are exported."""
from __future__ import annotations

import shutil

import grpc
import pytest

from diloco.services.authority import authority, issue_cluster_certs, revoke, rotate_ca
from diloco.services.client import ShardClient
from diloco.services.contract.revocations import CRL_FILE
from diloco.services.contract.tls import OPERATOR, certs_dir, learner_name, load_identity, read_identity
from diloco.syncer.metrics import SyncerMetrics
from diloco.syncer.service import start_shard
from tests.cluster_config import tiny_cluster

MANIFEST = [(f"w{i}", (64,)) for i in range(4)]


@pytest.fixture
def shard(tmp_path):
    cfg = tiny_cluster(tmp_path / "state", shards=1, learners=2)
    issue_cluster_certs(cfg, certs_dir(cfg))
    handle = start_shard(cfg, 0)
    yield cfg, handle
    handle.stop()


def client(cfg, handle, learner_id: str) -> ShardClient:
    return ShardClient(f"127.0.0.1:{handle.port}", cfg.rpc, learner_id, 1,
                       identity=load_identity(cfg, learner_name(learner_id)))


def test_a_revoked_certificate_is_refused_on_every_call_once_the_shard_reads_its_folder(shard):
    cfg, handle = shard
    east, west = (client(cfg, handle, l.id) for l in cfg.learners)
    east.join("us-east", MANIFEST)
    serial, _ = revoke(cfg, certs_dir(cfg), certs_dir(cfg) / "ca", cfg.learners[0].id)
    assert handle.servicer.certificates.refresh()  # what the shard's watch does every second
    for call in (lambda: east.heartbeat(step=1), lambda: east.join("us-east", MANIFEST),
                 lambda: east.pull(0, 0, max_wait_seconds=0)):
        with pytest.raises(grpc.RpcError) as refused:
            call()
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert f"{serial:x}" in refused.value.details() and "revoked" in refused.value.details()
    west.join("us-west", MANIFEST)  # the other learner is not touched
    counters = handle.core.counters.snapshot()
    assert counters[f"revoked.{cfg.learners[0].id}"] == 3 and counters["refusals.revoked"] == 3


def test_a_revocation_list_the_runs_ca_did_not_sign_is_not_taken(shard, tmp_path):
    cfg, handle = shard
    foreign = tmp_path / "foreign"
    authority(foreign / "ca")
    revoke(cfg, certs_dir(cfg), foreign / "ca", cfg.learners[0].id)  # signed by another CA
    (certs_dir(cfg) / "shard-0" / CRL_FILE).write_bytes((foreign / "ca" / CRL_FILE).read_bytes())
    assert not handle.servicer.certificates.refresh()
    client(cfg, handle, cfg.learners[0].id).join("us-east", MANIFEST)


def test_the_shard_exports_when_each_certificate_it_knows_expires(shard):
    cfg, handle = shard
    client(cfg, handle, cfg.learners[0].id).join("us-east", MANIFEST)
    with ShardClient(f"127.0.0.1:{handle.port}", cfg.rpc, identity=load_identity(cfg, OPERATOR)) as operator:
        operator.status()
    metrics = SyncerMetrics(handle.core.status, handle.servicer.certificates)
    names = {sample.labels["name"] for metric in metrics.registry.collect() for sample in metric.samples
             if sample.name == "diloco_certificate_expiry_timestamp_seconds"}
    assert names == {"ca", "shard-0", f"spiffe://diloco/learner/{cfg.learners[0].id}", "spiffe://diloco/operator"}
    assert metrics.registry.get_sample_value("diloco_syncer_revoked_certificates") == 0


def test_during_a_ca_rotation_both_cas_certificates_are_served_and_after_it_only_the_new_ones(shard, tmp_path):
    cfg, handle = shard
    out, ca_dir = certs_dir(cfg), certs_dir(cfg) / "ca"
    west = cfg.learners[1].id
    rotate_ca(cfg, out, ca_dir, "trust")
    old_west = tmp_path / "old-west"  # a learner machine that has not taken its new certificate yet
    shutil.copytree(out / learner_name(west), old_west)
    rotate_ca(cfg, out, ca_dir, "issue")
    # The shard's next handshakes present its certificate of the new CA, and trust both.
    client(cfg, handle, cfg.learners[0].id).join("us-east", MANIFEST)
    with ShardClient(f"127.0.0.1:{handle.port}", cfg.rpc, west, 1, identity=read_identity(old_west, "old")) as old:
        old.join("us-west", MANIFEST)
    rotate_ca(cfg, out, ca_dir, "finish")
    with ShardClient(f"127.0.0.1:{handle.port}", cfg.rpc, west, 2, identity=read_identity(old_west, "old")) as old:
        with pytest.raises(grpc.RpcError) as refused:
            old.join("us-west", MANIFEST)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # no handshake with a CA no longer trusted
    client(cfg, handle, west).join("us-west", MANIFEST)
