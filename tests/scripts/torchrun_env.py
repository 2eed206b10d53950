"""A torchrun-style script that prints what its worker sees: every variable, torchelastic's view, the timeout."""

import json
import os

import torch
import torch.distributed as dist
from torch.distributed import constants

if __name__ == "__main__":
    dist.init_process_group("gloo")  # env://, no timeout: torch's default must be the one it gets
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    print("ENV " + json.dumps({
        "rank": dist.get_rank(), "env": dict(os.environ), "elastic": dist.is_torchelastic_launched(),
        "timeout": str(backend.options._timeout), "default_timeout": str(constants.default_pg_timeout),
        "error_dir_exists": os.path.isdir(os.path.dirname(error_file)),
        "error_file_exists": os.path.exists(error_file),
    }), flush=True)
    dist.barrier()
    dist.destroy_process_group()
