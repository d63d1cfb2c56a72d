"""`diloco status` against a real shard over gRPC: learners (region, incarnation, alive,
staleness, last step), fragments (version, hash prefix, last round), totals, and a shard that
does not answer."""
from __future__ import annotations

import grpc
import pytest
import torch

from diloco.cli import main
from diloco.services.client import ShardClient
from diloco.services.contract.config import dump_config
from diloco.services.authority import issue_cluster_certs
from diloco.services.contract.tls import OPERATOR, certs_dir, learner_name, load_identity
from diloco.services.contract.wire import pb
from diloco.syncer.service import start_shard
from tests.cluster_config import tiny_cluster

# Four tensors, so the plan has a tensor for each of the 4 fragments.
MANIFEST = [("embed", (64, 8)), ("block.w", (32, 8)), ("block.b", (32,)), ("head", (8,))]
INCARNATION = 1234567


@pytest.fixture
def cluster(tmp_path):
    """Shard 0 of a 2-shard config serving, shard 1 not started. A learner joined, seeded
    every fragment of shard 0, pushed one outer gradient (a round closed: version 1) and
    heartbeat at step 42 while still holding version 0 (staleness 1). One seed came too late
    (already_seeded) and one join named another learner's id (wrong_learner)."""
    cfg = tiny_cluster(tmp_path / "state", shards=2, learners=3)
    config_path = tmp_path / "cluster.yaml"
    config_path.write_text(dump_config(cfg))
    issue_cluster_certs(cfg, certs_dir(cfg))
    handle = start_shard(cfg, 0, listen=cfg.shards[0].address, state_dir=tmp_path / "state")
    learner = cfg.learners[0]
    try:
        with ShardClient(cfg.shards[0].address, cfg.rpc, learner.id, INCARNATION,
                         identity=load_identity(cfg, learner_name(learner.id))) as client:
            fragments = client.join(learner.region, MANIFEST).fragments
            for info in fragments:
                client.push(info.fragment_id, torch.zeros(info.numel), codec="fp32", block_size=128,
                            kind=pb.PUSH_KIND_SEED)
            first = fragments[0]
            client.push(first.fragment_id, torch.full((first.numel,), 0.01), codec="int4", block_size=128,
                        base_version=0, c_steps=5, c_tokens=640, step_seconds=0.02)
            client.pull(first.fragment_id, 0, min_version=1, max_wait_seconds=5)
            with pytest.raises(grpc.RpcError):  # seeded already: a race between learners, harmless
                client.push(first.fragment_id, torch.zeros(first.numel), codec="fp32", block_size=128,
                            kind=pb.PUSH_KIND_SEED)
            with pytest.raises(grpc.RpcError):  # a real refusal: another learner's id
                ShardClient(cfg.shards[0].address, cfg.rpc, cfg.learners[1].id, INCARNATION,
                            identity=load_identity(cfg, learner_name(learner.id))).join(learner.region, MANIFEST)
            client.heartbeat(step=42, step_seconds=0.02, held_versions={f.fragment_id: 0 for f in fragments})
        yield cfg, config_path, handle, [f.fragment_id for f in fragments]
    finally:
        handle.stop()


def test_status_shows_learners_fragments_and_totals(cluster, capsys):
    cfg, _, handle, owned = cluster
    operator = certs_dir(cfg) / OPERATOR
    assert main(["status", "--syncer", cfg.shards[0].address, "--tls-dir", str(operator)]) == 0
    out = capsys.readouterr().out
    assert "shards    1 of 1 answering" in out
    assert "learners  1 alive of 1 known" in out
    learner = cfg.learners[0]
    (row,) = [line.split() for line in out.splitlines() if line.startswith(learner.id)]
    # LEARNER REGION INCARNATION ALIVE STALENESS LAST-STEP LAST-HEARD
    assert row[:6] == [learner.id, learner.region, str(INCARNATION), "yes", "1", "42"]
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split() and line.split()[0].isdigit()}
    assert sorted(map(int, rows)) == sorted(owned)
    views = {f.id: f for f in handle.core.status().fragments}
    for fragment_id in owned:
        # FRAGMENT SHARD PARAMETERS VERSION HASH PENDING LAST-ROUND...
        fid, shard, numel, version, hash_prefix, pending = rows[str(fragment_id)][:6]
        view = views[fragment_id]
        assert (shard, numel, version, pending) == ("0", str(view.numel), str(view.version), "0")
        assert hash_prefix == view.state_hash[:12]
    first = rows[str(owned[0])]
    assert first[3] == "1" and " ".join(first[6:]).startswith("#1 all, contributors 1,")
    assert "totals    1 outer steps" in out and "contributions 1 accepted" in out
    assert "requests refused: 1 (wrong_learner 1); races and retries: 1 (already_seeded 1)" in out
    # The certificates the shard knows: its CA, its own, and the one each caller presented.
    certificates = {line.split()[0]: line.split() for line in out.splitlines()
                    if line.startswith(("ca ", "shard-0 ", "spiffe://"))}
    assert set(certificates) == {"ca", "shard-0", f"spiffe://diloco/learner/{learner.id}",
                                 "spiffe://diloco/operator"}
    assert " ".join(certificates["shard-0"][3:]) == "365 days left"
    assert "revoked   0 certificate(s) in the shards' revocation list" in out


def test_status_from_a_config_names_the_shard_that_does_not_answer(cluster, capsys):
    cfg, config_path, _, _ = cluster
    assert main(["status", "--config", str(config_path), "--timeout", "1"]) == 1
    out = capsys.readouterr().out
    assert "shards    1 of 2 answering" in out
    assert f"{cfg.shards[1].address}: UNAVAILABLE" in out or f"{cfg.shards[1].address}: DEADLINE_EXCEEDED" in out
    assert cfg.learners[0].id in out


def test_status_needs_a_certificate_the_shards_trust(cluster, capsys, tmp_path):
    cfg, _, _, _ = cluster
    address = cfg.shards[0].address
    # Without --tls-dir or --plaintext there is nothing to say how to connect.
    assert main(["status", "--syncer", address]) == 2
    assert "--tls-dir" in capsys.readouterr().err
    # In plaintext, or with a certificate of another CA, the TLS handshake fails: no answer.
    assert main(["status", "--syncer", address, "--plaintext", "--timeout", "2"]) == 1
    assert f"{address}: UNAVAILABLE" in capsys.readouterr().out
    other = tmp_path / "other-ca"
    issue_cluster_certs(cfg, other)
    assert main(["status", "--syncer", address, "--tls-dir", str(other / OPERATOR), "--timeout", "2"]) == 1
    assert f"{address}: UNAVAILABLE" in capsys.readouterr().out
