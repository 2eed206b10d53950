#!/bin/bash
# Train with mpddp on 2 nodes under SLURM: ONE mpddp task per node; mpddp starts one worker per GPU itself.
#
#   sbatch scripts/sbatch_example.sh                      # the digits CNN, 2 nodes x 4 GPUs
#   sbatch scripts/sbatch_example.sh --epochs 20 --lr 0.001   # extra arguments go to `mpddp train`
#
# What each SLURM variable becomes inside `python -m mpddp train` (explicit flags win over all of these):
#   SLURM_STEP_NUM_NODES / SLURM_NNODES  -> --nnodes        (2)
#   SLURM_NODEID                         -> --node-rank     (0 on the first node, 1 on the second)
#   SLURM_STEP_NODELIST, first host      -> --master-addr   (e.g. gpu[01-02] -> gpu01; `scontrol show
#                                                             hostnames` when present, else mpddp's own parser)
#   SLURM_JOB_ID                         -> --master-port   (20000 + SLURM_JOB_ID % 10000, the same on every node)
#   CUDA_VISIBLE_DEVICES (set by SLURM)  -> the GPUs used   (all of them: one worker per GPU, so --nprocs 4)
#   SLURM_GPUS_ON_NODE                   -> shown by `mpddp ranks`, and in the srun line of error messages
# Global ranks: rank = node_rank x nprocs_per_node + local_rank (`srun python -m mpddp ranks` prints them all).
# GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME: the interface that reaches the master, unless you set them here.
#
#SBATCH --job-name=mpddp-train
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --time=00:30:00
#SBATCH --output=mpddp-%j.out
set -euo pipefail

# --kill-on-bad-exit: if one node's launcher fails, SLURM stops the other at once.
srun --kill-on-bad-exit=1 python -m mpddp train "$@"
