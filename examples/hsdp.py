"""Train a small GPT under HSDP with EDGC: FSDP2 shards the model inside each node, and edgc
compresses the all-reduce across nodes. Gloo on CPUs, NCCL with one GPU a process.

    torchrun --nproc-per-node 4 examples/hsdp.py --shard 2       # 2 "nodes" of 2 processes on one machine
    torchrun --nnodes 2 --nproc-per-node 8 ... examples/hsdp.py   # 2 nodes of 8 GPUs: --shard 8, each node's

The mesh is (replicate, shard): processes of one node share a shard group, and processes
with the same shard on other nodes a replicate group. Each step accumulates the gradient of
`--accum` micro-batches and sends it across nodes once. Checkpoints: docs/fsdp.md. The
README's FSDP quick start is this file's `# --- readme: fsdp ---` lines; a test checks that
they agree.
"""

import argparse
import gc
import os

import torch
import torch.distributed as dist

# --- readme: fsdp ---
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from edgc import EDGCConfig, log_stats
from edgc.fsdp import register_edgc
from edgc.models import build_model

# --- readme: end ---

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60, help="the run's optimiser steps")
parser.add_argument("--accum", type=int, default=2, help="micro-batches a step (gradient accumulation)")
parser.add_argument("--shard", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                    help="processes a node, which shard the model (default: torchrun's --nproc-per-node)")
args = parser.parse_args()

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")  # torchrun sets the rank, world size and address
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
if world % args.shard:
    raise SystemExit(f"--shard {args.shard} does not divide the {world} processes")
nodes, per_node = world // args.shard, args.shard


def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's micro-batch: token runs t_i = (a + b*i) mod 256, nothing to download."""
    g = torch.Generator().manual_seed((step * args.accum + micro) * world + rank)
    a, b = torch.randint(0, 256, (8, 1), generator=g), torch.randint(1, 8, (8, 1), generator=g)
    tokens = (a + b * torch.arange(33)) % 256  # (8, 33)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)  # inputs and targets, (8, 32) each


def report(scalars: dict[str, float], step: int) -> None:  # or wandb.log: log_stats calls log(scalars, step)
    print(f"step {step}: loss {loss.item():.3f}, rank {scalars['edgc/rank']:.0f}, "
          f"{scalars['edgc/compression_ratio']:.2f}x fewer bytes across nodes so far")


torch.manual_seed(0)  # (FSDP2 does not broadcast the weights: every process builds the same ones)
# --- readme: fsdp ---
mesh = init_device_mesh(device.type, (nodes, per_node), mesh_dim_names=("replicate", "shard"))
model = build_model("tiny", vocab_size=256, block_size=32).to(device)
for block in model.h:  # the GPT's transformer blocks
    fully_shard(block, mesh=mesh["shard"])  # shard inside the node only: no native all-reduce
fully_shard(model, mesh=mesh["shard"])
# after fully_shard and before the first backward: hooks every FSDP module's all-reduce
state = register_edgc(model, mesh, EDGCConfig(max_rank=8, total_steps=args.steps))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

for step in range(1, args.steps + 1):
    for micro in range(args.accum):
        # only the last micro-batch syncs across nodes; edgc sums the others locally
        model.set_requires_all_reduce(micro == args.accum - 1)
        x, y = batch(step, micro)
        _, loss = model(x, y)  # the model returns (logits, loss)
        (loss / args.accum).backward()
    opt.step()
    opt.zero_grad()
    if rank == 0:  # log once, not once per rank
        log_stats(state, every=10, log=report)
# --- readme: end ---

if rank == 0:
    s = state.stats()
    print(f"EDGC: {s.compressed_steps} of {s.step} steps compressed, last at rank {s.step_rank}, "
          f"{s.compression_ratio:.2f}x fewer bytes than plain all-reduce")

# Free the process group while Python is alive (docs/integrations.md, "At exit").
dist.barrier()
del model, state, opt
gc.collect()
dist.destroy_process_group()
gc.collect()
