"""Train a small GPT with Lightning's DDP strategy and EDGC, on 2 CPU processes.

    python examples/lightning_ddp.py --steps 40            # Lightning starts the 2 processes
    python examples/lightning_ddp.py --steps 60 --resume runs/lightning/checkpoints/step=40.ckpt

EDGCCallback registers edgc_hook on the DDP wrapper (Lightning's own ddp_comm_hook runs
only on CUDA), keeps every replica's EDGC state in each checkpoint and logs rank,
entropy, phase and compression ratio to Lightning's logger (CSV, under --out).
Compression starts after `warmup_steps` uncompressed steps: 5 here, 1000 by default.
"""

import argparse
import gc

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from edgc import EDGCConfig
from edgc.integrations.lightning import EDGCCallback
from edgc.models import build_model

VOCAB, BLOCK = 256, 32


def sequences(n: int) -> torch.utils.data.TensorDataset:
    """Token runs t_i = (a + b*i) mod VOCAB: learnable, and nothing to download."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, VOCAB, (n, 1), generator=g), torch.randint(1, 8, (n, 1), generator=g)
    tokens = (a + b * torch.arange(BLOCK + 1)) % VOCAB  # (n, BLOCK + 1)
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


class LitGPT(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.gpt = build_model("tiny", vocab_size=VOCAB, block_size=BLOCK)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        _, loss = self.gpt(x, y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="optimiser steps in all (default: 40)")
    parser.add_argument("--devices", type=int, default=2, help="processes (default: 2)")
    parser.add_argument("--out", default="runs/lightning", help="logs and checkpoints (default: runs/lightning)")
    parser.add_argument("--resume", help="a checkpoint to continue from")
    args = parser.parse_args()

    torch.manual_seed(0)
    edgc = EDGCCallback(EDGCConfig(max_rank=8, warmup_steps=5, window=5))
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, strategy="ddp", max_steps=args.steps, log_every_n_steps=5,
        callbacks=[edgc, ModelCheckpoint(f"{args.out}/checkpoints", filename="{step}", every_n_train_steps=10,
                                         save_top_k=-1)],
        logger=CSVLogger(args.out), enable_progress_bar=False, enable_model_summary=False)
    loader = torch.utils.data.DataLoader(sequences(512), batch_size=8, shuffle=True)
    trainer.fit(LitGPT(), loader, ckpt_path=args.resume)
    s = edgc.state.stats()
    if trainer.is_global_zero:
        print(f"EDGC: {s.compressed_steps} of {s.step} steps compressed, last at rank {s.step_rank}, "
              f"{s.compression_ratio:.2f}x fewer bytes than plain all-reduce")

    # End the process group while Python is still alive (docs/integrations.md, "At exit"):
    # left to the interpreter's shutdown, gloo can abort the process after its work is done.
    del trainer, edgc
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    gc.collect()


if __name__ == "__main__":
    main()
