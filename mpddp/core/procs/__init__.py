"""Processes as the OS sees them: starting one from the forkserver, and stopping a whole tree.

Used by every other layer of the core; imports nothing of it. The map of every module: docs/codemap.rst.
"""
