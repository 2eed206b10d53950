"""What runs in the processes the launcher starts: each rank, and the forkserver that forks them.

boot.py is where every such process begins (before torch), worker.py takes a
rank from there to ``fn(ctx)`` and back, outcome.py makes what it sends back.
The map of every module: docs/codemap.rst.
"""
