"""One syncer shard: merges the learners' outer gradients of the fragments it owns and applies
the outer optimizer (docs/protocol.md: Rounds, Leases). Start it with `diloco syncer --config C
--shard-index I`.

    core.py            ShardCore: every decision, no I/O, injectable clock: the service, tests
                       and a simulator share it
      owned.py         the fragment plan the first join fixes, the fragments this shard owns
      intake.py        receiving and checking a push: header, chunks, finite values, norm bound
      admission.py     a checked push admitted: seed, restore, contribution into the open round
      closing.py       rounds closed when due, snapshots written when due
      replay.py        a restart: the last snapshots, then the log replayed
      views.py         what Join and Status report
      membership.py    learners, incarnations, leases
      claims.py        bounds on what a learner may claim (steps, tokens, step times, rates)
      fragment_state.py  one fragment: its committed state's checks and transitions
      snapshot.py      the committed state's records (value, momentum, residual, version,
                       encoded history)
      open_round.py    the open round: contributions kept encoded, when it closes
      pull.py          what a pull gets: updates, or the value whole
      merge.py         contribution weights, RDA / weighted mean as running sums
      outer.py         Nesterov outer step
      grace.py         fixed or adaptive grace window
      counters.py      every decision counted; refusal.py: Refusal(reason, status, message)
    journal.py         what the core asks of durability (Journal), its records, NullJournal
    disk.py            a full or failing disk: refusals, logged once per change
    store.py           durability: contribution log + atomic snapshots, restored on restart
      store_format.py  the state's files on disk: layout, framing, encodings, reading them back
    guard.py           who may call, and the limits on a call
    service.py         the gRPC servicer, the round-closing ticker, start_shard()
    metrics.py         the Prometheus exporter; memory.py: the process's freed memory
    main.py            the `diloco syncer` command
"""
