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
    cli.main(argv + ["--config", str(tmp_path / "c.yaml")])
    assert levels == ["WARNING"]


def test_help_gives_each_options_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["sim", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--restart-delay-seconds SECONDS, --restart-delay SECONDS seconds a killed process stays down (default: 5.0)" in text
    assert "(default: INFO)" in text


def test_config_check_takes_the_file_as_every_command_does_or_as_before(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("learners: [{id: a, region: r}]\nshards: [{address: '127.0.0.1:1'}]\n")
    assert cli.main(["config", "check", "--config", str(config)]) == 0
    assert cli.main(["config", "check", str(config)]) == 0
    assert cli.main(["config", "check"]) == 2
    assert "give the cluster YAML file once (--config C)" in capsys.readouterr().err


def test_seconds_flags_name_their_unit_and_keep_their_short_spelling():
    long = cli.parse_args(["sim", "--chaos-mtbf-seconds", "40", "--restart-delay-seconds", "3", "--duration-seconds", "9"])
    short = cli.parse_args(["sim", "--chaos-mtbf", "40", "--restart-delay", "3", "--duration", "9"])
    assert (long.chaos_mtbf, long.restart_delay, long.duration) == (short.chaos_mtbf, short.restart_delay,
                                                                    short.duration) == (40, 3, 9)
