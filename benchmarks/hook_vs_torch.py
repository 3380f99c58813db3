"""Our EDGC hook (static rank) against torch's powerSGD_hook at the same rank, side by side.

    python benchmarks/hook_vs_torch.py --preset tiny --rank 4 --steps 30
    python benchmarks/hook_vs_torch.py --device cuda       # on a GPU (scripts/gpu-check.sh runs it)

For each method the same GPT, seed and synthetic token batches run under DDP on
`--nproc` local workers: gloo on the CPU; on CUDA, NCCL when each worker has a GPU of
its own, else gloo, which carries CUDA tensors (NCCL refuses two ranks on one GPU).
Reported per step (median over measured steps, after `--skip` steps of warm-up):

- step time (forward + backward + hook + optimiser) and its ratio to ours;
- bytes handed to the collectives per worker (counted by wrapping torch.distributed's
  all_reduce, all_to_all_single and all-gather, so both hooks are measured the same way:
  what each call is given to send, whatever its format); for `none`, whose all-reduce
  DDP issues from C++ where no wrapper sees it, the gradient's own bytes;
- compression time: the hook's wall time in a 1-process run, where collectives cost
  next to nothing, so what remains is the compression arithmetic. On CUDA the device is
  synchronised before and after the hook in that run, so that the time is the kernels'
  and not only their launch; in the several-process runs it is not (a synchronisation
  there would change the step it measures), so their hook time is the host's.

torch's hook is wrapped to wait on each bucket's future before returning: unwrapped it
can deadlock under gloo with several buckets (see edgc.comm.hook's module docstring).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
from torch.nn.parallel import DistributedDataParallel as DDP

from edgc import EDGCConfig, EDGCState, edgc_hook
from edgc.models import build_model
from edgc.train.config import process_group_backend
from edgc.train.launch import run_local

METHODS = ("none", "torch-powersgd", "edgc-static")


#: torch.distributed's collectives a hook may call, and which argument holds what it sends
#: (all_gather_single is the name torch 2.13 gives all_gather_into_tensor).
_COUNTED = {"all_reduce": 0, "all_to_all_single": 1, "all_gather_into_tensor": 1, "all_gather_single": 1}


def _count_collectives(counter: dict) -> dict:
    """Wrap torch.distributed's collectives to add the bytes each call sends to
    counter["bytes"]; returns the originals, for `_restore`."""
    originals = {name: getattr(dist, name) for name in _COUNTED if hasattr(dist, name)}

    def counting(name, original):
        def collective(*args, **kwargs):
            sent = args[_COUNTED[name]]
            counter["bytes"] += sent.numel() * sent.element_size()
            return original(*args, **kwargs)

        return collective

    for name, original in originals.items():
        setattr(dist, name, counting(name, original))
    return originals


def _restore(originals: dict) -> None:
    for name, original in originals.items():
        setattr(dist, name, original)


def _timed(hook, counter: dict):
    def wrapped(state, bucket):
        if counter["sync_device"]:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fut = hook(state, bucket)
        if counter["sync"]:
            fut.wait()
        if counter["sync_device"]:
            torch.cuda.synchronize()
        counter["hook_seconds"] += time.perf_counter() - t0
        return fut

    return wrapped


def worker(rank: int, world: int, method: str, args: argparse.Namespace) -> dict:
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = build_model(args.preset, vocab_size=args.vocab, block_size=args.block).to(device)
    ddp = DDP(model, device_ids=[device.index] if cuda else None, bucket_cap_mb=args.bucket_mb)
    # (the device is synchronised around the hook only where nothing else is timed: one process)
    counter = {"bytes": 0, "hook_seconds": 0.0, "sync": False, "sync_device": cuda and world == 1}
    if method == "torch-powersgd":
        state = torch_psgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=args.rank, start_powerSGD_iter=2,
            min_compression_rate=2, use_error_feedback=True, warm_start=True,
            batch_tensors_with_same_shape=True,
        )
        counter["sync"] = True  # wait per bucket: keeps gloo's collective order fixed
        ddp.register_comm_hook(state, _timed(torch_psgd.powerSGD_hook, counter))
    elif method == "edgc-static":
        # (one rank for every matrix, as torch's hook has it)
        config = EDGCConfig(policy="static", max_rank=args.rank, warmup_steps=1, wire=args.wire, long_rank_factor=1.0)
        ddp.register_comm_hook(EDGCState(None, config), _timed(edgc_hook, counter))
    originals = _count_collectives(counter)
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1 + rank)
    steps = []
    try:
        for step in range(args.steps):
            x = torch.randint(0, args.vocab, (args.batch, args.block), generator=gen).to(device)
            counter.update(bytes=0, hook_seconds=0.0)
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            _, loss = ddp(x, x)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if cuda:  # (the step's kernels, not only their launch)
                torch.cuda.synchronize()
            t = time.perf_counter() - t0
            if step >= args.skip:
                sent = gradient_bytes if method == "none" else counter["bytes"]
                steps.append((t, sent, counter["hook_seconds"]))
    finally:
        _restore(originals)
    return {
        "step_s": statistics.median(s[0] for s in steps),
        "bytes": statistics.median(s[1] for s in steps),
        "hook_s": statistics.median(s[2] for s in steps),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, default=1.0)
    parser.add_argument("--wire", default=EDGCConfig().wire,
                        help="edgc-static's wire format (EDGCConfig.wire; default: the library's, %(default)s); "
                             "torch's hook sends the gradient's dtype")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the workers run (cuda: every worker on a GPU, shared when there are fewer)")
    return parser


def _backend(device: str, nproc: int) -> str:
    return process_group_backend(device, nproc, torch.cuda.device_count() if device == "cuda" else 0)


def main() -> None:
    args = build_parser().parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("hook_vs_torch: --device cuda, but torch sees no CUDA GPU")

    rows = {}
    for method in METHODS:
        multi = run_local(worker, args.nproc, method, args, timeout=1800, backend=_backend(args.device, args.nproc))
        single = run_local(worker, 1, method, args, timeout=1800, backend=_backend(args.device, 1))
        rows[method] = {
            "step_s": max(r["step_s"] for r in multi),
            "bytes": multi[0]["bytes"],
            "comm_hook_s": max(r["hook_s"] for r in multi),
            "compress_s": single[0]["hook_s"],
        }
    model = build_model(args.preset, vocab_size=args.vocab, block_size=args.block, device="meta")
    n_params = sum(p.numel() for p in model.parameters())
    where = (f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}, CUDA {torch.version.cuda}"
             if args.device == "cuda" else f"{platform.processor() or platform.machine()}, "
                                           f"{torch.get_num_threads()} threads")
    print(f"\n{args.preset} GPT ({n_params / 1e6:.2f}M params), rank {args.rank}, "
          f"{args.nproc} {_backend(args.device, args.nproc)} workers on {args.device}, "
          f"batch {args.batch}x{args.block}, bucket {args.bucket_mb} MB, edgc wire {args.wire}, "
          f"torch {torch.__version__}, {where}\n")
    ours = rows["edgc-static"]
    print("| method | step time (ms) | vs edgc | bytes/step | hook time, N procs (ms) "
          "| compression time, 1 proc (ms) |")
    print("|---|---|---|---|---|---|")
    for method, r in rows.items():
        print(f"| {method} | {r['step_s'] * 1e3:.1f} | {r['step_s'] / ours['step_s']:.2f} | {r['bytes']:,.0f} | "
              f"{r['comm_hook_s'] * 1e3:.2f} | {r['compress_s'] * 1e3:.2f} |")
    if args.device == "cuda":
        print("\nOn CUDA the 1-process compression time is taken with the device synchronised around the hook "
              "(the kernels' time); the N-process hook time is the host's, unsynchronised.")


if __name__ == "__main__":
    main()
