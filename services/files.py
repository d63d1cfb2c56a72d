"""Files replaced whole: a reader, or a process started after a crash, finds the old file or the
new one, never part of one.

The new content goes to a temporary file in the target's folder (a rename is atomic only
within one file system), which is synced and renamed over the target; then the folder is
synced, as the rename itself is durable only once the folder's entry is on disk. A failed
write removes the temporary file and leaves the target as it was.

    atomic_write(path, data)                                    # bytes-like objects
    atomic_write_with(path, lambda temporary: torch.save(state, temporary))  # a writer of paths
"""
from __future__ import annotations

import os
import pathlib
import secrets
from typing import Callable


def atomic_write(path: str | os.PathLike, *parts, mode: int = 0o666,
                 temporary: pathlib.Path | None = None) -> int:
    """Replaces the file at `path` with `parts`, bytes-like objects (anything memoryview takes)
    written one after the other, without joining them into one copy. Returns the bytes written.
    `mode` and `temporary` as atomic_write_with's."""
    def write(temporary_path: pathlib.Path) -> None:
        with open(temporary_path, "wb") as file:
            for part in parts:
                file.write(memoryview(part).cast("B"))

    atomic_write_with(path, write, mode=mode, temporary=temporary)
    return sum(memoryview(part).nbytes for part in parts)


def atomic_write_with(path: str | os.PathLike, write: Callable[[pathlib.Path], object], *,
                      mode: int = 0o666, temporary: pathlib.Path | None = None) -> None:
    """Replaces the file at `path` with what `write(temporary path)` writes there (torch.save,
    safetensors' save_file: whatever writes to a path). The file is created with `mode` (the
    umask applies, as to open's) before `write` opens it, so a key is never readable by others.
    `temporary`: by default a fresh name beside `path` for every write, so processes writing
    the same file at once never share one; a caller that removes a crash's leftover by name
    gives that name."""
    path = pathlib.Path(path)
    temporary = temporary or path.with_name(f"{path.name}.{secrets.token_hex(4)}.tmp")
    os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode))
    try:
        write(temporary)
        fsync_path(temporary)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def fsync_path(path: pathlib.Path) -> None:
    """Syncs a file's data, or a folder's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
