"""A real Prometheus server for tests: Debian's `prometheus` (scripts/install-debian-packages.sh,
run by `make test`), started on a free port with the project's own local scrape config and
recording rules, scraping and evaluating every second, queried through its HTTP API."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
import yaml

from diloco.localcluster.processes import free_ports

ROOT = pathlib.Path(__file__).resolve().parent.parent
LOCAL_CONFIG = ROOT / "deploy" / "prometheus" / "local" / "prometheus.yml"
INSTALL = "scripts/install-debian-packages.sh"


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not on PATH: run {INSTALL} (Debian's prometheus package has "
                    "prometheus and promtool)", pytrace=False)
    return path


def local_config(targets: pathlib.Path) -> dict:
    """deploy/prometheus/local/prometheus.yml as shipped, but scraping and evaluating every
    second and reading its file_sd targets from `targets`."""
    config = yaml.safe_load(LOCAL_CONFIG.read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [os.path.normpath(LOCAL_CONFIG.parent / pattern) for pattern in config["rule_files"]]
    (job,) = config["scrape_configs"]
    (discovery,) = job["file_sd_configs"]
    discovery.update(files=[str(targets)], refresh_interval="1s")
    return config


class PrometheusApi:
    """The HTTP API of a Prometheus server at `url` (http://host:port)."""

    def __init__(self, url: str):
        self.url = url

    def api(self, path: str, **params) -> object:
        """The `data` of an HTTP API answer; a refused query fails the test with Prometheus' error."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params, doseq=True)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                body = json.loads(reply.read())
        except urllib.error.HTTPError as error:
            body = json.loads(error.read())
        if body["status"] != "success":
            pytest.fail(f"Prometheus refused {path} {params}: {body.get('error')}", pytrace=False)
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """The instant vector `expr` evaluates to now."""
        return self.api("query", query=expr)["result"]

    def value(self, expr: str) -> float | None:
        """The single value of `expr`, None while it has no data."""
        result = self.query(expr)
        assert len(result) <= 1, f"{expr} has {len(result)} series"
        return float(result[0]["value"][1]) if result else None


class Prometheus(PrometheusApi):
    """`with Prometheus(config, folder) as prometheus: prometheus.query("up")`"""

    def __init__(self, config: dict, folder: pathlib.Path):
        folder.mkdir(parents=True, exist_ok=True)
        config_path = folder / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        super().__init__(f"http://127.0.0.1:{free_ports(1)[0]}")
        self.log_path = folder / "prometheus.log"
        self.argv = [binary("prometheus"), f"--config.file={config_path}",
                     f"--storage.tsdb.path={folder / 'data'}",
                     f"--web.listen-address={self.url.removeprefix('http://')}"]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Prometheus":
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)
        self.wait_for(self._ready, 30, "Prometheus never became ready")
        return self

    def __exit__(self, *exc) -> None:
        self.proc.kill()
        self.proc.wait()

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False

    def wait_for(self, condition, timeout: float, message: str):
        """Polls `condition()` until it returns something truthy, which it returns."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"Prometheus exited:\n{self.log_path.read_text()[-3000:]}", pytrace=False)
            result = condition()
            if result:
                return result
            if time.monotonic() > deadline:
                pytest.fail(f"{message} after {timeout:.0f}s", pytrace=False)
            time.sleep(0.5)
