"""The launcher core: from a :class:`~mpddp.config.LaunchConfig` to every rank's value.

Data flows through these modules in this order: api (options) -> startup
(forkserver) and ship (``fn`` by value) -> plan (GPUs, backend, environment)
-> job (the store for the whole job, the rounds, restarts) -> supervisor (one
attempt: start, watch, stop, report) -> worker (in each process: init,
``fn``, typed messages from protocol back up) -> relay (lines), report (the
root cause), watchdog (hangs) with collectives (each rank's flight
recorder: progress, mismatches, where each rank stands) and stragglers
(arrival lags at collectives, --timeline), rounds (other nodes: the
round's first failure, lost nodes),
procs (the process tree), rendezvous (the store), signals (the signals mpddp
uses). Never imports the trainer or the CLI.
"""
