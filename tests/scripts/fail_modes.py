"""A torchrun-style script that fails on purpose, for the reliability tests.

``python fail_modes.py MODE`` under ``mpddp run --nprocs 2``; rank 1 misbehaves:

- raise: raises ValueError; rank 0 waits in an all_reduce (a victim)
- exit: rank 1 calls sys.exit(3)
- kill: rank 1 SIGKILLs itself (as the OOM killer would)
- hang: rank 1 sleeps forever; rank 0 waits in an all_reduce until the timeout
- block: every rank prints READY and sleeps forever (for signals to the launcher)
- loader: like block, inside a DataLoader loop with num_workers=2; rank 1 may
  SIGKILL itself once its loader workers are up (``loader kill``)
- stubborn: every rank ignores SIGTERM and starts two ``sleep`` children, one
  in a session of its own, then blocks; ``stubborn raise`` / ``stubborn kill``:
  rank 1 then raises / SIGKILLs itself once the test says go

Every rank prints its pid and MASTER_PORT first, so the test can find them.
With ``FAIL_GO=<path>`` set, rank 1 waits for that file before it fails (the
test lists the process tree first) and prints ``FAIL_AT <monotonic time>``.
"""

import os
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as dist


class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        time.sleep(0.05)
        return torch.tensor([float(i)])


def go() -> None:
    """Wait for the test's go-ahead, then say when the failure happens."""
    path = os.environ.get("FAIL_GO")
    print("READY", flush=True)
    while path and not os.path.exists(path):
        time.sleep(0.01)
    print(f"FAIL_AT {time.monotonic()}", flush=True)


def main(mode: str, extra: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"UP rank={rank} pid={os.getpid()} port={os.environ['MASTER_PORT']}", flush=True)
    dist.barrier()
    if mode == "raise" and rank == 1:
        print("loading shard 7 of 8", flush=True)
        go()
        raise ValueError("bad sample in shard 7")
    if mode == "exit" and rank == 1:
        print("giving up", flush=True)
        go()
        sys.exit(3)
    if mode == "kill" and rank == 1:
        print("about to be killed", flush=True)
        go()
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "hang" and rank == 1:
        print("stuck in a data read", flush=True)
        go()
        while True:
            time.sleep(3600)
    if mode == "block":
        print(f"READY rank={rank}", flush=True)
        while True:
            time.sleep(3600)
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        kids = [subprocess.Popen(["sleep", "1000"]), subprocess.Popen(["sleep", "1001"], start_new_session=True)]
        print(f"READY rank={rank} children={','.join(str(k.pid) for k in kids)}", flush=True)
        if extra and rank == 1:
            go()
            if extra == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("rank 1 gives up")
        while True:
            time.sleep(3600)
    if mode == "loader":
        loader = torch.utils.data.DataLoader(Slow(), batch_size=1, num_workers=2)
        for i, _ in enumerate(loader):
            if i == 0:
                print(f"READY rank={rank} loader workers up", flush=True)
                if extra == "kill" and rank == 1:
                    go()
                    os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.05)
    t = torch.ones(1)
    dist.all_reduce(t)  # the healthy ranks wait here for the broken one
    print(f"DONE rank={rank} sum={t.item()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "")
