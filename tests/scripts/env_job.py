"""A torchrun-style script for `mpddp run` across nodes (tests/test_rounds.py).

``init_process_group("gloo")`` from the environment, a few all_reduces, and global rank ``FAIL`` (argv[1])
SIGKILLs itself on the first attempt (``TORCHELASTIC_RESTART_COUNT`` 0). Prints ``DONE rank R sum S restart N``.
"""

import os
import signal
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, restart = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
for step in range(5):
    t = torch.ones(1)
    dist.all_reduce(t)
    if rank == int(sys.argv[1]) and restart == 0 and step == 2:
        os.kill(os.getpid(), signal.SIGKILL)
print(f"DONE rank {rank} sum {t.item():g} restart {restart}", flush=True)
dist.destroy_process_group()
