"""A user's own model and data, loaded by the learner from "tests.user_plugins:<name>"
strings in the config (see test_learner_local.py)."""

import torch
import torch.nn.functional as F
from torch import nn

NOT_CALLABLE = 42

calls = []  # the keyword arguments of every factory call, for the tests to inspect


class Bigram(nn.Module):
    """Next byte from the current byte alone: the smallest model with the GPT's interface."""

    def __init__(self):
        super().__init__()
        self.seq_len = 16
        self.table = nn.Embedding(256, 256)

    def forward(self, idx, targets=None):
        logits = self.table(idx)
        loss = None if targets is None else F.cross_entropy(logits.view(-1, 256), targets.reshape(-1))
        return logits, loss


def make_model(seed):
    calls.append({"factory": "make_model", "seed": seed})
    return Bigram()


def make_not_a_module(seed):
    return "a string"


class CountingData:
    """Byte sequences that count up by a step of 1..3 from a random start: learnable from
    one byte of context only in part, which is enough to show the loss fall."""

    def __init__(self, learner_index, num_learners, seq_len, batch_size, seed):
        calls.append({"factory": "make_data", "learner_index": learner_index,
                      "num_learners": num_learners, "seq_len": seq_len,
                      "batch_size": batch_size, "seed": seed})
        self.seq_len, self.batch_size = seq_len, batch_size
        self.generator = torch.Generator().manual_seed(seed * 1000 + learner_index)

    def _batch(self, generator):
        starts = torch.randint(0, 256, (self.batch_size, 1), generator=generator)
        steps = torch.randint(1, 4, (self.batch_size, 1), generator=generator)
        windows = (starts + steps * torch.arange(self.seq_len + 1)) % 256
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def next_batch(self):
        return self._batch(self.generator)

    def validation_batches(self):
        fixed = torch.Generator().manual_seed(12345)
        return [self._batch(fixed) for _ in range(2)]

    def state_dict(self):
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state):
        self.generator.set_state(state["generator"])


def make_data(learner_index, num_learners, seq_len, batch_size, seed):
    return CountingData(learner_index, num_learners, seq_len, batch_size, seed)


def make_incomplete_data(learner_index, num_learners, seq_len, batch_size, seed):
    return object()


def model_from_real_memory(seed):
    """A factory that reads its weights' values, which a meta-device build cannot."""
    model = Bigram()
    model.table.weight.data.numpy()
    return model
