"""The torch device the built-in learner trains on, from the config's `trainer.device`.

    auto      the local rank's GPU (LOCAL_RANK under torchrun, else GPU 0) when CUDA is
              present, else cpu
    cpu       the CPU, also on a machine with GPUs
    cuda      the local rank's GPU, as auto; an error where there is no CUDA
    cuda:N    GPU N, whatever the rank

The config is the run's, shared by machines with and without GPUs, so whether a device
exists is only known here, at start-up: a missing one is DeviceUnavailable naming the key.
"""
from __future__ import annotations

import os

import torch


class DeviceUnavailable(RuntimeError):
    """trainer.device names a device this machine does not have."""


def local_rank() -> int:
    """This process's rank on its machine: torchrun's LOCAL_RANK, 0 outside torchrun."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def resolve_device(setting: str, rank_on_machine: int) -> torch.device:
    """The device `setting` (trainer.device) means for the process of local rank `rank_on_machine`."""
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceUnavailable(f"trainer.device: {setting!r} asks for a GPU, but this machine has no CUDA device "
                                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); "
                                "use auto or cpu to train on the CPU")
    index = int(setting.partition(":")[2]) if ":" in setting else rank_on_machine
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceUnavailable(f"trainer.device: {setting!r} is GPU {index} (local rank {rank_on_machine}), "
                                f"but this machine has {count} GPU(s)")
    return torch.device("cuda", index)
