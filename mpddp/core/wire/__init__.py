"""What crosses between the launcher and its processes: typed messages, ``fn`` by value, signals, files, stacks.

Both sides import these; these import nothing else of mpddp's core.
The map of every module: docs/codemap.rst.
"""
