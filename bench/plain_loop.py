"""The user-loop path of BENCHMARKS.md section 1: `DecoupledDiLoCo` around a plain loop as a
user writes one (torch.optim.AdamW, a LambdaLR schedule, the loop top to bottom), on the
config's model and data as `diloco learner` builds them (a transformers model syncs under its
own names), so that its global model can be set beside the built-in learner's and data
parallel's at the same settings. Every trainer.eval_every steps and at the end it evaluates its
own model and the global model it holds (the sim's global-against-local curve):

    diloco sim --config bench/cluster.yaml --learner-script bench/plain_loop.py --learners 4 ...

`diloco sim` starts it as `python bench/plain_loop.py --config <run config> --learner-id <id>`
and ends its catch-up with SIGTERM. No checkpoint: a restarted learner starts afresh.
"""
import argparse
import copy

import torch
from torch import nn

from diloco import DecoupledDiLoCo
from diloco.learner.trainer.causal_lm import synced_module
from diloco.learner.trainer.data import build_data
from diloco.learner.trainer.model import build_model
from diloco.learner.trainer.train import lr_at, weight_decay_groups
from diloco.services.contract.config import load_config


@torch.no_grad()
def validation_loss(model: nn.Module, batches: list) -> float:
    model.eval()
    losses = [model(x, y)[1].item() for x, y in batches]
    model.train()
    return sum(losses) / len(losses)


def evaluate(sync: DecoupledDiLoCo, model: nn.Module, batches: list) -> None:
    """The learner's own model and, in a copy, the global model it holds."""
    held = copy.deepcopy(model)
    synced_module(held).load_state_dict(sync.global_state_dict(), strict=False)
    sync.record_evaluation(validation_loss(model, batches), validation_loss(held, batches))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--learner-id", required=True)
    args = parser.parse_args()
    cfg = load_config(args.config)
    learner_index = [learner.id for learner in cfg.learners].index(args.learner_id)
    torch.set_num_threads(cfg.trainer.threads)

    model = build_model(cfg.model, seed=cfg.run.seed)
    data = build_data(cfg, learner_index, model.seq_len)
    opt = cfg.trainer.inner_optimizer
    # torch's own AdamW with the built-in learner's parameter groups and schedule
    optimizer = torch.optim.AdamW(weight_decay_groups(model, opt), lr=opt.lr, betas=(opt.beta1, opt.beta2))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, opt, cfg.trainer.max_steps) / opt.lr)

    batches = data.validation_batches()
    with DecoupledDiLoCo(synced_module(model), cfg, args.learner_id, catch_up_seconds=86400) as sync:
        while not sync.should_stop:
            if sync.steps % cfg.trainer.eval_every == 0:
                with sync.timed("evaluation"):
                    evaluate(sync, model, batches)
            x, y = data.next_batch()
            _, loss = model(x, y)
            optimizer.zero_grad()
            loss.backward()
            if opt.grad_clip:
                nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip)
            optimizer.step()
            schedule.step()
            sync.step(tokens=x.numel())
        with sync.timed("evaluation"):
            evaluate(sync, model, batches)  # the learner's own model before it leaves


if __name__ == "__main__":
    main()
