"""The learner's data: its own shard of the built-in corpus, or the user's own source.

    data = build_data(cfg, learner_index, seq_len=model.seq_len)
    x, y = data.next_batch()              # (batch, seq_len) int64; y is x shifted by one byte
    held_out = data.validation_batches()  # the same fixed list for every learner

The built-in corpus is the Python standard library's own .py sources, bytes as tokens: every
machine with the same Python has it, byte for byte. Everything about it is deterministic:
files in sorted order, a file's side of the train/validation split decided by a hash of its
path, each learner's shard a fixed slice of the train bytes, sampling from a generator seeded
by (run seed, learner index, rank) whose state a checkpoint saves.

A user's data comes from `data: "pkg.module:factory"` in the config:
`factory(learner_index=, num_learners=, seq_len=, batch_size=, seed=)` returns an object with
the DataSource interface below.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import os
import pathlib
import sys
import sysconfig
import zlib
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from diloco.services.contract.config import Config, ConfigError, CorpusConfig, resolve_factory
from diloco.services.files import atomic_write_with

# Between files, so no window reads one file's end as if it ran on into the next one's start.
# Source files never contain a NUL byte.
FILE_SEPARATOR = b"\0"
_EXCLUDED_DIRS = {"site-packages", "__pycache__"}


@runtime_checkable
class DataSource(Protocol):
    """What a learner's data must offer (the built-in CorpusShard, or a user factory's object)."""

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, (batch_size, seq_len) int64 each, targets shifted by one token."""

    def validation_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The held-out set: the same batches on every call and for every learner, so
        validation losses of different learners and different times compare."""

    def state_dict(self) -> dict:
        """The position of the training stream: torch tensors and plain Python values only
        (it is stored in the learner's checkpoint, which loads with weights_only=True)."""

    def load_state_dict(self, state: dict) -> None:
        """Continue the training stream exactly where state_dict() was taken."""


# --- the built-in corpus -----------------------------------------------------------------

def stdlib_files() -> list[tuple[str, pathlib.Path]]:
    """(relative posix path, path) of every .py source of the standard library, sorted by
    relative path. Leaves out installed packages and the build-specific files whose bytes
    depend on where this Python was built (_sysconfigdata_*, config-*/), so two machines
    with the same Python read the same corpus."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = pathlib.Path(dirpath)
        dirnames[:] = [d for d in dirnames
                       if d not in _EXCLUDED_DIRS and not (here == root and d.startswith("config-"))]
        for name in filenames:
            if name.endswith(".py") and not name.startswith("_sysconfigdata_"):
                path = here / name
                files.append((path.relative_to(root).as_posix(), path))
    return sorted(files)


def is_validation(relative_path: str, validation_fraction: float) -> bool:
    """The file's side of the split. crc32 of the path, not hash(): the same on every
    process and machine (str hashes are salted per process)."""
    return zlib.crc32(relative_path.encode()) / 2**32 < validation_fraction


def matching_files(patterns: list[str]) -> list[tuple[str, pathlib.Path]]:
    """(path relative to its pattern's fixed prefix, path) of every file the glob patterns
    match ("**" recursing), sorted and without repeats. ConfigError naming a pattern that
    matches no file."""
    files = {}
    for pattern in patterns:
        parts = pathlib.PurePath(pattern).parts
        fixed = list(itertools.takewhile(lambda part: not glob.has_magic(part), parts))
        base = pathlib.Path(*fixed) if len(fixed) < len(parts) else pathlib.Path(pattern).parent
        matched = [pathlib.Path(p) for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)]
        if not matched:
            raise ConfigError(f"data.files: {pattern!r} matches no file here (relative patterns start at "
                              f"{os.getcwd()})")
        for path in matched:
            files.setdefault(path.resolve(), path.relative_to(base).as_posix())
    return sorted((relative, path) for path, relative in files.items())


def corpus_files(corpus_cfg: CorpusConfig) -> list[tuple[str, pathlib.Path]]:
    return matching_files(corpus_cfg.files) if corpus_cfg.corpus == "files" else stdlib_files()


def read_corpus(corpus_cfg: CorpusConfig) -> list[tuple[str, bytes]]:
    """(relative path, contents) of the corpus files in order, at most `max_bytes` of
    contents in all (the last file cut short). Empty files are left out: they only add
    separators."""
    files, total, max_bytes = [], 0, corpus_cfg.max_bytes
    for relative_path, path in corpus_files(corpus_cfg):
        if max_bytes is not None and total >= max_bytes:
            break
        contents = path.read_bytes()
        if max_bytes is not None:
            contents = contents[: max_bytes - total]
        if contents:
            files.append((relative_path, contents))
            total += len(contents)
    return files


def build_corpus(corpus_cfg: CorpusConfig) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) uint8 arrays: each the files of its side joined by FILE_SEPARATOR."""
    train, validation = [], []
    for relative_path, contents in read_corpus(corpus_cfg):
        side = validation if is_validation(relative_path, corpus_cfg.validation_fraction) else train
        side.append(contents)
    return (np.frombuffer(FILE_SEPARATOR.join(train), dtype=np.uint8),
            np.frombuffer(FILE_SEPARATOR.join(validation), dtype=np.uint8))


def load_corpus(corpus_cfg: CorpusConfig, cache_dir: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """build_corpus's (train, validation), memory-mapped from .npy files under cache_dir.
    The first process to need them builds and writes them; the others map the same files."""
    if corpus_cfg.corpus == "files":  # the files' names, sizes and times: edited files are read again
        listing = [(relative, stat.st_size, stat.st_mtime_ns)
                   for relative, stat in ((relative, path.stat()) for relative, path in corpus_files(corpus_cfg))]
        source = "files-" + hashlib.sha256(repr(listing).encode()).hexdigest()[:16]
    else:
        source = sys.implementation.name + ".".join(map(str, sys.version_info[:3]))
    stem = f"corpus-{source}-max{corpus_cfg.max_bytes or 'all'}-val{corpus_cfg.validation_fraction}"
    cache_dir = pathlib.Path(cache_dir)
    paths = cache_dir / f"{stem}-train.npy", cache_dir / f"{stem}-validation.npy"
    if not all(path.exists() for path in paths):
        cache_dir.mkdir(parents=True, exist_ok=True)
        for path, array in zip(paths, build_corpus(corpus_cfg)):
            _save_atomically(path, array)
    return tuple(np.load(path, mmap_mode="r") for path in paths)


def _save_atomically(path: pathlib.Path, array: np.ndarray) -> None:
    # Learners starting together may all build the corpus: each writes a private temporary
    # file and renames it into place, so a reader sees either no file or a whole one (and
    # every writer's bytes are the same).
    def save(temporary: pathlib.Path) -> None:
        with open(temporary, "wb") as file:  # np.save given a path would add ".npy" to its name
            np.save(file, array)

    atomic_write_with(path, save)


class CorpusShard:
    """One learner's view of the corpus: random windows from its own contiguous slice of the
    train bytes, and the fixed validation set shared by all learners.

    Shard i of M is train[i*L : (i+1)*L] with L = len(train) // M. The ranks of an island
    share their learner's shard and draw different windows from it."""

    def __init__(self, train: np.ndarray, validation: np.ndarray, *, learner_index: int,
                 num_learners: int, seq_len: int, batch_size: int, eval_batches: int,
                 seed: int, rank: int = 0):
        if not 0 <= learner_index < num_learners:
            raise ValueError(f"learner index {learner_index} out of range for {num_learners} learners")
        shard_len = len(train) // num_learners
        for what, size in (("a learner's train shard", shard_len), ("the validation set", len(validation))):
            if size < seq_len + 1:
                raise ValueError(f"{what} has {size} bytes, fewer than seq_len + 1 = {seq_len + 1}: "
                                 f"raise data.max_bytes or use fewer learners")
        self.shard = train[learner_index * shard_len : (learner_index + 1) * shard_len]
        self.validation = validation
        self.learner_index, self.num_learners = learner_index, num_learners
        self.seq_len, self.batch_size, self.eval_batches = seq_len, batch_size, eval_batches
        self.generator = torch.Generator().manual_seed(sampling_seed(seed, learner_index, rank))
        self._validation_batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.shard) - self.seq_len, (self.batch_size,),
                               generator=self.generator)
        return self._windows(self.shard, starts.numpy())

    def validation_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # Windows at evenly spaced offsets over the whole validation set: no randomness, so
        # every learner evaluates on exactly the same bytes.
        if self._validation_batches is None:
            count = self.eval_batches * self.batch_size
            starts = np.linspace(0, len(self.validation) - self.seq_len - 1, count).astype(np.int64)
            self._validation_batches = [
                self._windows(self.validation, starts[i : i + self.batch_size])
                for i in range(0, count, self.batch_size)
            ]
        return self._validation_batches

    def state_dict(self) -> dict:
        return {"learner_index": self.learner_index, "num_learners": self.num_learners,
                "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        # A position in another shard means nothing here (the config's learners changed).
        if (state["learner_index"], state["num_learners"]) != (self.learner_index, self.num_learners):
            raise ValueError(f"data state of learner {state['learner_index']} of {state['num_learners']} "
                             f"cannot continue learner {self.learner_index} of {self.num_learners}")
        self.generator.set_state(state["generator"])

    def _windows(self, data: np.ndarray, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        windows = torch.from_numpy(data[starts[:, None] + np.arange(self.seq_len + 1)].astype(np.int64))
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def sampling_seed(seed: int, learner_index: int, rank: int = 0) -> int:
    """A seed for the training stream of one rank of one learner, from the run's seed.
    Hashed rather than added so that nearby seeds give unrelated streams."""
    digest = hashlib.sha256(f"{seed}/{learner_index}/{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # a non-negative int64


# --- choosing the source -------------------------------------------------------------------

def build_data(cfg: Config, learner_index: int, seq_len: int, *, rank: int = 0,
               cache_dir: str | os.PathLike | None = None) -> DataSource:
    """The data of learner `learner_index` (its position in cfg.learners), cut to `seq_len`.
    The built-in corpus is cached under `cache_dir`, by default <run.state_dir>/cache.

    A user factory gets the run seed at rank 0 and a per-rank seed on the other ranks of an
    island, so ranks that sample with it draw different batches."""
    num_learners = len(cfg.learners)
    if isinstance(cfg.data, str):
        seed = cfg.run.seed if rank == 0 else sampling_seed(cfg.run.seed, learner_index, rank)
        data = resolve_factory(cfg.data, "data")(
            learner_index=learner_index, num_learners=num_learners, seq_len=seq_len,
            batch_size=cfg.trainer.batch_size, seed=seed,
        )
        if not isinstance(data, DataSource):
            raise ValueError(f"data: {cfg.data!r}: returned {type(data).__name__}, which lacks "
                             f"the DataSource methods next_batch, validation_batches, state_dict, "
                             f"load_state_dict")
        return data
    if cache_dir is None:
        cache_dir = pathlib.Path(cfg.run.state_dir) / "cache"
    train, validation = load_corpus(cfg.data, cache_dir)
    return CorpusShard(train, validation, learner_index=learner_index, num_learners=num_learners,
                       seq_len=seq_len, batch_size=cfg.trainer.batch_size,
                       eval_batches=cfg.trainer.eval_batches, seed=cfg.run.seed, rank=rank)
