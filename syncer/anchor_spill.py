"""Served anchors' values beyond syncer.kept_anchors, on the shard's state disk
(docs/protocol.md, "The downlink"): a value some learner's newest anchor still refers to is
written here as it leaves memory and read back for that learner's next pull, which is then one
delta rather than the updates since or a snapshot. So the shard's memory holds kept_anchors
values per fragment whatever the number of learners, and its disk 4 B per owned parameter per
value out of memory. Not durable, as the anchors are not: the folder starts empty with the
process. A value the disk refuses (full, failing) is dropped, as it would be without a folder.
"""
from __future__ import annotations

import logging
import pathlib
import shutil

import torch

from diloco.syncer.counters import Counters

log = logging.getLogger(__name__)


class AnchorSpill:
    """One fragment's values on disk, a file per state hash."""

    def __init__(self, directory: pathlib.Path, numel: int, counters: Counters):
        self.directory, self.numel, self.counters = directory, numel, counters
        shutil.rmtree(directory, ignore_errors=True)  # an earlier process's anchors: nobody holds them now
        directory.mkdir(parents=True)

    def write(self, state_hash: str, value: torch.Tensor) -> bool:
        """Whether `value` is on disk now, under its hash."""
        path = self.directory / state_hash
        try:
            with open(path, "wb") as file:
                file.write(memoryview(value.numpy()).cast("B"))
        except OSError as error:
            log.warning("%s: an anchor's value is dropped, not kept on disk: %s", self.directory, error)
            path.unlink(missing_ok=True)
            return False
        self.counters.add("anchor_values_spilled")
        self.counters.add("anchor_spill_bytes", value.nbytes)
        return True

    def read(self, state_hash: str) -> torch.Tensor | None:
        """The value written under `state_hash`; None if the disk no longer gives all of it."""
        value = torch.empty(self.numel, dtype=torch.float32)
        try:
            with open(self.directory / state_hash, "rb") as file:
                complete = file.readinto(memoryview(value.numpy()).cast("B")) == value.nbytes
        except OSError as error:
            log.warning("%s: an anchor's value could not be read back: %s", self.directory, error)
            return None
        if not complete:
            return None
        self.counters.add("anchor_values_loaded")
        return value

    def delete(self, state_hash: str) -> None:
        (self.directory / state_hash).unlink(missing_ok=True)
