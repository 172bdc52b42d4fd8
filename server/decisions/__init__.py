"""The daemon's decisions, as pure functions and one state machine: they take the current state and the time
and return decisions; no I/O, no locks, no clock. The controller (server/controller.py) is the shell around
them: it holds the lock, writes the history, counts the metrics, queues the assignments and speaks the wire.

- ``receivers``: what the daemon knows of a receiver's model, its states and every move (one state machine);
- ``claims``: what a registration may claim about membership (trainer ranks, engines, drivers);
- ``quorum``: who takes a version, and what follows from it (owners, transports, pullers, sparse base);
- ``assignments``: what each receiver of a version is assigned (pushed, colocated, pulling);
- ``commit``: the commit rule, from the receivers' own reports;
- ``repair``: catch-up and repair (who, which version) and what the cache keeps for them;
- ``policy``: plain versions and a framework's (verl's) syncs, one lifecycle with two policies.
"""
