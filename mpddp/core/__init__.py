"""The launcher core: from a :class:`~mpddp.config.LaunchConfig` to every rank's value.

Four folders, by where the code runs:

- ``launcher/``: in the launcher process (one per node): the front door,
  the rounds and restarts, watching the ranks, classifying and reporting a
  failure, relaying output, tearing process trees down;
- ``rank/``: in the processes it starts: each rank (and the forkserver that
  forks them);
- ``wire/``: what crosses between the two: typed messages and store keys,
  ``fn`` by value, the signals, the ``@record`` error files, stacks on demand;
- ``nodes/``: node 0's store (every launch has one) and what several nodes
  add: rounds every node joins, lost nodes, ``--hosts`` over ssh.

Every module, one line each, in reading order: docs/codemap.rst (a test
keeps it equal to the tree). Never imports the trainer or the CLI.
"""
