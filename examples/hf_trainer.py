"""Train a small GPT-2 with the Trainer from transformers and EDGC, on 2 CPU processes.

    torchrun --nproc-per-node 2 examples/hf_trainer.py --steps 40
    torchrun --nproc-per-node 2 examples/hf_trainer.py --steps 60 --resume runs/hf/checkpoint-40

EDGCTrainerCallback registers edgc_hook on the Trainer's DDP wrapper once train() has
built it, writes every replica's EDGC state to checkpoint-N/edgc_state.pt, and logs
rank, entropy, phase and compression ratio with the Trainer's own logs.
ddp_find_unused_parameters=False: the Trainer turns it on by default, which costs a
graph traversal per step, and EDGC needs every parameter's gradient at every step.
Compression starts after `warmup_steps` uncompressed steps: 5 here, 1000 by default.
"""

import argparse
import gc

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from edgc import EDGCConfig
from edgc.integrations.hf import EDGCTrainerCallback

VOCAB, BLOCK = 256, 32


class Sequences(torch.utils.data.Dataset):
    """Token runs t_i = (a + b*i) mod VOCAB: learnable, and nothing to download."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        a, b = torch.randint(0, VOCAB, (n, 1), generator=g), torch.randint(1, 8, (n, 1), generator=g)
        self.tokens = (a + b * torch.arange(BLOCK)) % VOCAB  # (n, BLOCK)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}  # (the model shifts the labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="optimiser steps in all (default: 40)")
    parser.add_argument("--out", default="runs/hf", help="checkpoints (default: runs/hf)")
    parser.add_argument("--resume", help="a checkpoint-N folder to continue from")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=BLOCK, n_embd=128, n_layer=4, n_head=4))
    training = TrainingArguments(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=8, learning_rate=1e-3,
        logging_steps=5, save_steps=10, report_to="none", use_cpu=True, ddp_find_unused_parameters=False,
        disable_tqdm=True)
    trainer = Trainer(model=model, args=training, train_dataset=Sequences(512))
    edgc = EDGCTrainerCallback(EDGCConfig(max_rank=8, warmup_steps=5, window=5)).attach(trainer)
    trainer.train(resume_from_checkpoint=args.resume)
    s = edgc.state.stats()
    if trainer.is_world_process_zero():
        print(f"EDGC: {s.compressed_steps} of {s.step} steps compressed, last at rank {s.step_rank}, "
              f"{s.compression_ratio:.2f}x fewer bytes than plain all-reduce")

    # End the process group while Python is still alive (docs/integrations.md, "At exit"):
    # left to the interpreter's shutdown, gloo can abort the process after its work is done.
    del trainer, edgc, model
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    gc.collect()


if __name__ == "__main__":
    main()
