"""Facts about the machine and the cluster: GPUs, network interfaces, the job's scheduler, CPU cores.

Each module reads one source (NVML or nvidia-smi, the kernel's interfaces,
``SLURM_*`` variables, an MPI launcher's, PBS's, LSF's or Kubeflow's
variables and host files, psutil) and answers in plain values; cluster.py
picks the scheduler that started this process. None starts a process of
the job or imports torch at module level. Imports only mpddp's top level
(errors, config).
"""
