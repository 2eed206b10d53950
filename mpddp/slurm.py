"""``mpddp.slurm``: a re-export of :mod:`mpddp.machine.slurm` (``apply_slurm`` and friends)."""

from .machine.slurm import SlurmLayout, apply_slurm, read_layout

__all__ = ["SlurmLayout", "apply_slurm", "read_layout"]
