"""Sphinx configuration of mpddp's manual.

Build it with ``python -m sphinx -W --keep-going -b html docs docs/_build/html``
(``pip install -e '.[docs]'`` first). The API reference comes from the
docstrings (autodoc), the command-line reference from the click group itself
(sphinx-click), so neither can drift from the code. The pictures in
``_static/`` are made by ``scripts/make_pictures.py``; the build draws
nothing and runs no training.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's mpddp, whatever is installed

import mpddp  # noqa: E402
from mpddp.config import LaunchConfig  # noqa: E402

project = "mpddp"
author = "The mpddp developers"
copyright = f"2026 {author}"  # the footer: "© 2026 The mpddp developers."; LICENSE says the same
release = version = mpddp.__version__
extensions = ["sphinx.ext.autodoc", "sphinx_click"]
exclude_patterns = ["_build"]
html_static_path = ["_static"]
html_theme = "alabaster"
html_theme_options = {"page_width": "1100px", "sidebar_width": "240px"}
smartquotes = False  # ``--hosts`` in an option's help stays two dashes
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_class_signature = "separated"


def _field_doc(field: dataclasses.Field[Any]) -> list[str]:
    """A LaunchConfig field's entry: its help, from the same metadata the CLI's options are made of."""
    cli = field.metadata.get("cli")
    if cli is None:
        return [field.metadata["doc"]]
    flags = ["--" + field.name.replace("_", "-"), *cli["decls"]]
    return [cli["help"], "", "Command line: " + ", ".join(f"``{flag}``" for flag in flags) + "."]


def _field_entry(field: dataclasses.Field[Any]) -> list[str]:
    default = "()" if field.default_factory is not dataclasses.MISSING else repr(field.default)
    body = [f"   {line}" if line else "" for line in _field_doc(field)]
    return [f".. py:attribute:: {field.name}", f"   :type: {field.type}", f"   :value: {default}", "", *body, ""]


def _launch_config_fields(app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    """Every field of LaunchConfig, in field order, under the class (dataclass fields carry no docstring)."""
    if what == "class" and obj is LaunchConfig:
        lines += ["", "Its fields, each also a keyword of :func:`mpddp.launch`:", ""]
        for field in dataclasses.fields(LaunchConfig):
            lines += _field_entry(field)


def setup(app: Any) -> None:
    app.connect("autodoc-process-docstring", _launch_config_fields)
