"""The config of a loopback benchmark with one learner: an example's cluster YAML cut down to
its first learner and one shard on a free port (bench/overlap.py, bench/hf_overlap.py,
bench/user_loop.py)."""
from __future__ import annotations

import pathlib

from diloco.localcluster.processes import free_ports
from diloco.services.contract.config import Config, load_config, parse_config


def one_learner_config(example: pathlib.Path, state_dir: pathlib.Path, steps: int, shards: int = 1,
                       **sections: dict) -> Config:
    """`example` with its first learner only (no metrics server), `shards` shards on free ports,
    its state in `state_dir` and a budget of `steps`; `sections` update keys of the config's
    sections, e.g. `rpc={"wan_mbps": 5}`. One learner means K = 1: every round closes as soon
    as its contribution arrives."""
    data = load_config(example).model_dump(mode="json")
    data["learners"] = [{**data["learners"][0], "metrics_port": 0}]
    data["shards"] = [{"address": f"127.0.0.1:{port}", "metrics_port": 0} for port in free_ports(shards)]
    data["run"]["state_dir"] = str(state_dir)
    data["syncer"]["quorum"] = 1
    data["trainer"]["max_steps"] = steps
    for name, values in sections.items():
        data[name] = {**data[name], **values}
    return parse_config(data, source=f"{example.name} with one learner")
