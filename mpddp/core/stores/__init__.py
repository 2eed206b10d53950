"""The stores the nodes of a job talk through: node 0's TCPStore (its socket, its server process, a client to it,
the beat's counters on it), which a single-node job uses too, and etcd's gateway (a client, a probe of the
members). What a round means is core/nodes/'s.

The map of every module: docs/codemap.rst.
"""
