"""Fakes for the unit tier: a clock that moves when told, a heartbeat that never renews, a step queue,
a recording model, in-process crashes and stalls, a whole in-memory runtime, and the contract suites
that hold the in-memory store and leases to the behaviour of the real ones."""
