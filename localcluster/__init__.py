"""The local-cluster harness (installed as diloco.localcluster): `LocalCluster` starts real syncer
shard and learner processes on loopback exactly as a user would (cluster.py), and `diloco sim`
runs a whole multi-region cluster with chaos, a JSON report and a plot (sim.py; the run in
sim_run.py and sim_observer.py, the report in sim_summary.py). The integration tests and the
benchmarks use it too; neither service imports it at run time, which is why it lives outside
services/ (what the shard and the learner share)."""
