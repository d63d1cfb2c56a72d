"""The wire contract learners and shards share: what crosses the wire and how it is checked."""
