"""What the nodes of a job agree on, behind one interface (api.py), on the stores of core/stores/.

The map of every module: docs/codemap.rst.
"""
