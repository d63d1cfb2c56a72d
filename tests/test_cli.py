"""The `diloco` command line: one spelling per idea. --version, --log-level before or after the
command, every option's default in --help, and a learner's region taken from the config."""
from __future__ import annotations

import importlib.metadata
import logging

import pytest

from diloco import cli


def test_version_names_the_installed_package(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"diloco {importlib.metadata.version('decoupled-diloco')}"


@pytest.mark.parametrize("argv", [["--log-level", "WARNING", "config", "check"],
                                  ["config", "check", "--log-level", "WARNING"]])
def test_the_log_level_is_taken_before_or_after_the_command(argv, monkeypatch, tmp_path):
    levels = []
    monkeypatch.setattr(logging, "basicConfig", lambda level, **_: levels.append(level))
    (tmp_path / "c.yaml").write_text("learners: [{id: a, region: r}]\nshards: [{address: '127.0.0.1:1'}]\n")
    cli.main(argv + [str(tmp_path / "c.yaml")])
    assert levels == ["WARNING"]


def test_help_gives_each_options_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["sim", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--restart-delay RESTART_DELAY seconds a killed process stays down (default: 5.0)" in text
    assert "(default: INFO)" in text
