"""torchelastic's @record on a script whose rank 1 raises; with --catch the script exits 5 itself."""

import sys

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise ValueError("bad batch on rank 1")
    dist.barrier()


if __name__ == "__main__":
    if "--catch" in sys.argv:
        try:
            main()
        except ValueError:
            sys.exit(5)  # the worker sees a plain exit: only the error file holds the exception
    else:
        main()
