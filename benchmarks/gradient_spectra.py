"""How low-rank each gradient matrix is, and how that changes during training.

A rank policy can only save bytes where some matrices, or some phases of training, need
fewer singular directions than r_max. This script trains a preset uncompressed in one
process (AdamW, the trainer's learning rate, the built-in corpus or `--data`) and, at the
given steps, prints for every gradient matrix its effective rank exp(H(σ²/Σσ²)) (the
spectral entropy of the issue's candidate policy) and the share of its energy Σσ² that
the best rank-r approximation captures at r = 4, 8, 16, 32 (Eckart–Young–Mirsky: what
PowerSGD at rank r could keep at best), and the bytes one rank costs each matrix ((m + n)
elements). This is a measurement, not a test: nothing is asserted.

    python3 benchmarks/gradient_spectra.py [--preset tiny] [--steps 10,50,150,300,1000]
                                           [--batch-size 16] [--data DIR]
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from edgc.data import TokenFile, get_batch
from edgc.models import build_model
from edgc.train.config import TrainConfig
from edgc.train.trainer import ensure_data

RANKS = (4, 8, 16, 32)


def spectrum_row(name: str, grad: torch.Tensor) -> str:
    """One table row: shape, effective rank and captured energy at RANKS."""
    a = grad.reshape(grad.shape[0], -1).double()  # (m, n)
    s2 = torch.linalg.svdvals(a).pow(2)
    share = s2 / s2.sum()
    eff = float(torch.exp(-(share * torch.log(share.clamp_min(1e-300))).sum()))
    captured = " | ".join(f"{float(share[:r].sum()):.3f}" for r in RANKS)
    m, n = a.shape
    return f"| {name} | {m}×{n} | {m + n} | {eff:.1f} | {captured} |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", default="10,50,150,300,1000", help="steps at which to measure, comma-separated")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--data", default=None, help="a folder from `edgc prepare` (default: the built-in corpus)")
    p.add_argument("--seed", type=int, default=1337)
    args = p.parse_args()
    at = sorted({int(s) for s in args.steps.split(",")})
    data = ensure_data(TrainConfig(preset=args.preset, data=args.data))
    meta = json.loads((Path(data) / "meta.json").read_text())
    train = TokenFile(Path(data) / "train.bin")
    torch.manual_seed(args.seed)
    model = build_model(args.preset, vocab_size=meta["vocab_size"])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed)
    print(f"{args.preset} on {data}, batch {args.batch_size} x {model.config.block_size}, lr {args.lr}; "
          f"{platform.machine()}, torch {torch.__version__}\n")
    for step in range(1, at[-1] + 1):
        x, y = get_batch(train, args.batch_size, model.config.block_size, gen, torch.device("cpu"))
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if step in at:
            print(f"step {step}, loss {loss.item():.3f}\n")
            print("| matrix | shape | elements per rank | effective rank | "
                  + " | ".join(f"energy at r{r}" for r in RANKS) + " |")
            print("|---|---|---|---|" + "---|" * len(RANKS))
            for name, param in model.named_parameters():
                if param.dim() >= 2:
                    print(spectrum_row(name, param.grad))
            print()
        opt.step()


if __name__ == "__main__":
    main()
