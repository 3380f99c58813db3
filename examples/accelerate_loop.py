"""Train a small GPT in your own loop under an Accelerate `Accelerator` with EDGC, on 2 CPU
processes.

    torchrun --nproc-per-node 2 examples/accelerate_loop.py --steps 40
    torchrun --nproc-per-node 2 examples/accelerate_loop.py --steps 60 --resume runs/accelerate/step-40

register_edgc registers edgc_hook on the DDP wrapper that prepare() returns (Accelerate's
DistributedDataParallelKwargs(comm_hook=...) knows only torch's own hooks), and makes
save_state/load_state carry every replica's EDGC state (edgc_state.pt beside the rest).
Compression starts after `warmup_steps` uncompressed steps: 5 here, 1000 by default.
"""

import argparse
import gc
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator

from edgc import EDGCConfig
from edgc.integrations import log_values
from edgc.integrations.hf import register_edgc
from edgc.models import build_model

VOCAB, BLOCK = 256, 32


def sequences(n: int) -> torch.utils.data.TensorDataset:
    """Token runs t_i = (a + b*i) mod VOCAB: learnable, and nothing to download."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, VOCAB, (n, 1), generator=g), torch.randint(1, 8, (n, 1), generator=g)
    tokens = (a + b * torch.arange(BLOCK + 1)) % VOCAB  # (n, BLOCK + 1)
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="optimiser steps in all (default: 40)")
    parser.add_argument("--out", default="runs/accelerate", help="checkpoints (default: runs/accelerate)")
    parser.add_argument("--resume", help="a step-N folder to continue from")
    args = parser.parse_args()

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=VOCAB, block_size=BLOCK)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(sequences(512), batch_size=8, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    # (optimizer=: the state is told its learning rate before each step, as the "critical" policy needs)
    state = register_edgc(accelerator, model, EDGCConfig(max_rank=8, warmup_steps=5, window=5), optimizer=optimizer)
    step = 0
    if args.resume:
        accelerator.load_state(args.resume)  # model, optimizer, RNG and each replica's EDGC state
        step = int(Path(args.resume).name.removeprefix("step-"))

    epoch, skip = divmod(step, len(loader))
    while step < args.steps:
        loader.set_epoch(epoch)
        for x, y in accelerator.skip_first_batches(loader, skip) if skip else loader:
            _, loss = model(x, y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % 5 == 0:
                values = {"loss": loss.item(), **log_values(state.stats())}
                accelerator.log(values, step=step)  # (to the trackers of Accelerator(log_with=...), if any)
                accelerator.print(f"step {step}: {values}")
            if step % 10 == 0:
                accelerator.save_state(f"{args.out}/step-{step}")
            if step == args.steps:
                break
        epoch, skip = epoch + 1, 0

    s = state.stats()
    accelerator.print(f"EDGC: {s.compressed_steps} of {s.step} steps compressed, last at rank {s.step_rank}, "
                      f"{s.compression_ratio:.2f}x fewer bytes than plain all-reduce")

    # End the process group while Python is still alive (docs/integrations.md, "At exit"):
    # left to the interpreter's shutdown, gloo can abort the process after its work is done.
    del accelerator, model, optimizer, loader, state
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    gc.collect()


if __name__ == "__main__":
    main()
