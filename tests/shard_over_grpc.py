"""What tests of a shard over gRPC share: a 2-shard config with certificates for its processes,
the identity each one presents, the model the learners join with, and push streams."""
import socket

import torch
import yaml

from diloco.services.authority import issue_cluster_certs
from diloco.services.contract.codecs import get_codec
from diloco.services.contract.config import load_config, parse_config
from diloco.services.contract.payload import describe, iter_chunks
from diloco.services.contract.tls import OPERATOR, certs_dir, learner_name, load_identity
from diloco.services.contract.wire import pb

MANIFEST = [(f"blocks.{i}.w", (100 + 37 * i,)) for i in range(6)] + [("embed.w", (256,)), ("head.w", (128,))]
LEARNERS = ("a", "b", "c")
BLOCK = 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(tmp_path, limits=None, rpc=None, **syncer):
    """A 2-shard config (shards not started) with certificates for its processes; `limits`
    and `rpc` are those sections of the config."""
    syncer.setdefault("grace", {"mode": "fixed", "seconds": 0.2})
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({
        "run": {"state_dir": str(tmp_path / "state")},
        "shards": [{"address": f"127.0.0.1:{free_port()}", "metrics_port": 0} for _ in range(2)],
        "learners": [{"id": learner, "region": "r"} for learner in LEARNERS],
        "sync": {"fragments": 4, "interval_steps": 8, "overlap_steps": 1, "codec": "int4", "codec_block_size": BLOCK},
        "syncer": syncer,
        "trainer": {"heartbeat_seconds": 0.2},
        "rpc": rpc or {"deadline_seconds": 10.0},
        "limits": limits or {},
    }))
    cfg = load_config(path)
    # Certificates for the config's processes, and for "mallory": a learner certificate of the
    # run's CA whose id the config does not list (a learner removed from the run).
    extra = cfg.model_dump(mode="json")
    extra["learners"].append({"id": "mallory", "region": "r"})
    issue_cluster_certs(parse_config(extra), certs_dir(cfg))
    return path, cfg


def identity(cfg, learner):
    return load_identity(cfg, learner_name(learner) if learner else OPERATOR)


def outer_gradient(fragment, numel, values=None, *, learner="a", incarnation=1, base=3, codec="int4",
                   block=BLOCK, chunk_bytes=None, kind=pb.PUSH_KIND_OUTER_GRADIENT, c_steps=4):
    """A push stream (header, chunks) that is valid unless the arguments make it otherwise."""
    codec = get_codec(codec)
    values = torch.full((numel,), 0.02) if values is None else values
    payload = codec.encode(values, block)
    chunk_bytes = chunk_bytes or len(payload)
    header = pb.PushHeader(learner_id=learner, incarnation=incarnation, fragment_id=fragment, kind=kind,
                           base_version=base, c_steps=c_steps, c_tokens=64, step_seconds=0.1,
                           payload=describe(codec, numel, payload, block, chunk_bytes))
    return header, [pb.PushRequest(chunk=c) for c in iter_chunks(payload, chunk_bytes)]
