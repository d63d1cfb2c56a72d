"""One syncer shard: merges the learners' outer gradients of the fragments it owns and applies
the outer optimizer (docs/protocol.md: Rounds, Leases). Start it with `diloco syncer --config C
--shard-index I`.

    core.py            every decision, no I/O, injectable clock: the service, tests and a
                       simulator share it
      membership.py    learners, incarnations, leases
      claims.py        bounds on what a learner may claim (steps, tokens, step times, rates)
      disk.py          a full or failing disk: refusals, logged once per change
      fragment_state.py  one fragment: committed state (value, momentum, residual, version,
                       encoded history) and the open round
      merge.py         contribution weights, RDA / weighted mean as running sums
      outer.py         Nesterov outer step
      grace.py         fixed or adaptive grace window
      counters.py      every decision counted; refusal.py: Refusal(reason, status, message)
    store.py           durability: contribution log + atomic snapshots, restored on restart
    service.py         the gRPC servicer, the round-closing ticker, start_shard()
    main.py            the `diloco syncer` command
"""
