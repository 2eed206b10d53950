"""Node 0's store (every launch has one) and what several nodes add: rounds, lost nodes, ``--hosts`` over ssh.

The map of every module: docs/codemap.rst.
"""
