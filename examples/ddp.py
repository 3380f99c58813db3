"""Train a small GPT under DDP with the EDGC hook: gloo on CPUs, NCCL with one GPU a process.

    torchrun --nproc-per-node 2 examples/ddp.py                       # 60 steps, then runs/ddp/rank*.pt
    torchrun --nproc-per-node 2 examples/ddp.py --steps 60 --stop-after 30   # stop at step 30, as a time limit would
    torchrun --nproc-per-node 2 examples/ddp.py --steps 60 --resume runs/ddp  # ... and go on to step 60

Each process writes its own checkpoint, `rank<R>.pt`: the model and optimiser, which are the
same on every replica, and its EDGC state, which is not (its own error feedback). A run
stopped and resumed ends with the weights of one that never stopped. The README's DDP quick
start is this file from the `# --- readme: ddp ---` line on; a test checks that they agree.
"""

# --- readme: ddp ---
import argparse
import gc
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from edgc import EDGCConfig, EDGCState, edgc_hook, log_stats
from edgc.models import build_model

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60, help="the run's optimiser steps")
parser.add_argument("--stop-after", type=int, help="stop after this step, with a checkpoint")
parser.add_argument("--resume", help="a folder of rank<R>.pt checkpoints to go on from")
parser.add_argument("--out", default="runs/ddp", help="where each rank writes rank<R>.pt")
args = parser.parse_args()

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")  # torchrun sets the rank, world size and address
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)

torch.manual_seed(0)
model = build_model("tiny", vocab_size=256, block_size=32).to(device)  # a 4-layer GPT-2, 0.8M parameters
ddp = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
# total_steps scales the window and the warm-up to the run (docs/config.md, "Scaled to the run")
state = EDGCState(process_group=None, config=EDGCConfig(max_rank=8, total_steps=args.steps))
ddp.register_comm_hook(state, edgc_hook)  # the calling convention of torch's powerSGD_hook
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

start = 0
if args.resume:  # before the first step; each rank reads its own file
    ckpt = torch.load(f"{args.resume}/rank{rank}.pt", map_location=device, weights_only=True)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    state.load_state_dict(ckpt["edgc"])  # refuses another replica's state
    start = ckpt["step"]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of `step`: token runs t_i = (a + b*i) mod 256, nothing to download."""
    g = torch.Generator().manual_seed(step * world + rank)  # (a function of the step: resumes exactly)
    a, b = torch.randint(0, 256, (8, 1), generator=g), torch.randint(1, 8, (8, 1), generator=g)
    tokens = (a + b * torch.arange(33)) % 256  # (8, 33)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)  # inputs and targets, (8, 32) each


def report(scalars: dict[str, float], step: int) -> None:  # or wandb.log: log_stats calls log(scalars, step)
    print(f"step {step}: loss {loss.item():.3f}, rank {scalars['edgc/rank']:.0f}, "
          f"{scalars['edgc/compression_ratio']:.2f}x fewer bytes so far")


last = min(args.steps, args.stop_after or args.steps)
for step in range(start + 1, last + 1):
    x, y = batch(step)
    _, loss = ddp(x, y)  # the model returns (logits, loss)
    loss.backward()  # the hook compresses the gradient's all-reduce here
    opt.step()
    opt.zero_grad()
    if rank == 0:  # log once, not once per rank
        log_stats(state, every=10, log=report)

os.makedirs(args.out, exist_ok=True)
torch.save({"step": last, "model": model.state_dict(), "opt": opt.state_dict(), "edgc": state.state_dict()},
           f"{args.out}/rank{rank}.pt")
if rank == 0:
    s = state.stats()
    print(f"EDGC: {s.compressed_steps} of {s.step} steps compressed, last at rank {s.step_rank}, "
          f"{s.compression_ratio:.2f}x fewer bytes than plain all-reduce")

# Free the process group while Python is alive: left to the interpreter's exit, gloo can
# abort a finished run (docs/integrations.md, "At exit").
dist.barrier()
del ddp, state, opt
gc.collect()
dist.destroy_process_group()
gc.collect()
# --- readme: end ---
