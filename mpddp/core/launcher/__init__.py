"""What runs in the launcher process, one per node: from ``launch()`` to every rank's value or the report.

Start at api.py (``launch``, ``spawn``); job.py runs the rounds and restarts,
attempt.py one round of this node's ranks (start, watch, stop, report).
The map of every module: docs/codemap.rst.
"""
