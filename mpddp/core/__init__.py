"""The launcher core: from a :class:`~mpddp.config.LaunchConfig` to every rank's value.

Data flows through these modules in this order: api (options, restarts) ->
startup (forkserver) and ship (``fn`` by value) -> plan (GPUs, backend,
environment) -> supervisor (start, watch, stop) -> worker (in each process:
init, ``fn``, typed messages from protocol back up) -> relay (lines),
report (the root cause), heartbeat (other nodes), procs (the process tree),
rendezvous (the store). Never imports the trainer or the CLI.
"""
