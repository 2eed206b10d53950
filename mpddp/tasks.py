"""``mpddp.tasks``: the names a user's task file imports (``from mpddp.tasks import Task``).

A re-export of :mod:`mpddp.trainer.tasks`, where the Task contract and the
built-in tasks live; kept so that task files written for mpddp keep working.
"""

from .trainer.tasks import Task, TaskFactory, digits_task, synthetic_task

__all__ = ["Task", "TaskFactory", "digits_task", "synthetic_task"]
