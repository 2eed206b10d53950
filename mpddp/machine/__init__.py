"""Facts about the machine and the cluster: GPUs, network interfaces, SLURM, CPU cores.

Each module reads one source (NVML or nvidia-smi, the kernel's interfaces,
``SLURM_*`` variables, psutil) and answers in plain values; none starts a
process of the job or imports torch at module level. Imports only mpddp's
top level (errors, config).
"""
