#!/bin/bash
# Multi-node fsdp_jax training under SLURM: 2 nodes x 4 GPUs, one process per GPU.
#
#   sbatch examples/slurm_job.sh
#
# No launcher is needed: srun starts one task per GPU and sets SLURM_PROCID,
# SLURM_NTASKS, SLURM_LOCALID, SLURM_STEP_NODELIST, ...; the script's
# fsdp_jax.distributed.initialize() sees a SLURM job and calls
# jax.distributed.initialize() without arguments, so JAX's own SLURM
# detection picks the coordinator (first node of the step, port derived from
# the job id, or JAX_COORDINATOR_PORT), the process count and id, and gives
# each task the GPU SLURM_LOCALID.
#
# The training script itself is unchanged from the single-process version:
#
#   from fsdp_jax import distributed
#   info = distributed.initialize()            # first thing
#   mesh = fsdp_jax.make_mesh(replicate=info.world_size // 4, shard=4)  # HYBRID: shard in a node
#   ...                                        # each process feeds its part of the batch
#
#SBATCH --job-name=fsdp_jax
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4          # one process per GPU
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=8
#SBATCH --time=02:00:00
#SBATCH --output=%x-%j.out

set -euo pipefail

# Optional: a fixed coordinator port (default: derived from the job id).
export JAX_COORDINATOR_PORT=${JAX_COORDINATOR_PORT:-29500}
# Seconds without a heartbeat before a lost process is named and the others
# stop (exit status 75) instead of hanging in a collective.
export FSDP_JAX_PEER_TIMEOUT=${FSDP_JAX_PEER_TIMEOUT:-60}
# HPC proxies can stall the coordinator's gRPC connections.
unset http_proxy https_proxy HTTP_PROXY HTTPS_PROXY

# --kill-on-bad-exit: SLURM stops the other tasks when one fails (what the
# fsdp_jax launcher does on one machine).
# examples/train_gpt.py calls fsdp_jax.distributed.initialize() when it sees several
# SLURM tasks; any training script of yours does the same first thing
# (see docs/multihost.md).
srun --kill-on-bad-exit=1 python examples/train_gpt.py --steps 1000

# Alternative: one launcher per node, 4 processes each (static rendezvous like
# torch.distributed.launch); useful for CPU nodes with simulated devices:
#
#   head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
#   srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c \
#     'python -m fsdp_jax.launch --nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID" \
#        --master-addr '"$head"' --master-port 29500 --nproc 4 train.py'
#
# Note that SLURM's variables are also set inside the launcher's workers;
# RANK/WORLD_SIZE from the launcher take precedence in initialize().
