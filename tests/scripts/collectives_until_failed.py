"""A job whose ranks all_reduce every 10 ms until the file FAIL_AT appears; then rank ``argv[1]`` raises, and the
others wait in their next collective for it. Prints ``STEP n`` every ``argv[2]`` steps (the etcd tests' and
scripts/bench_etcd_writes.py's job: a job that trains, then a rank's failure to name on every node)."""

import os
import sys
import time

import torch
import torch.distributed as dist

failing, every = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo")
rank, step = dist.get_rank(), 0
while not os.path.exists(os.environ["FAIL_AT"]) or rank != failing:
    dist.all_reduce(torch.ones(1))
    step += 1
    if step % every == 0:
        print(f"STEP {step}", flush=True)
    time.sleep(0.01)
raise RuntimeError(f"rank {failing} fails on purpose")
