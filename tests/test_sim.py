"""`diloco sim` end to end: real processes, the JSON report, chaos on learners and shards,
and the data-parallel baseline in the same harness."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from diloco.learner.trainer.evaluate import evaluate_weights
from diloco.services.contract.config import ConfigError, LinkConfig, load_config, parse_config
from tests.cluster_config import tiny_cluster
from tests.cluster_watch import wait_until
from tests.sim_command import run_sim, sim_command

pytestmark = pytest.mark.slow

REPORT_KEYS = {
    "mode", "learners", "shards", "wall_seconds", "tokens", "inner_steps", "outer_steps",
    "contributions", "goodput", "badput_seconds", "initial_eval_loss", "final_eval_loss",
    "bytes_up", "bytes_down", "bytes_down_exact_end", "dp_equivalent_bytes", "restarts", "state_hashes_agree",
    "anchor_offset", "links",
}


def test_sim_with_learner_and_shard_chaos_keeps_training_and_agrees(tmp_path):
    report = run_sim(tmp_path, "--learners", "3", "--shards", "2", "--steps", "300",
                     "--chaos-mtbf", "6", "--chaos-shards", "5", "--restart-delay", "1",
                     "--seed", "3", "--plot", str(tmp_path / "run.png"))
    assert REPORT_KEYS <= report.keys()
    assert report["mode"] == "diloco" and report["learners"] == 3 and report["shards"] == 2
    assert report["restarts"]["learners"] >= 1 and report["restarts"]["shards"] >= 1
    assert report["restarts"]["warm"] == report["restarts"]["learners"]  # each from its standby
    assert report["inner_steps"] == 3 * 300
    assert report["state_hashes_agree"] is True and 0 <= report["anchor_offset"] < 0.25
    assert report["final_eval_loss"] < 0.8 * report["initial_eval_loss"]
    assert_the_final_loss_is_the_exported_global_models(tmp_path, report)
    assert 0 < report["goodput"] < 1
    assert report["badput_seconds"]["down"] > 0
    assert report["badput_seconds"]["evaluation"] > 0 and report["badput_seconds"]["checkpoint"] > 0
    assert report["contributions"]["accepted"] + report["contributions"]["stale_merged"] > 0
    # Restarted shards and learners pulled snapshots; the others pulled what the rounds made.
    pulls = report["pulls"]
    assert pulls["snapshot"] > 0 and pulls["lineage_update"] + pulls["delta_encoded"] + pulls["delta_reused"] > 0
    assert 0 <= report["anchor_values_missed"] <= pulls["updates"] + pulls["snapshot"]
    assert report["dp_equivalent_bytes"] > 10 * (report["bytes_up"] + report["bytes_down"])
    assert all(link["bytes_per_second"] > 0 for link in report["links"].values())
    assert (tmp_path / "run.png").stat().st_size > 10_000


def assert_the_final_loss_is_the_exported_global_models(tmp_path, report: dict, learners_evaluate: bool = True) -> None:
    """The sim exported the global model to <run>/export: every learner ends at its versions
    (holding the bits the shards served it, which the report's state_hashes_agree checks: the
    shards' own, or one delta's encoding error from them, docs/protocol.md "The downlink"), and
    evaluated on its own (here, as `diloco evaluate` does) it has the loss the report gives."""
    export = tmp_path / "run" / "export"
    versions = {f["fragment_id"]: f["version"] for f in json.loads((export / "export.json").read_text())["fragments"]}
    state = pathlib.Path(tmp_path / "run" / "state")
    assert report["state_hashes_agree"] is True
    for learner in report["per_learner"]:
        learner_report = json.loads((state / f"learner-{learner}" / "report.json").read_text())
        assert {int(fid): f["version"] for fid, f in learner_report["fragments"].items()} == versions
    threads = torch.get_num_threads()  # the trainer sets the config's for the evaluation
    try:
        loss = evaluate_weights(load_config(tmp_path / "run" / "cluster.yaml"), export / "model.safetensors")
    finally:
        torch.set_num_threads(threads)
    assert loss == report["final_eval_loss"]
    assert (report["final_eval_loss_learners"] is not None) == learners_evaluate


def test_the_llama_family_trains_in_the_cluster_and_ends_with_the_bits_it_was_served(tmp_path):
    report = run_sim(tmp_path, "--learners", "2", "--shards", "2", "--steps", "100", "--set", "model.family=llama")
    assert report["config"]["model"] == "llama"
    assert report["state_hashes_agree"] is True
    # Taking the shards' exact bits at the end costs each learner at most one fp32 model, once.
    assert 0 <= report["bytes_down_exact_end"] <= min(report["bytes_down"], 2 * 4 * report["model_parameters"])
    assert report["final_eval_loss"] < 0.85 * report["initial_eval_loss"]
    assert_the_final_loss_is_the_exported_global_models(tmp_path, report)


def test_sim_runs_a_users_own_loop_as_each_learner_and_evaluates_its_global_model(tmp_path):
    script = pathlib.Path(__file__).resolve().parent.parent / "bench" / "plain_loop.py"
    report = run_sim(tmp_path, "--learner-script", str(script), "--learners", "2", "--shards", "2", "--steps", "80")
    assert report["config"]["learner_script"] == str(script)
    for learner_id in report["per_learner"]:
        assert "plain_loop.py --config" in (tmp_path / "run" / "logs" / f"{learner_id}.log").read_text()
    assert report["inner_steps"] == 2 * 80 and report["state_hashes_agree"] is True
    assert report["contributions"]["accepted"] + report["contributions"]["stale_merged"] > 0
    # The loop records its own model and the global model it holds (sync.record_evaluation).
    assert_the_final_loss_is_the_exported_global_models(tmp_path, report, learners_evaluate=True)
    assert report["global_vs_local"] and report["global_vs_local"][-1][0] == 80
    assert report["final_eval_loss"] < 0.85 * 5.5  # from ln(256) = 5.5 at the start


def test_sim_refuses_a_learner_script_with_dp_or_that_does_not_exist_and_leaves_the_run_folder_alone(tmp_path):
    script = pathlib.Path(__file__).resolve().parent.parent / "bench" / "plain_loop.py"
    for flags, message in ((["--learner-script", str(script), "--mode", "dp"], "--learner-script: --mode dp runs"),
                           (["--learner-script", str(tmp_path / "mine.py")], f"--learner-script: no file {tmp_path}")):
        previous_run = tmp_path / "run" / "report.json"  # what an earlier run left there
        previous_run.parent.mkdir(exist_ok=True)
        previous_run.write_text("{}")
        result = subprocess.run(sim_command(tmp_path, *flags), capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert not (tmp_path / "run" / "logs" / "shard-0.log").exists()
        assert previous_run.read_text() == "{}"


@pytest.mark.parametrize("flags, message", [
    (["--chaos-poison", "nobody:5:nan"], "--chaos-poison nobody:5:nan: no learner 'nobody' in the run"),
    (["--chaos-poison", "us-east-0:5:zap"], "--chaos-poison us-east-0:5:zap: '5:zap': expected STEP:KIND"),
    (["--chaos-poison", "us-east-0:5:nan", "--mode", "dp"], "--chaos-poison: a flag of the built-in learner"),
    (["--eval-global", "--mode", "param-avg"], "--eval-global: a flag of the built-in learner")])
def test_sim_refuses_a_learner_flag_it_cannot_apply_naming_it_and_starts_nothing(tmp_path, flags, message):
    result = subprocess.run(sim_command(tmp_path, *flags), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not (tmp_path / "run" / "logs").exists()


def test_sim_param_avg_mode_syncs_every_step_uncompressed(tmp_path):
    report = run_sim(tmp_path, "--mode", "param-avg", "--learners", "2", "--steps", "40")
    assert report["mode"] == "param-avg"
    # One fragment, one outer step per inner step (every learner in every round).
    assert report["outer_steps"] == 40
    assert report["contributions"]["accepted"] == 2 * 40
    assert report["state_hashes_agree"] is True
    # Every learner sends its fp32 model and takes the mean back at every step.
    assert report["bytes_up"] + report["bytes_down"] >= 0.9 * 2 * 2 * 40 * 4 * report["model_parameters"]


def test_sim_dp_mode_is_one_job_that_moves_an_allreduce_of_the_gradients_every_step(tmp_path):
    result = subprocess.run(sim_command(tmp_path, "--mode", "dp", "--learners", "2", "--steps", "40"),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert REPORT_KEYS <= report.keys()
    assert (report["mode"], report["learners"], report["shards"], report["outer_steps"]) == ("dp", 2, 0, 0)
    assert report["inner_steps"] == 2 * 40 and report["tokens"] == 2 * 40 * 8 * 32
    # A ring all-reduce of 2 ranks: each sends and receives its fp32 gradients once per step.
    assert report["bytes_up"] == report["bytes_down"] == 2 * 40 * 4 * report["model_parameters"]
    assert report["final_eval_loss"] < report["initial_eval_loss"]
    assert 0 < report["goodput"] < 1


def test_sim_run_token_budget_ends_a_slow_and_a_fast_learner_together(tmp_path):
    # Without a run budget each learner trains its own max_steps, and the slow one trains on
    # alone after the fast one finished. With it both stop when the run has its tokens.
    tokens_per_step = 8 * 32  # tiny_cluster: batch_size x seq_len
    budget = 600 * tokens_per_step
    report = run_sim(tmp_path, "--learners", "2", "--shards", "1", "--steps", "100000", "--slow-learner", "3",
                     "--set", "sync.max_block_seconds=0", "--set", f"trainer.max_run_tokens={budget}")
    slow, fast = report["per_learner"].values()  # --slow-learner slows the first
    assert slow["phase"] == fast["phase"] == "done"
    assert slow["steps"] < 0.6 * fast["steps"]
    assert 0.85 * budget <= report["tokens"] <= 1.1 * budget
    assert report["state_hashes_agree"] is True


def test_learners_out_of_phase_pull_one_delta_each_from_values_the_shards_keep_on_disk(tmp_path):
    """Rounds that close on a quorum of 2 while a learner is slow leave the learners on anchors
    of their own; the shards keep none of those values in memory (syncer.kept_anchors 0) but
    write them to their state folders, so no pull gets the updates since or a snapshot for want
    of one (docs/protocol.md, "The downlink"). No grace window: on a loaded machine the slow
    learner's pushes may otherwise make its rounds in time, and nobody leaves the lineage."""
    report = run_sim(tmp_path, "--learners", "3", "--shards", "1", "--steps", "150", "--seed", "1",
                     "--set", "sync.interval_steps=10", "--set", "syncer.quorum=2", "--set", "syncer.grace.mode=fixed",
                     "--set", "syncer.grace.seconds=0", "--slow-learner", "2")
    assert report["pulls"]["delta_encoded"] > 0
    assert report["anchor_spill"]["values_written"] > 0 and report["anchor_spill"]["values_read"] > 0
    assert report["anchor_values_missed"] == 0  # (updates: the last pulls of learners on the lineage)
    assert report["state_hashes_agree"] is True


def test_sim_per_region_links_are_emulated_and_reported_as_configured(tmp_path):
    # us-west's 0.5 Mbit/s is a sixteenth of us-east's downlink: its pushes and pulls must
    # keep under it, and the report and the summary state each learner's link.
    result = subprocess.run(sim_command(tmp_path, "--learners", "2", "--shards", "1", "--steps", "60",
                                        "--regions", "us-east,us-west", "--wan-mbps", "us-east=4/8,us-west=0.5",
                                        "--wan-latency-ms", "10,us-west=40"),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    links = json.loads((tmp_path / "report.json").read_text())["links"]
    east, west = links["us-east-0"], links["us-west-0"]
    assert (east["up_mbps"], east["down_mbps"], east["latency_ms"]) == (4.0, 8.0, 10.0)
    assert (west["up_mbps"], west["down_mbps"], west["latency_ms"]) == (0.5, 0.5, 40.0)
    assert 0 < west["bytes_per_second"] <= 0.5e6 / 8 * 1.2, west
    assert 0 < east["bytes_per_second"] <= 8e6 / 8 * 1.2, east
    assert re.search(r"link us-west-0 +us-west: up 0.5 / down 0.5 Mbit/s, latency 40 ms; measured", result.stdout)


def test_sim_link_flags_set_each_regions_link_and_name_the_flag_at_fault(tmp_path):
    from diloco.localcluster.sim import add_arguments, build_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = tiny_cluster(tmp_path / "unused", learners=2)  # us-east-0, us-west-0

    def config(*flags: str):
        return build_config(base, parser.parse_args(["--regions", "us-east,us-west", *flags]), tmp_path / "run")

    cfg = config("--wan-mbps", "20,us-west=5/10", "--wan-latency-ms", "us-east=30")
    assert cfg.rpc.wan_mbps == 20.0
    assert cfg.link("us-east-0", "us-east") == LinkConfig(up_mbps=20.0, down_mbps=20.0, latency_ms=30.0)
    assert cfg.link("us-west-0", "us-west") == LinkConfig(up_mbps=5.0, down_mbps=10.0)
    assert config("--wan-mbps", "7").link("us-west-0", "us-west") == LinkConfig(up_mbps=7.0, down_mbps=7.0)
    data = base.model_dump()
    data["learners"][0]["link"] = {"latency_ms": 5.0}
    base = parse_config(data)  # a learner's own link stays with its id
    assert config().link("us-east-0", "us-east") == LinkConfig(latency_ms=5.0)
    for flags, message in [
        (("--wan-mbps", "us-north=5"), "--wan-mbps 'us-north=5': no learner is in region 'us-north'"),
        (("--wan-mbps", "us-east=fast"), "--wan-mbps 'us-east=fast': 'fast' is not a number"),
        (("--wan-mbps", "5,6"), "--wan-mbps '5,6': two values for every region"),
        (("--wan-mbps", "us-east=0"), "links.us-east.up_mbps: Input should be greater than 0"),
        (("--wan-latency-ms", "-5"), "links.us-east.latency_ms: Input should be greater than or equal to 0"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            config(*flags)


def test_a_learner_whose_seeding_and_pulling_outlast_a_lease_keeps_it_with_heartbeats(tmp_path):
    # Each fragment takes about 0.9 s over a 0.2 Mbit/s link, the lease is 0.5 s: the
    # heartbeats that keep it must already run while the learner seeds and pulls at start-up.
    report = run_sim(tmp_path, "--learners", "2", "--shards", "1", "--steps", "20", "--wan-mbps", "0.2",
                     "--set", "syncer.lease_seconds=0.5", "--set", "trainer.heartbeat_seconds=0.1")
    assert report["restarts"]["learners"] == 0 and report["inner_steps"] == 2 * 20
    assert report["contributions"]["accepted"] > 0 and report["state_hashes_agree"] is True


def test_a_duration_run_ends_with_the_served_bits_however_far_apart_learners_stop_all_time_provisioned(tmp_path):
    """Three learners and two shards on two cores, one learner's step twenty times its
    compute, shards killed every 5 s on average, the run cut by --duration: the slow learner
    delivers and leaves long after the others would have taken their last pull. Agreement at
    the end must not depend on who stops when (it failed both seeds before the sim let the
    learners finish and the shards settle before their last pull; one seed keeps the suite short)."""
    report = run_sim(tmp_path, "--learners", "3", "--shards", "2", "--steps", "100000",
                     "--duration", "15", "--slow-learner", "20", "--chaos-shards", "5", "--restart-delay", "1",
                     "--seed", "1")
    assert report["state_hashes_agree"] is True, report["restarts"]
    # When --duration is up the learners still train until they are told to stop (after the
    # last rounds' grace), then wait for their syncs in flight: those steps are goodput and
    # those waits badput, so that time is provisioned too.
    provisioned = report["provisioned_seconds"]
    assert provisioned > 3 * 15
    measured = {key: seconds for key, seconds in report["badput_seconds"].items() if key != "other"}
    # Start-up counts from the process's start time, which /proc gives in 10 ms clock ticks.
    assert report["goodput"] * provisioned + sum(measured.values()) <= provisioned + 3 * 0.01


@contextlib.contextmanager
def running_sim(tmp_path):
    """A sim of one shard and two learners that would train for a long time; yields it and
    the pids of its three processes once they all run. Whatever is left of them is
    SIGKILLed at the end, not to leave them running after a failure."""
    run_dir = str(tmp_path / "run")
    sim = subprocess.Popen(sim_command(tmp_path, "--learners", "2", "--shards", "1", "--steps", "100000"),
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    children: set[int] = set()
    try:
        children = wait_until(lambda: len(found := of_the_run(descendants(sim.pid), run_dir)) == 3 and found,
                              120, "the sim to start a shard and two learners")
        yield sim, children
    finally:
        sim.kill()
        sim.wait()
        for pid in of_the_run(children, run_dir) | of_the_run(all_pids(), run_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_ctrl_c_ends_the_sim_early_with_its_summary_and_report_and_stops_every_process(tmp_path):
    with running_sim(tmp_path) as (sim, children):
        wait_until(lambda: list((tmp_path / "run").glob("state/learner-*/report.json")), 120,
                   "a learner to write its first report")
        sim.send_signal(signal.SIGINT)
        out, _ = sim.communicate(timeout=120)
        assert sim.returncode == 128 + signal.SIGINT
        assert not of_the_run(children, str(tmp_path / "run"))
        assert "interrupted by SIGINT" in out and "state hashes agree" in out, out
        report = json.loads((tmp_path / "report.json").read_text())
        assert report["interrupted"] == "SIGINT" and report["inner_steps"] > 0


def test_a_second_sigterm_during_the_sims_cleanup_still_stops_every_process(tmp_path):
    """The first SIGTERM starts the cleanup, which waits for the learners to stop; one of
    them hangs (SIGSTOP). The second SIGTERM, once the cleanup is under way, must not cut it
    short and leave the shard and that learner running."""
    with running_sim(tmp_path) as (sim, children):
        wait_until(lambda: len(list((tmp_path / "run").glob("state/learner-*/report.json"))) == 2, 120,
                   "both learners to train (their SIGTERM handlers are in place)")
        hung = next(pid for pid in children if " learner " in read_cmdline(pathlib.Path(f"/proc/{pid}/cmdline")))
        os.kill(hung, signal.SIGSTOP)
        sim.send_signal(signal.SIGTERM)
        # The cleanup is under way: the sim told the learners to finish, and the one not hung did.
        wait_until(lambda: any(json.loads(path.read_text()).get("phase") == "catching_up"
                               for path in (tmp_path / "run").glob("state/learner-*/report.json")), 60,
                   "the learner that is not hung to finish (the sim's cleanup to start)")
        sim.send_signal(signal.SIGTERM)
        assert sim.wait(timeout=60) == 128 + signal.SIGTERM
        wait_until(lambda: not of_the_run(children, str(tmp_path / "run")), 10, "the sim's processes to end")


def test_a_sigkilled_sim_takes_its_processes_with_it(tmp_path):
    with running_sim(tmp_path) as (sim, children):
        sim.kill()
        sim.wait()
        wait_until(lambda: not of_the_run(children, str(tmp_path / "run")), 10, "the sim's processes to end")


def test_sim_stops_a_learner_that_fails_at_start_up_twice_the_same_way_and_prints_its_error(tmp_path):
    """The model factory resolves but returns no module: every learner fails before it
    trains. The sim used to restart them forever, the error only in their logs."""
    result = subprocess.run(sim_command(tmp_path, "--learners", "2", "--shards", "1", "--restart-delay", "0.5",
                                        "--set", "model=tests.user_plugins:make_not_a_module",
                                        "--set", "syncer.max_tokens_per_step=256"),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "failed at start-up twice with the same error" in result.stderr
    assert "model: 'tests.user_plugins:make_not_a_module': returned str, not a torch.nn.Module" in result.stderr
    assert not of_the_run(all_pids(), str(tmp_path / "run"))


def test_sim_stops_at_once_with_the_error_of_a_shard_that_cannot_start(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")  # the run's state folder is a file: no shard can keep its state there
    started = time.monotonic()
    result = subprocess.run(sim_command(tmp_path, "--set", "tls.mode=plaintext", "--set", f"run.state_dir={blocker}"),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "shard-0 exited with status 1 before serving" in result.stderr
    assert str(blocker) in result.stderr and "Traceback" not in result.stderr
    assert time.monotonic() - started < 30  # not the 60 s wait for a shard that serves


def test_sim_refuses_a_factory_that_does_not_resolve_before_it_starts_anything(tmp_path):
    result = subprocess.run(sim_command(tmp_path, "--set", "model=tests.user_plugins:make_modle",
                                        "--set", "syncer.max_tokens_per_step=256"),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "model: 'tests.user_plugins:make_modle': module 'tests.user_plugins' has no attribute" in result.stderr
    assert not (tmp_path / "run" / "logs" / "shard-0.log").exists()


def all_pids() -> set[int]:
    return {int(path.name) for path in pathlib.Path("/proc").glob("[0-9]*")}


def descendants(pid: int) -> set[int]:
    """The processes below `pid` in the process tree, from /proc/<pid>/stat's parent pids."""
    children: dict[int, list[int]] = {}
    for path in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(path.read_text().rsplit(")", 1)[1].split()[1])  # pid (comm) state ppid ...
        except (OSError, IndexError, ValueError):  # the process ended meanwhile
            continue
        children.setdefault(parent, []).append(int(path.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def of_the_run(pids: set[int], run_dir: str) -> set[int]:
    """Those of `pids` still running a shard or learner of the run: each has the run directory
    in its command line (a process that ended, zombie or reaped, has none)."""
    return {pid for pid in pids if run_dir in read_cmdline(pathlib.Path(f"/proc/{pid}/cmdline"))}


def read_cmdline(path: pathlib.Path) -> str:
    try:
        return path.read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:  # the process ended meanwhile
        return ""


def test_sim_overrides_config_keys_and_slows_the_first_learner(tmp_path):
    from diloco.localcluster.sim import add_arguments, build_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = tiny_cluster(tmp_path / "unused", learners=3)
    args = parser.parse_args(["--set", "sync.interval_steps=100", "--set", "sync.codec=bf16",
                              "--set", "trainer.inner_optimizer.lr=1e-4", "--slow-learner", "2"])
    cfg = build_config(base, args, tmp_path / "run")
    assert (cfg.sync.interval_steps, cfg.sync.codec, cfg.trainer.inner_optimizer.lr) == (100, "bf16", 1e-4)
    assert [learner.slowdown for learner in cfg.learners] == [2.0, 1.0, 1.0]
    with pytest.raises(ConfigError, match="sync.bogus: unknown key"):
        build_config(base, parser.parse_args(["--set", "sync.bogus=1"]), tmp_path / "run")
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        build_config(base, parser.parse_args(["--set", "sync.codec"]), tmp_path / "run")


def test_sim_keeps_the_configs_seed_unless_told_another(tmp_path):
    from diloco.localcluster.sim import add_arguments, build_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = tiny_cluster(tmp_path / "unused", learners=2)  # run.seed 7
    for flags, seed in (([], 7), (["--seed", "3"], 3), (["--set", "run.seed=5"], 5)):
        args = parser.parse_args(flags)
        assert build_config(base, args, tmp_path / "run").run.seed == args.seed == seed  # the chaos schedule's too


@pytest.mark.parametrize("flags, warm", [([], True), (["--no-warm-restarts"], False)])
def test_sim_restarts_every_learner_process_from_a_standby_unless_told_not_to(tmp_path, flags, warm):
    from diloco.localcluster.cluster import LocalCluster
    from diloco.localcluster.sim import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(flags)
    cfg = tiny_cluster(tmp_path / "state", learners=2, island={"replica_groups": 2})
    cluster = LocalCluster(cfg, tmp_path / "run", warm_restarts=args.warm_restarts)
    assert len(cluster.learner_processes) == 4  # an island's replica groups restart as its group 0 does
    assert all(proc.warm_restarts is warm for proc in cluster.learner_processes)


def test_chaos_counts_a_process_still_down_at_the_end_as_down_until_then():
    from diloco.localcluster.chaos import Chaos

    chaos = Chaos("learner", 2, mtbf=10.0, restart_delay=5.0, rng=random.Random(0), now=0.0)
    chaos.killed(0, now=1.0)
    chaos.killed(1, now=2.0)
    chaos.restarted(chaos.down[1], now=7.0)
    chaos.end(now=5.0)
    assert chaos.down_seconds == [4.0, 5.0] and not chaos.down


def test_poisoned_learners_are_refused_named_and_heal_while_the_run_trains_on(tmp_path):
    """One learner scaled x1000, one gone NaN, one with flipped exponent bits, one healthy: the
    shards merge none of the bad pushes and name the learner they refused, each sick learner
    heals once and finishes its budget, and the global model trains as in a healthy run."""
    report = run_sim(tmp_path, "--learners", "4", "--shards", "2", "--steps", "160", "--seed", "1",
                     "--chaos-poison", "us-east-0:40:scale", "--chaos-poison", "us-west-0:40:nan",
                     "--chaos-poison", "us-central-0:40:bitflip")
    sick = report["sick_learners"]
    assert sick["us-east-0"]["outliers_refused"] >= 2 and sick["us-east-0"]["heals"] == 1
    assert sick["us-west-0"]["heals"] == 1 and sick["us-west-0"]["outliers_refused"] == 0  # NaN is never pushed
    assert sick["us-central-0"]["heals"] == 1
    assert set(sick) == {"us-east-0", "us-west-0", "us-central-0"}  # the fourth learner is healthy
    assert all(learner["phase"] == "done" for learner in report["per_learner"].values())
    assert report["inner_steps"] == 4 * 160
    assert report["final_eval_loss"] < 0.8 * report["initial_eval_loss"]
    assert report["state_hashes_agree"] is True
