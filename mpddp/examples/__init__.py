"""Tasks written as a user writes one, shipped so that an installed mpddp can run them.

Each module is a complete ``--task`` for ``mpddp train`` (``mpddp.examples.moons:make_task``),
built on the public API only (:class:`mpddp.Task`); copy one as the start of your own.
The one map of the code is docs/codemap.rst.
"""
