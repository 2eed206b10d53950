"""The launcher core: from a :class:`~mpddp.config.LaunchConfig` to every rank's value.

Six folders, a stack: each imports only the folders below it (a test keeps it so).

- ``launcher/``: the launcher process (one per node): the front door, the
  job and its attempts, watching the ranks, classifying and reporting a
  failure, relaying output, and a ``--hosts`` node's entry point;
- ``nodes/``: what the nodes of a job agree on: rounds every node joins,
  the first failure, lost nodes, a job's identity, over either backend;
- ``stores/``: what they talk through: node 0's store (its socket, its
  server process, a client, the beat's counters on it), which a single-node
  job uses too, and etcd's client;
- ``rank/``: what runs in the processes the launcher starts: each rank (its
  fn, a torchrun-style script or mp.spawn's ``fn(i)``) and the forkserver;
- ``wire/`` and ``procs/``, at the bottom: what crosses between processes
  (typed messages and store keys, ``fn`` by value, the signals, the
  ``@record`` error files, stacks on demand, the store's client), and
  processes as the OS sees them (starting one, stopping a tree).

Every module, one line each, in reading order: docs/codemap.rst (a test
keeps it equal to the tree). Never imports the trainer or the CLI.
"""
