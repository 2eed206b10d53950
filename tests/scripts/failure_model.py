"""A torchrun-style script for the failure-model tests: ``python failure_model.py MODE``.

- sleep_outside: rank 1 sleeps in wait_for_nfs (no collective); rank 0 waits in a barrier
- own_timeout: the same, with the script's own init_process_group(timeout=30 min)
- early_exit: rank 1 calls sys.exit(0) at once; rank 0 waits in a barrier
- usr1: every rank prints READY, sleeps 4 s, meets in a barrier and exits 0
- pg_timeout: prints the process group's collective timeout and torch's default
"""

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import constants


def wait_for_nfs() -> None:
    time.sleep(3600)


def main(mode: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(minutes=30) if mode == "own_timeout" else None)
    rank = dist.get_rank()
    if mode in ("sleep_outside", "own_timeout") and rank == 1:
        wait_for_nfs()
    if mode == "early_exit" and rank == 1:
        sys.exit(0)
    if mode == "usr1":
        print("READY", flush=True)
        time.sleep(4)
    if mode == "pg_timeout":
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))
        print(f"PG_TIMEOUT {backend.options._timeout} DEFAULT {constants.default_pg_timeout}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
