"""The learner's checkpoint: model, inner optimizer, counters, data position, the random state
of the CPU and of the model's GPUs (dropout), and whatever the sync client keeps in `extra`
(anchors, versions, error-feedback residuals). Every tensor is copied to host memory as it is
taken (learner/sync/host_copy.py): taking a checkpoint needs no room on the model's device.

The file is exactly what torch.save writes, so a user opens it with
`torch.load(path, weights_only=True)`. torch.load happily loads a file whose middle was
damaged; the zip archive torch.save writes holds a CRC-32 of every record, and checking
those (zipfile's testzip) is what refuses a torn or corrupted checkpoint. A checkpoint is
written to a temporary file beside the target, synced, and renamed over it: a crash leaves the
previous checkpoint or the new one, never half of one. The one it replaces is kept beside it
(`<name>.previous`): a checkpoint damaged later (a disk, a copy) falls back to that one, both
named in the log; when neither can be read the learner refuses to start from step 0 unless
told to (`start_fresh`), since that would train its whole budget again.
"""

from __future__ import annotations

import logging
import os
import pathlib
import threading
import zipfile

import torch
from torch import nn

from diloco.learner.trainer.adamw import AdamW
from diloco.learner.sync.host_copy import to_host
from diloco.services.files import atomic_write_with

log = logging.getLogger(__name__)

def checkpoint_state(*, model: nn.Module, optimizer: AdamW, step: int, tokens: int,
                     data_state: dict, extra: dict, ranks: list[dict] | None = None) -> dict:
    """A copy of the state as it is now, in host memory, so training may go on while it is
    serialised and written (a memory copy: a few milliseconds, where serialising takes several
    times as long). `data_state` and `extra` may hold tensors and plain Python containers,
    numbers and strings (what torch.load(weights_only=True) reads). `ranks`: every rank's
    rank_state of an island, in rank order (the model and optimizer are the same on all)."""
    return to_host({
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": step,
        "tokens": tokens,
        **rank_state(model, data_state),
        "ranks": ranks or [],
        "extra": extra,
    })


def rank_state(model: nn.Module, data_state: dict) -> dict:
    """What one process holds of its own: its data position and the random state of its CPU
    and of the model's GPUs."""
    return {"data": data_state, "rng": torch.get_rng_state(),
            "cuda_rng": [torch.cuda.get_rng_state(device) for device in cuda_devices(model)]}


def cuda_devices(model: nn.Module) -> list[torch.device]:
    """The GPUs the model's parameters are on, in index order (none on the CPU)."""
    return sorted({p.device for p in model.parameters() if p.is_cuda}, key=lambda device: device.index)


def restore_rng(checkpoint: dict, model: nn.Module) -> None:
    """The checkpoint's random state, on the CPU and on the model's GPUs (the GPUs' states in
    index order, as taken). A checkpoint of another number of GPUs restores the CPU's alone."""
    torch.set_rng_state(checkpoint["rng"])
    saved, devices = checkpoint.get("cuda_rng", []), cuda_devices(model)
    if len(saved) != len(devices):
        log.warning("checkpoint holds the random state of %d GPU(s), the model is on %d: the GPUs' random "
                    "streams (dropout) start afresh", len(saved), len(devices))
        return
    for state, device in zip(saved, devices):
        torch.cuda.set_rng_state(state, device)


class CheckpointError(RuntimeError):
    """No checkpoint of the state folder can be read: the message names each file and why."""


def previous_checkpoint(path: pathlib.Path) -> pathlib.Path:
    return path.with_name(path.name + ".previous")


def write_checkpoint(path: str | os.PathLike, state: dict) -> None:
    """Atomically replace the checkpoint at `path` with `state` (checkpoint_state's copy); the
    one it replaces becomes `<path>.previous` (a hard link: there is always one at `path`)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        previous = previous_checkpoint(path)
        link = previous.with_name(previous.name + ".tmp")
        link.unlink(missing_ok=True)
        os.link(path, link)
        os.replace(link, previous)
    # 0600: the model's weights are not for other users of the machine to read.
    atomic_write_with(path, lambda temporary: torch.save(state, temporary), mode=0o600)


def save_checkpoint(path: str | os.PathLike, **state) -> None:
    """checkpoint_state(**state), written to `path` before returning."""
    write_checkpoint(path, checkpoint_state(**state))


class CheckpointWriter:
    """Writes checkpoints to one path on a thread of its own: the training thread only takes
    the copy (checkpoint_state), and serialising, the disk write and sync overlap the next
    steps. One write at a time: a newer checkpoint first waits for the one before it, and a
    failed write is raised by the next call."""

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        self._writing: threading.Thread | None = None
        self._error: BaseException | None = None

    def write(self, state: dict) -> None:
        self.wait()
        self._writing = threading.Thread(target=self._write, args=(state,), name="checkpoint", daemon=True)
        self._writing.start()

    def wait(self) -> None:
        """Returns once the last checkpoint given is on disk."""
        if self._writing is not None:
            self._writing.join()
            self._writing = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _write(self, state: dict) -> None:
        try:
            write_checkpoint(self.path, state)
        except BaseException as error:
            self._error = error


def load_checkpoint(path: str | os.PathLike, start_fresh: bool = False) -> dict | None:
    """The checkpoint at `path` (keys model, optimizer, step, tokens, data, rng, cuda_rng, ranks,
    extra), else the one before it (`<path>.previous`), else None when there is none at all.
    Damaged files are left in place. When there are checkpoints but none can be read:
    CheckpointError, or None with a warning if `start_fresh`."""
    path = pathlib.Path(path)
    candidates = [candidate for candidate in (path, previous_checkpoint(path)) if candidate.exists()]
    problems = []
    for candidate in candidates:
        problem = _damage(candidate)
        if problem is None:
            if problems:
                log.warning("%s; resuming from %s, the checkpoint before it", problems[0], candidate)
            # Onto the CPU: a learner restarted on another machine (or device) loads it the same
            # way; the model and optimizer copy the values to their own device.
            return torch.load(candidate, weights_only=True, map_location="cpu")
        problems.append(f"{candidate}: {problem}")
    if not candidates:
        return None
    message = "no checkpoint can be read (" + "; ".join(problems) + ")"
    if start_fresh:
        log.warning("%s: starting from step 0 as told (start fresh)", message)
        return None
    raise CheckpointError(message + ": starting from step 0 would train the whole budget again. Restore a "
                          "checkpoint, or start fresh on purpose (`diloco learner --start-fresh`)")


def _damage(path: pathlib.Path) -> str | None:
    """Why the checkpoint file cannot be loaded, or None when it is whole."""
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
    except zipfile.BadZipFile:
        return f"not a whole checkpoint (torn, or not one at all; {path.stat().st_size} bytes)"
    return None if damaged is None else f"checksum mismatch in {damaged} (corrupted file)"
