"""The version, in a module of its own: every layer may read it without importing the package front door."""

__version__ = "0.1.0"
