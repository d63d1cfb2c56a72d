"""A Hugging Face LlamaForCausalLM trained by its user's own loop (AdamW, plain PyTorch) as one
learner of a Decoupled DiLoCo run. Random init from a small LlamaConfig, bytes as tokens: nothing
is downloaded.

    python examples/hf/train.py --config examples/hf/cluster.yaml --learner-id us-east-0 \
        --losses /tmp/us-east-0-losses.json

The DiLoCo lines are marked `# DiLoCo`; everything else is what the script would be without it.
`--no-sync` trains alone with the same budget (DecoupledDiLoCo(enabled=False)): a baseline.
`--export DIR` writes the global model as of this learner's leave as a Hugging Face folder and
validates it as `AutoModelForCausalLM.from_pretrained(DIR)` loads it. The run's final model is
the last learner's to leave; `diloco export --config ... --out DIR` pulls it from the shards.
"""
import pathlib
import sys

import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from diloco import DecoupledDiLoCo
from diloco import load_config

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from byte_llama import (BATCH_SIZE, SEQ_LEN, ByteWindows, example_arguments, learner_text, tiny_llama,
                        validation_loss, write_losses)  # noqa: E402


def main():
    parser = example_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--no-sync", action="store_true", help="train alone, never contacting a shard")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the first learner seeds the run's global model with this init

    learner_ids = [learner.id for learner in load_config(args.config).learners]
    train_data, validation_data = learner_text(learner_ids.index(args.learner_id))
    loader = DataLoader(ByteWindows(train_data, SEQ_LEN), batch_size=BATCH_SIZE, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(len(learner_ids)))
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    losses, validation = [], {"start": validation_loss(model, validation_data)}

    with DecoupledDiLoCo(model, config=args.config, learner_id=args.learner_id,  # DiLoCo
                         catch_up_seconds=args.catch_up_seconds, enabled=not args.no_sync,
                         optimizer=optimizer) as sync:
        while not sync.should_stop:  # DiLoCo: trainer.max_steps of the config, or SIGTERM
            for batch in loader:
                loss = model(**batch).loss
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                sync.step(tokens=batch["input_ids"].numel())  # DiLoCo: syncs fragments that are due
                losses.append((len(losses) + 1, loss.item()))
                if sync.should_stop:  # DiLoCo
                    break

    if args.export and not args.no_sync:  # the budget spent, `model` is that global model too
        sync.export(args.export)  # DiLoCo: config.json and model.safetensors
        model = AutoModelForCausalLM.from_pretrained(args.export)
    validation["end"] = validation_loss(model, validation_data)
    write_losses(args, len(losses), losses, validation)


if __name__ == "__main__":
    main()
