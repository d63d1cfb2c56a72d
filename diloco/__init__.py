"""Decoupled DiLoCo as a cluster of gRPC services: the one import name of this project.

    diloco.services   what the shard and the learner share (wire contract, codecs, config, CLI)
    diloco.learner    one learner island (model, data, inner loop, streaming sync)
    diloco.syncer     one syncer shard (decisions, durability, gRPC servicer)

In the repository these live in services/, learner/ and syncer/ at the top level, mapped under
`diloco` by pyproject.toml's package-dir; nothing else is installed at top level.
"""
