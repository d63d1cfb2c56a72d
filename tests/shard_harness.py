"""A shard's core driven directly by tests, on a fake clock: the config of one shard with three
learners, and the calls those learners make. No gRPC, no sleeping."""
import torch

from diloco.services.contract.codecs import get_codec
from diloco.services.contract.config import parse_config
from diloco.services.contract.payload import describe, iter_chunks
from diloco.services.contract.wire import pb
from diloco.syncer.core import ShardCore

MANIFEST = [("blocks.0.w", (64,)), ("blocks.1.w", (48,)), ("head.w", (40,)), ("embed.w", (32,))]
LEARNERS = ("a", "b", "c")


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_config(**syncer):
    """One shard, three learners, two fragments, fp32 unless a test asks for a codec."""
    codec = syncer.pop("codec", "fp32")
    syncer.setdefault("grace", {"mode": "fixed", "seconds": 1.0})
    return parse_config({
        "shards": [{"address": "127.0.0.1:1"}],
        "learners": [{"id": learner, "region": "r"} for learner in LEARNERS],
        "sync": {"fragments": 2, "interval_steps": 4, "overlap_steps": 1, "codec": codec},
        "syncer": syncer,
    })


class Shard:
    """A core with its clock, plus the calls a learner makes."""

    def __init__(self, cfg, journal=None, joined=LEARNERS, seed=True, anchor_folder=None):
        self.cfg, self.clock = cfg, FakeClock()
        self.core = ShardCore(cfg, 0, clock=self.clock, journal=journal, anchor_folder=anchor_folder)
        for learner in joined:
            self.core.join(learner, 1, "r", MANIFEST)
        self.seeds = {}
        if seed:
            for fid, state in self.core.fragments.items():
                self.seeds[fid] = torch.randn(state.fragment.numel, generator=torch.Generator().manual_seed(fid))
                self.push(joined[0], fid, self.seeds[fid], kind=pb.PUSH_KIND_SEED)

    def numel(self, fid=0):
        return self.core.fragments[fid].fragment.numel

    def push(self, learner, fid, values, **push):
        return self.core.push(*self.push_parts(learner, fid, values, **push))

    def push_parts(self, learner, fid, values, *, base=0, c_steps=10, c_tokens=1000, step_seconds=0.5,
                   kind=pb.PUSH_KIND_OUTER_GRADIENT, incarnation=1, chunk_bytes=1 << 20, final=False):
        """The header and chunks of the push a learner sends."""
        codec = get_codec("fp32" if kind == pb.PUSH_KIND_SEED else self.cfg.sync.codec)
        block = self.cfg.sync.codec_block_size
        payload = codec.encode(values, block)
        header = pb.PushHeader(learner_id=learner, incarnation=incarnation, fragment_id=fid, kind=kind,
                               base_version=base, c_steps=c_steps, c_tokens=c_tokens,
                               step_seconds=step_seconds, final=final,
                               payload=describe(codec, values.numel(), payload, block, chunk_bytes))
        return header, iter_chunks(payload, chunk_bytes)

    def value(self, fid=0):
        return self.core.fragments[fid].committed.value

    def version(self, fid=0):
        return self.core.fragments[fid].version


def delta(seed, numel, scale=0.01):
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * scale
