"""The Hugging Face `Trainer` made a Decoupled DiLoCo learner by one callback: the same tiny
LlamaForCausalLM and byte-level text as train.py, trained by `Trainer.train()`.

    python examples/hf/trainer.py --config examples/hf/cluster.yaml --learner-id us-east-0 \
        --losses /tmp/us-east-0-losses.json

The DiLoCo lines are marked `# DiLoCo`; everything else is what the script would be without it.
"""
import pathlib
import sys
import tempfile

import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from diloco import DecoupledDiLoCoCallback, load_config

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from byte_llama import (BATCH_SIZE, ByteWindows, SEQ_LEN, example_arguments, learner_text, tiny_llama,
                        validation_loss, write_losses)  # noqa: E402


def main():
    parser = example_arguments(__doc__.split("\n\n")[0])
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the first learner seeds the run's global model with this init

    cfg = load_config(args.config)
    train_data, validation_data = learner_text([learner.id for learner in cfg.learners].index(args.learner_id))
    model = tiny_llama()
    validation = {"start": validation_loss(model, validation_data)}
    callback = DecoupledDiLoCoCallback(cfg, args.learner_id, catch_up_seconds=args.catch_up_seconds)  # DiLoCo
    with tempfile.TemporaryDirectory() as output_dir:
        training = TrainingArguments(
            output_dir=output_dir, max_steps=cfg.trainer.max_steps,  # DiLoCo: the run's budget ends training
            per_device_train_batch_size=BATCH_SIZE, learning_rate=args.lr, weight_decay=0.1, warmup_steps=10,
            max_grad_norm=1.0, logging_steps=10, save_strategy="no", report_to=[], use_cpu=True,
            disable_tqdm=True, include_num_input_tokens_seen=True)  # DiLoCo: tokens per step from the Trainer
        trainer = Trainer(model=model, args=training, train_dataset=ByteWindows(train_data, SEQ_LEN),
                          callbacks=[callback])  # DiLoCo
        trainer.train()  # DiLoCo: after it, `model` is the global model as of this learner's leave
        if args.export:
            trainer.save_model(args.export)  # config.json and model.safetensors of that global model
            model = AutoModelForCausalLM.from_pretrained(args.export)

    validation["end"] = validation_loss(model, validation_data)
    train_losses = [(entry["step"], entry["loss"]) for entry in trainer.state.log_history if "loss" in entry]
    write_losses(args, trainer.state.global_step, train_losses, validation)


if __name__ == "__main__":
    main()
