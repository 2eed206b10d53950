"""A rank that answers a stop by saving a checkpoint, as a preempted job's ranks should (tests/test_grace.py).

``python save_on_signal.py OUT [MODE]``, as a script under ``mpddp run``, or its :func:`arm` called from a
``launch()`` function or a trainer task. Each rank prints ``READY rank=R local=L cvd=C signals=S`` (its
LOCAL_RANK, CUDA_VISIBLE_DEVICES and TORCHELASTIC_SIGNALS_TO_HANDLE; ``sigint=default`` when it got Python's own
SIGINT handler) and writes ``OUT/ready<R>``, then sleeps:

- save (the default): on SIGTERM, SIGINT, SIGHUP, SIGUSR1 or SIGUSR2 it takes 2 s to write
  ``OUT/ckpt<R>.<SIGNAL>``, then exits 0;
- ignore: it ignores SIGTERM and SIGINT (only SIGKILL ends it);
- quick: it exits at once, after its READY line.
"""

from __future__ import annotations

import os
import signal
import sys
import time

SAVE_SECONDS = 2.0
CAUGHT = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def arm(out: str, mode: str = "save") -> int:
    """Set this rank's handlers for ``mode``, say READY; its global rank."""
    rank = int(os.environ["RANK"])
    before = signal.getsignal(signal.SIGINT)  # what the rank was given: Python's default, as from a terminal
    sigint = "default" if before is signal.default_int_handler else "ignored" if before is signal.SIG_IGN else "other"

    def save(signum: int, frame: object) -> None:
        time.sleep(SAVE_SECONDS)  # a checkpoint that takes 2 s to write
        path = os.path.join(out, f"ckpt{rank}.{signal.Signals(signum).name}")
        with open(path + ".tmp", "w") as f:
            f.write(f"saved by rank {rank}")
        os.replace(path + ".tmp", path)
        sys.exit(0)

    if mode == "save":
        for signum in CAUGHT:
            signal.signal(signum, save)
    elif mode == "ignore":
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)
    print(f"READY rank={rank} local={os.environ['LOCAL_RANK']} cvd={os.environ.get('CUDA_VISIBLE_DEVICES')} "
          f"signals={os.environ['TORCHELASTIC_SIGNALS_TO_HANDLE']} sigint={sigint} pid={os.getpid()}", flush=True)
    with open(os.path.join(out, f"ready{rank}"), "w") as f:
        f.write(str(os.getpid()))
    return rank


def wait() -> None:
    while True:
        time.sleep(0.05)


if __name__ == "__main__":
    mode = sys.argv[2] if len(sys.argv) > 2 else "save"
    arm(sys.argv[1], mode)
    if mode != "quick":
        wait()
