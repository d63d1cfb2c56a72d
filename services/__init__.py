"""What learners and syncer shards share:

    contract/   the wire contract both sides speak: generated stubs (wire/), codecs, payload
                chunking, fragment plans, state hashes, config, the sync settings a shard sends,
                RPC plumbing, mutual TLS
    client.py   the shard client every caller of a shard uses
    export.py   the run's global model, fetched from the shards and written as safetensors
    metrics.py  what both roles' Prometheus metrics share (each role's own: beside it)
    files.py    files replaced whole (atomic_write): checkpoints, snapshots, reports, exports
    cli/        the `diloco` command and the operator's subcommands (status, export, certs, config)

Nothing here imports `learner`, `syncer`, `localcluster` or `planner`; learner and syncer meet
only at the contract.
"""
