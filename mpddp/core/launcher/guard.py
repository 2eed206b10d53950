"""The missing main guard, found before any worker starts.

Owns: :func:`unguarded_launch`, which reads the script's own syntax tree: a launch reached from a statement of
``__main__``'s top level that no ``if __name__ == "__main__":`` encloses cannot work under forkserver or spawn,
since every worker imports the script and would launch again. Told at once, in the launcher, with the user's
own line under the guard, instead of after the workers started (core/launcher/startup.py's ``refuse_bootstrap``
still catches what this cannot see: a guard whose test mentions ``__name__`` but lets workers in). Where this
finds it, the script's own top level is the caller, so no one can catch the error and go on: api.py says it
in one line with the guard and exits 2, as any bad input, with no traceback through mpddp.
"""

from __future__ import annotations

import ast
import os
import sys
from types import FrameType


def unguarded_launch(start_method: str) -> str | None:
    """What to tell when the script's top level reaches ``launch`` with no main guard, else None."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if start_method == "fork" or main is None or path is None or not os.path.isfile(path):
        return None  # fork re-imports nothing; a notebook, `python -c` or stdin has no script to re-import
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is main.__dict__):
        frame = frame.f_back
    if frame is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
        tree = ast.parse(source, path)
    except (OSError, SyntaxError, ValueError):
        return None  # not the file that runs (an edited script, a .pyc): the workers' own check still holds
    statement = _top_statement(tree.body, frame.f_lineno)
    if statement is None:
        return None
    line = ast.get_source_segment(source, statement) or "mpddp.launch(train, nprocs=2)"
    indented = "\n".join("        " + part for part in line.splitlines())
    return (f"{os.path.basename(path)} line {frame.f_lineno} starts workers at the script's top level, with no "
            "`if __name__ == \"__main__\":` guard: every worker imports the script and would start them again; "
            f"put it under the guard:\n\n    if __name__ == \"__main__\":\n{indented}\n")


def _top_statement(body: list[ast.stmt], line: int) -> ast.stmt | None:
    """The unguarded statement of ``body`` that holds ``line``, or None where a main guard encloses it."""
    for statement in body:
        if not statement.lineno <= line <= (statement.end_lineno or statement.lineno):
            continue
        if isinstance(statement, ast.If) and _names_main(statement.test):
            return None
        nested = [getattr(statement, name, []) for name in ("body", "orelse", "finalbody", "handlers")]
        for block in nested:
            inner = [s for s in block if isinstance(s, ast.stmt)] + [
                s for handler in block if isinstance(handler, ast.ExceptHandler) for s in handler.body]
            if any(s.lineno <= line <= (s.end_lineno or s.lineno) for s in inner):
                return _top_statement(inner, line)
        return statement
    return None


def _names_main(test: ast.expr) -> bool:
    """Whether an ``if``'s test compares ``__name__`` with ``"__main__"`` (alone or within ``and``/``or``)."""
    for node in ast.walk(test):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
            if any(isinstance(p, ast.Name) and p.id == "__name__" for p in parts) and any(
                    isinstance(p, ast.Constant) and p.value == "__main__" for p in parts):
                return True
    return False

