"""The Hugging Face examples' model, data and command line: a tiny LlamaForCausalLM from a LlamaConfig (random
init) on byte-level text assembled from this machine's Python standard library sources. Every
machine with the same Python has the same bytes; no weights, tokenizer or data set is
downloaded (each byte is a token, vocab 256)."""
import argparse
import json
import pathlib
import sysconfig

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import LlamaConfig, LlamaForCausalLM

SEQ_LEN, BATCH_SIZE = 64, 8  # cluster.yaml's syncer.max_tokens_per_step = 8 x 64
TRAIN_BYTES, VALIDATION_BYTES = 300_000, 30_000  # per learner; small, so start-up stays fast


def stdlib_bytes(paths: list[pathlib.Path], limit: int) -> torch.Tensor:
    """The first `limit` bytes of the files read in order, as int64 tokens."""
    text = bytearray()
    for path in paths:
        if len(text) >= limit:
            break
        text += path.read_bytes()
    return torch.frombuffer(text[:limit], dtype=torch.uint8).long()


def learner_text(learner_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Training bytes of one learner and the held-out bytes every learner validates on. The
    files are dealt out: every 10th is held out, and learner i reads its own run of the rest,
    starting i x 50 files further on."""
    files = sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    held_out = files[::10]
    train = [f for i, f in enumerate(files) if i % 10]
    start = 50 * learner_index % len(train)
    return stdlib_bytes(train[start:] + train[:start], TRAIN_BYTES), stdlib_bytes(held_out, VALIDATION_BYTES)


class ByteWindows(Dataset):
    """Non-overlapping windows of `seq_len` bytes in HF's causal-LM form: labels are the inputs
    (the model shifts them by one itself)."""

    def __init__(self, data: torch.Tensor, seq_len: int):
        self.data = data
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.data) // self.seq_len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = self.data[index * self.seq_len: (index + 1) * self.seq_len]
        return {"input_ids": window, "labels": window}


def tiny_llama() -> LlamaForCausalLM:
    """About 132k parameters: two layers of width 64."""
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ_LEN))


@torch.no_grad()
def validation_loss(model: LlamaForCausalLM, data: torch.Tensor, batches: int = 4) -> float:
    """Mean loss over the first `batches` batches of the held-out bytes."""
    model.eval()
    loader = DataLoader(ByteWindows(data, SEQ_LEN), batch_size=BATCH_SIZE)
    losses = [model(**batch).loss.item() for batch, _ in zip(loader, range(batches))]
    model.train()
    return sum(losses) / len(losses)


def example_arguments(description: str) -> argparse.ArgumentParser:
    """The command line both examples share."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", required=True, help="the run's cluster YAML (the shards use the same)")
    parser.add_argument("--learner-id", required=True)
    parser.add_argument("--losses", help="write (step, loss) and validation losses here as JSON")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--catch-up-seconds", type=float, default=3.0,
                        help="after training, follow the global model until it is quiet this long (or SIGTERM)")
    parser.add_argument("--export", metavar="DIR",
                        help="at the end, write the global model as of this learner's leave to DIR as a Hugging Face "
                             "folder (config.json, model.safetensors) and validate it as from_pretrained loads it")
    return parser


def write_losses(args: argparse.Namespace, steps: int, train: list[tuple[int, float]], validation: dict) -> None:
    """Prints how the validation loss moved, and writes every loss to --losses if given."""
    print(f"{args.learner_id}: {steps} steps, validation loss {validation['start']:.3f} -> {validation['end']:.3f}",
          flush=True)
    if args.losses:
        pathlib.Path(args.losses).write_text(json.dumps({"train": train, "validation": validation}))
