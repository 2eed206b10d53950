"""The command line: thin click commands over the Python API, on top of everything.

The ``mpddp`` group and its entry point are cli/main.py; the map of every module:
docs/codemap.rst. Nothing in mpddp imports this package but ``__main__``.
"""

from .main import main, run_cli
from .options import build_config, launch_options

__all__ = ["build_config", "launch_options", "main", "run_cli"]
