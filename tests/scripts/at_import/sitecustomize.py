"""Tests only: tells the moment a Python process starts importing mpddp.

With this folder on ``PYTHONPATH`` and ``MPDDP_TEST_IMPORTING`` naming a file,
``site`` loads this module at start-up, and the first ``import mpddp`` of the
process creates that file. A test then times a signal from the moment mpddp's
own code runs, not from the spawn: a signal inside the interpreter's own
start-up (``site``) is Python's business, and lands there at random under load.
"""

import os
import sys


class _MarkMpddpImport:
    def find_spec(self, name, path=None, target=None):
        if name == "mpddp":
            sys.meta_path.remove(self)
            with open(os.environ["MPDDP_TEST_IMPORTING"], "a"):
                pass
        return None  # the normal finders import it


if os.environ.get("MPDDP_TEST_IMPORTING"):
    sys.meta_path.insert(0, _MarkMpddpImport())
