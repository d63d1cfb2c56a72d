"""Files replaced whole (services/files.py): the new content or the old, and no temporary file
left behind either way."""
import os
import stat

import pytest

from diloco.services.files import atomic_write, atomic_write_with


def test_the_parts_replace_the_file_one_after_the_other(tmp_path):
    path = tmp_path / "state"
    path.write_bytes(b"old")
    assert atomic_write(path, b"new ", memoryview(b"content")) == len(b"new content")
    assert path.read_bytes() == b"new content"
    assert os.listdir(tmp_path) == ["state"]


def test_a_failed_write_keeps_the_old_content_and_removes_the_temporary_file(tmp_path):
    path = tmp_path / "checkpoint"
    path.write_bytes(b"old")

    def half_then_fail(temporary):
        temporary.write_bytes(b"half of the new")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write_with(path, half_then_fail)
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["checkpoint"]
    with pytest.raises(OSError, match="disk full"):  # a temporary file the caller names, too
        atomic_write_with(path, half_then_fail, temporary=tmp_path / "checkpoint.tmp")
    assert os.listdir(tmp_path) == ["checkpoint"]


def test_a_writer_of_paths_writes_through_a_temporary_file_beside_the_target(tmp_path):
    seen = []

    def write(temporary):
        seen.append(temporary)
        temporary.write_text("{}")

    atomic_write_with(tmp_path / "report.json", write)
    assert (tmp_path / "report.json").read_text() == "{}"
    assert seen[0].parent == tmp_path and seen[0].name != "report.json" and not seen[0].exists()


def test_the_file_is_created_with_the_mode_before_anything_is_written_to_it(tmp_path):
    modes = []
    atomic_write_with(tmp_path / "key", lambda temporary: modes.append(stat.S_IMODE(temporary.stat().st_mode)),
                      mode=0o600)
    assert modes == [0o600] and stat.S_IMODE((tmp_path / "key").stat().st_mode) == 0o600
