"""A plain PyTorch training loop made a Decoupled DiLoCo learner: a small character-level
transformer, the user's own SGD, text read from Python's standard library sources.

    python examples/own_loop/train.py --config examples/own_loop/cluster.yaml --learner-id us-east-0 \
        --checkpoint /tmp/us-east-0.pt --losses /tmp/us-east-0-losses.json

The DiLoCo lines are marked `# DiLoCo`; everything else is what the script would be without it.

The data-parallel baseline is the same script under torchrun, one process per learner of the
config: rank r trains on learner r's text with the same batch and optimizer, DDP averages the
gradients of every step, and nothing is synced (the lines marked `# Baseline`). The job counts
every rank's tokens in a step, so its config's syncer.max_tokens_per_step is the ranks times the
learners' (here 3 x 8 x 64, with --set in `diloco sim` or in a copy of the file):

    torchrun --nproc-per-node 3 examples/own_loop/train.py --config cluster-dp.yaml \
        --learner-id us-east-0 --data-parallel
"""
import argparse
import json
import os
import pathlib
import sysconfig
import zlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from diloco import DecoupledDiLoCo, atomic_write_with

SEQ_LEN, BATCH_SIZE, VOCAB = 64, 8, 256  # bytes as tokens: syncer.max_tokens_per_step = 8 x 64
TRAIN_BYTES, VALIDATION_BYTES = 400_000, 40_000  # read so much of the stdlib: start-up stays fast


class CharTransformer(nn.Module):
    def __init__(self, d_model=64, n_head=4, n_layer=2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.position = nn.Parameter(0.02 * torch.randn(SEQ_LEN, d_model))
        layer = nn.TransformerEncoderLayer(d_model, n_head, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(SEQ_LEN), persistent=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        x = self.encoder(x, mask=self.causal, is_causal=True)
        return self.head(self.norm(x))


def read_text(learner_id):
    """Every 20th stdlib file is held out (the same for all learners); each learner starts reading
    the others at a place of its own, so learners see different text."""
    files = sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    held_out, train = files[::20], [f for i, f in enumerate(files) if i % 20]
    start = zlib.crc32(learner_id.encode()) % len(train)

    def read(paths, limit):
        chunks, size = [], 0
        for path in paths:
            chunks.append(path.read_bytes()[: limit - size])
            size += len(chunks[-1])
            if size >= limit:
                break
        return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()

    return read(train[start:] + train[:start], TRAIN_BYTES), read(held_out, VALIDATION_BYTES)


def batch_at(data, position):
    """BATCH_SIZE consecutive windows from `position` on: inputs and next-byte targets."""
    starts = [(position + i * SEQ_LEN) % (len(data) - SEQ_LEN - 1) for i in range(BATCH_SIZE)]
    windows = torch.stack([data[s: s + SEQ_LEN + 1] for s in starts])
    return windows[:, :-1], windows[:, 1:]


@torch.no_grad()
def validation_loss(model, data, batches=8):
    model.eval()
    losses = [nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
              for x, y in (batch_at(data, i * BATCH_SIZE * SEQ_LEN) for i in range(batches))]
    model.train()
    return sum(losses) / len(losses)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the run's cluster YAML (the shards use the same)")
    parser.add_argument("--learner-id", required=True)
    parser.add_argument("--checkpoint", help="resume from this file if it exists; save to it")
    parser.add_argument("--checkpoint-every", type=int, default=25)
    parser.add_argument("--losses", help="write (step, loss) and validation losses here as JSON")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--catch-up-seconds", type=float, default=3.0,
                        help="after training, follow the global model until it is quiet this long (or SIGTERM)")
    parser.add_argument("--data-parallel", action="store_true",
                        help="the baseline, under torchrun with one process per learner: gradients averaged every step")
    args = parser.parse_args()
    if args.data_parallel and args.checkpoint:
        parser.error("--data-parallel keeps no checkpoint here: leave out --checkpoint")
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the first learner seeds the run's global model with this init

    model = CharTransformer()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True)
    if args.data_parallel:  # Baseline
        dist.init_process_group("gloo")
    sync = DecoupledDiLoCo(model, config=args.config, learner_id=args.learner_id,  # DiLoCo
                           catch_up_seconds=args.catch_up_seconds, enabled=not args.data_parallel,
                           optimizer=optimizer)  # a heal (its model went NaN) clears its state
    forward, text_of = model, args.learner_id
    if args.data_parallel:  # Baseline: rank r reads learner r's text; DDP averages the gradients
        forward, text_of = DistributedDataParallel(model), sync.cfg.learners[dist.get_rank()].id
    train_data, validation_data = read_text(text_of)
    if args.checkpoint and os.path.exists(args.checkpoint):
        checkpoint = torch.load(args.checkpoint, weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        step, position, losses, validation = (checkpoint[k] for k in ("step", "position", "losses", "validation"))
        sync.load_state_dict(checkpoint["diloco"])  # DiLoCo: before entering
        print(f"{args.learner_id}: resumed at step {step}", flush=True)
    else:
        step, position, losses, validation = 0, 0, [], {"start": validation_loss(model, validation_data)}

    with sync:  # DiLoCo: joins the run, seeds or pulls the global model into `model`
        while not sync.should_stop:  # DiLoCo: trainer.max_steps of the config, or SIGTERM
            x, y = batch_at(train_data, position)
            loss = nn.functional.cross_entropy(forward(x).flatten(0, 1), y.flatten())
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            sync.step(tokens=x.numel())  # DiLoCo: syncs fragments that are due, applies results
            step, position = step + 1, position + x.numel()
            losses.append((step, loss.item()))
            if step % 50 == 0:
                print(f"{args.learner_id}: step {step} loss {loss.item():.3f}", flush=True)
            if args.checkpoint and step % args.checkpoint_every == 0:
                with sync.timed("checkpoint"):  # DiLoCo: not counted as step time
                    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                             "position": position, "losses": losses, "validation": validation,
                             "diloco": sync.state_dict()}  # DiLoCo
                    # never a half-written checkpoint
                    atomic_write_with(args.checkpoint, lambda path: torch.save(state, path))

    validation["end"] = validation_loss(model, validation_data)
    print(f"{text_of}: validation loss {validation['start']:.3f} -> {validation['end']:.3f}", flush=True)
    if args.losses and sync.island.leader:  # Baseline: one model, written by rank 0
        pathlib.Path(args.losses).write_text(json.dumps({"train": losses, "validation": validation}))
    if args.data_parallel:  # Baseline
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
