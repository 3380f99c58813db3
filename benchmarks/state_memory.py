"""The memory a DDP communication hook keeps between steps: edgc's against torch's powerSGD_hook.

    python benchmarks/state_memory.py                        # 2 gloo workers, float32 and bf16
    python benchmarks/state_memory.py --device cuda --nproc 1   # on a GPU

A model of `--layers` square `--width` x `--width` linear layers (no biases: every
parameter is a compressed matrix), in float32 and in bf16 (the parameters themselves, so
that DDP hands the hook bf16 gradients), runs under DDP on `--nproc` local workers: one
step sent whole, then `--steps` compressed steps at rank `--rank`, with edgc's hook
(static rank, today's defaults otherwise: int8 on the wire) and with torch's
powerSGD_hook (error feedback and warm start on). Then every tensor reachable by Python
references from the hook's state object is summed, each storage once, leaving out the
model's parameters and gradients, and divided by the number of compressed elements.
That is the state measured from outside the library; for edgc it is also checked
against `stats().state_bytes`, what the library says it holds.

Per row: the gradients' dtype, edgc's `state_dtype`, edgc's bytes per compressed
element, torch's, and their ratio (rank 0's; every worker holds the same sizes).
"""

from __future__ import annotations

import argparse
import gc
import platform
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
from torch.nn.parallel import DistributedDataParallel as DDP

from edgc import EDGCConfig, EDGCState, edgc_hook
from edgc.train.launch import run_local

DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16}


def reachable_bytes(root: Any, exclude: set[int]) -> int:
    """Bytes of the tensor storages reachable from `root` by Python references, each
    storage once, leaving out the storages whose data pointers are in `exclude` and
    anything behind a module or a class."""
    seen, storages = set(), {}
    stack = [root]
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, (type, torch.nn.Module)):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            s = o.untyped_storage()
            if s.data_ptr() not in exclude:
                storages[s.data_ptr()] = s.nbytes()
            continue
        stack.extend(gc.get_referents(o))
    return sum(storages.values())


def _waiting(hook: Any) -> Any:
    """torch's hook, waiting on its future before returning: unwaited, several buckets can
    deadlock under gloo (edgc.comm.hook's module docstring)."""
    def wrapped(state, bucket):  # (unannotated: DDP checks the annotations a hook has)
        out = hook(state, bucket).wait()
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(out)
        return fut
    return wrapped


def worker(rank: int, world: int, method: str, dtype_name: str, state_dtype: str,
           args: argparse.Namespace) -> dict[str, Any]:
    """One worker's state bytes per compressed element after the steps."""
    device = torch.device(args.device if args.device == "cpu" else f"cuda:{rank % torch.cuda.device_count()}")
    dtype = DTYPES[dtype_name]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width, bias=False)
                                  for _ in range(args.layers)]).to(device=device, dtype=dtype)
    ddp = DDP(model, device_ids=None if device.type == "cpu" else [device])
    state: Any
    if method == "edgc":
        state = EDGCState(None, EDGCConfig(policy="static", max_rank=args.rank, warmup="fixed", warmup_steps=1,
                                           state_dtype=state_dtype))
        ddp.register_comm_hook(state, edgc_hook)
    else:
        state = torch_psgd.PowerSGDState(process_group=None, matrix_approximation_rank=args.rank,
                                         start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
        ddp.register_comm_hook(state, _waiting(torch_psgd.powerSGD_hook))
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    gen = torch.Generator(device=device).manual_seed(1 + rank)
    for _ in range(2 + args.steps):
        x = torch.randn(args.batch, args.width, device=device, dtype=dtype, generator=gen)
        opt.zero_grad(set_to_none=False)
        ddp(x).float().square().mean().backward()
        opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    exclude = {t.untyped_storage().data_ptr() for p in model.parameters() for t in (p, p.grad) if t is not None}
    held = reachable_bytes(state, exclude)
    elements = sum(p.numel() for p in model.parameters())
    out = {"held": held, "elements": elements}
    if method == "edgc":
        groups = state.sync.compression.groups.values()
        assert sum(len(g.slots) * g.shape[0] * g.shape[1] for g in groups) == elements  # (all compressed)
        out["reported"] = state.stats().state_bytes
    return out


def measure(args: argparse.Namespace, dtype_name: str, state_dtype: str) -> dict[str, float]:
    """edgc's and torch's bytes per compressed element for gradients in `dtype_name`."""
    backend = "gloo" if args.device == "cpu" or args.nproc > torch.cuda.device_count() else "nccl"
    ours = run_local(worker, args.nproc, "edgc", dtype_name, state_dtype, args, timeout=600, backend=backend)[0]
    theirs = run_local(worker, args.nproc, "torch", dtype_name, state_dtype, args, timeout=600, backend=backend)[0]
    return {"edgc": ours["held"] / ours["elements"], "torch": theirs["held"] / theirs["elements"],
            "reported": ours["reported"] / ours["elements"]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--steps", type=int, default=10, help="compressed steps before the count")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--dtype", default="float32,bf16", help="gradient dtypes, comma-separated")
    p.add_argument("--state-dtype", default="native,float32,bf16", help="edgc's state_dtype values")
    return p


def main() -> None:
    args = build_parser().parse_args()
    print(f"{platform.machine()}, torch {torch.__version__}, {args.device}, {args.nproc} workers, "
          f"{args.layers} layers of {args.width} x {args.width}, rank {args.rank}, {args.steps} compressed steps")
    print("\n| gradients | edgc state_dtype | edgc (bytes / element) | torch powerSGD_hook | ratio | "
          "stats().state_bytes / element |")
    print("|---|---|---|---|---|---|")
    for dtype_name in args.dtype.split(","):
        for state_dtype in args.state_dtype.split(","):
            r = measure(args, dtype_name, state_dtype)
            print(f"| {dtype_name} | {state_dtype} | {r['edgc']:.3f} | {r['torch']:.3f} | "
                  f"{r['edgc'] / r['torch']:.2f}x | {r['reported']:.3f} |", flush=True)
    if dist.is_initialized():  # (never here: the workers ran in their own processes)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
