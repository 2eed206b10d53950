"""The launcher core: from a :class:`~mpddp.config.LaunchConfig` to every rank's value.

Data flows through these modules in this order: api (options) -> startup
(forkserver) and ship (``fn`` by value) -> plan (GPUs, backend, environment)
-> job (the store for the whole job, the rounds, restarts) -> supervisor (one
attempt: start, watch, stop, report) -> worker (in each process: init,
``fn``, typed messages from protocol back up) -> relay (lines), report (the
root cause), rounds (other nodes: the round's first failure, lost nodes),
procs (the process tree), rendezvous (the store), signals (the signals mpddp
uses). Never imports the trainer or the CLI.
"""
