"""What learners and syncer shards share: the wire stubs, codecs, fragment plans,
configuration, RPC plumbing, metrics and the `diloco` command line.

Nothing here imports `learner` or `syncer`; they meet only at the wire contract. The
local-cluster harness (LocalCluster, `diloco sim`) is not shared run time: it is localcluster/.
"""
