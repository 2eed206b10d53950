"""What the nodes of a job agree on, behind one interface (api.py), and node 0's store every launch has.

The map of every module: docs/codemap.rst.
"""
