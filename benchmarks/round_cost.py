"""What one compression round costs: time, memory and launches, against one read of the gradient.

    python benchmarks/round_cost.py --preset gpt2-124m --rank 32            # on this CPU
    python benchmarks/round_cost.py --device cuda --preset gpt2-345m        # float32 on a GPU
    python benchmarks/round_cost.py --device cuda --preset gpt2-2.5b --dtype bf16 --batch 4

Each method runs in a process of its own (so that its peak memory is its own), one process
on one device: a world of one, where every collective is skipped or costs next to nothing,
so what the hook takes is the compression arithmetic. The model is a GPT-2 preset under
DDP with buckets of `--bucket-mb` (DDP's default, 25 MB), the gradients in `--dtype`, at
static rank `--rank` on every matrix (torch's hook has one rank for all).

Methods: `none` (DDP's own all-reduce), `torch-powersgd` (torch's powerSGD_hook, batching
same-shape matrices per bucket), `edgc-int8` (edgc's hook, the default int8 wire) and
`edgc-native` (the gradient's own dtype on the wire), each with its defaults otherwise.

Per method, after `--skip` steps of warm-up, the median of `--steps` steps of:
- the step (forward, backward with the hook, optimiser), the device synchronised at its end;
- the hook: the time inside the hook calls, the device synchronised before and after each,
  so that it is the kernels' time and not only their launch (torch's hook: waiting for each
  bucket's future too, which its work is chained on);
- the peak memory: torch.cuda.max_memory_allocated on a GPU, the process's peak resident
  set on the CPU.
Then, in one more step, the ops the round dispatches, counted by a TorchDispatchMode
inside the hook calls: every aten op that launches work, views and other metadata-only
ops left out (edgc.bench.ops). On a GPU each is at least one kernel launch. Ops torch's hook
runs in future callbacks on gloo's thread are not seen: its count is a lower bound.

Two floors, measured on the device:
- one read of the gradient, at the copy bandwidth (a copy of a gradient-sized buffer reads
  and writes it once each: half its time). A good round costs a small multiple of it
  (edgc.comm.step, "The round on a device");
- the three projections every PowerSGD round makes (P = M Q, Q = M^T P, the average P Q^T),
  as one batched matmul each per shape of the model's compressed matrices, at `--rank`, in
  the working dtype, and nothing else: a round cannot cost less. Where matmuls are slow
  (a CPU) it dominates; on a GPU it is a few reads.

`--repeats N` runs every method N times, each in a fresh process, the methods in turn: the
table gives the medians and the hook's range (a hook whose work runs in future callbacks,
as torch's does, moves with how the threads are scheduled). `--json FILE` writes every
figure, every run's too, with the machine and the arguments.
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import resource
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
from torch.nn.parallel import DistributedDataParallel as DDP

from edgc import EDGCConfig, EDGCState, edgc_hook
from edgc.bench.ops import OpCounter
from edgc.compress import compressible
from edgc.models import build_model
from edgc.train.launch import run_local

METHODS = ("none", "torch-powersgd", "edgc-int8", "edgc-native")
DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16}

def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measured_hook(hook: Any, record: dict[str, Any], device: torch.device, wait: bool) -> Any:
    """`hook` timed with the device synchronised around each call (`wait`: and its future
    waited for), and its ops counted while record["counter"] is set."""
    def wrapped(state, bucket):  # (no annotations: DDP checks them as objects)
        _synchronize(device)
        counter = record["counter"]
        t0 = time.perf_counter()
        if counter is not None:
            with counter:
                fut = hook(state, bucket)
                if wait:
                    fut.wait()
        else:
            fut = hook(state, bucket)
            if wait:
                fut.wait()
        _synchronize(device)
        record["hook_s"] += time.perf_counter() - t0
        return fut

    return wrapped


def copy_floor_seconds(numel: int, dtype: torch.dtype, device: torch.device, repeats: int = 5) -> float:
    """One read of `numel` elements of `dtype` on `device`, at the copy bandwidth measured
    there: half the median time of copying a buffer that size (one read and one write)."""
    src = torch.ones(numel, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        _synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) / 2


def matmul_floor_seconds(shapes: list[tuple[int, int]], rank: int, dtype: torch.dtype, device: torch.device,
                         repeats: int = 5) -> float:
    """The three projections of one round on matrices of `shapes` at `rank` (capped by each
    matrix), one batched matmul each per shape, in the working dtype (float32 for half
    precision): the median time of `repeats`, the device synchronised around them."""
    work = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    gen = torch.Generator().manual_seed(0)
    batches = []
    for (m, n), count in sorted(collections.Counter(shapes).items()):
        r = min(rank, m, n)
        mats = torch.randn(count, m, n, generator=gen, dtype=work).to(device)
        q = torch.randn(count, n, r, generator=gen, dtype=work).to(device)
        batches.append((mats, q, torch.empty(count, m, r, dtype=work, device=device), torch.empty_like(q),
                        torch.empty_like(mats)))
    times = []
    for _ in range(repeats + 1):
        _synchronize(device)
        t0 = time.perf_counter()
        for mats, q, p, q_new, average in batches:  # (M and Q stay as drawn: every pass on the same values)
            torch.bmm(mats, q, out=p)  # P = M Q
            torch.bmm(mats.mT, p, out=q_new)  # Q = M^T P
            torch.bmm(p, q_new.mT, out=average)  # the average P Q^T
        _synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def worker(rank: int, world: int, method: str, args: argparse.Namespace) -> dict[str, Any]:
    """One method in this process: the medians, the peak memory and the ops of one round."""
    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = build_model(args.preset, block_size=args.block, device=device).to(DTYPES[args.dtype])
    ddp = DDP(model, device_ids=[0] if cuda else None, bucket_cap_mb=args.bucket_mb)
    record: dict[str, Any] = {"hook_s": 0.0, "counter": None}
    if method == "torch-powersgd":
        state = torch_psgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=args.rank, start_powerSGD_iter=2,
            min_compression_rate=2, use_error_feedback=True, warm_start=True, batch_tensors_with_same_shape=True)
        ddp.register_comm_hook(state, _measured_hook(torch_psgd.powerSGD_hook, record, device, wait=True))
    elif method.startswith("edgc-"):
        config = EDGCConfig(policy="static", max_rank=args.rank, warmup="fixed", warmup_steps=1,
                            wire=method.removeprefix("edgc-"), long_rank_factor=1.0)
        ddp.register_comm_hook(EDGCState(None, config), _measured_hook(edgc_hook, record, device, wait=False))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size

    def step() -> float:
        x = torch.randint(0, vocab, (args.batch, args.block), generator=gen).to(device)
        _synchronize(device)
        t0 = time.perf_counter()
        _, loss = ddp(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _synchronize(device)
        return time.perf_counter() - t0

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    steps, hooks = [], []
    for i in range(args.skip + args.steps):
        record["hook_s"] = 0.0
        t = step()
        if i >= args.skip:
            steps.append(t)
            hooks.append(record["hook_s"])
    peak = (torch.cuda.max_memory_allocated(device) if cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    ops: dict[str, int] = {}
    if method != "none":
        record["counter"] = OpCounter()
        step()
        ops = dict(record["counter"].ops)
    numel = sum(p.numel() for p in model.parameters())
    shapes = [(p.shape[0], p[0].numel()) for p in model.parameters() if compressible(p.shape, args.rank, 2.0)]
    return {"matmul_s": matmul_floor_seconds(shapes, args.rank, DTYPES[args.dtype], device),
            "step_s": statistics.median(steps), "hook_s": statistics.median(hooks), "peak_bytes": peak,
            "ops": ops, "params": numel,
            "read_s": copy_floor_seconds(numel, DTYPES[args.dtype], device)}


def _median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One method's row over its runs: the median of each time, the largest peak, and the
    ops of the run that saw the most (the same in each of edgc's; torch's hook runs some in
    future callbacks on gloo's thread, where the counter does not look, a lower bound)."""
    row = dict(max(runs, key=lambda r: sum(r["ops"].values())))
    for key in ("step_s", "hook_s", "read_s", "matmul_s"):
        row[key] = statistics.median(r[key] for r in runs)
    row["peak_bytes"] = max(r["peak_bytes"] for r in runs)
    return row


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt2-124m")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="the model's and its gradients'")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--skip", type=int, default=4, help="warm-up steps (torch's hook compresses from step 2)")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of every method, each in a fresh process, the methods taken in turn; the table "
                             "gives the medians over them and the hook's range")
    parser.add_argument("--json", metavar="FILE", help="also write the figures here")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise SystemExit(f"round_cost: unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("round_cost: --device cuda, but torch sees no CUDA GPU")
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.repeats < 1:
        raise SystemExit("round_cost: --repeats must be at least 1")
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    for _ in range(args.repeats):  # (in turn, so that a slow spell of the machine falls on every method)
        for m in methods:
            runs[m].append(run_local(worker, 1, m, args, timeout=3600, backend=backend)[0])
    rows = {m: _median_row(r) for m, r in runs.items()}
    where = (f"{torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}" if args.device == "cuda"
             else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    any_row = next(iter(rows.values()))
    every = [run for method_runs in runs.values() for run in method_runs]  # (the floors: the same in each)
    read_s = statistics.median(run["read_s"] for run in every)
    read_ms, matmul_ms = read_s * 1e3, statistics.median(run["matmul_s"] for run in every) * 1e3
    print(f"\n{args.preset} ({any_row['params'] / 1e6:.1f}M params, {args.dtype}), static rank {args.rank}, "
          f"batch {args.batch}x{args.block}, DDP buckets of {args.bucket_mb:g} MB, one process, {backend}, "
          f"torch {torch.__version__}, {where}; one read of the gradient (the median of every run's): "
          f"{read_ms:.2f} ms; the three "
          f"projections alone (the matmul floor): {matmul_ms:.1f} ms\n")
    spread = args.repeats > 1
    print(f"| method | step (ms) | hook (ms) | {'hook range (ms) | ' if spread else ''}hook / one read "
          "| hook / matmul floor | peak memory (GB) | ops per round |")
    print("|---|---|---|" + ("---|" if spread else "") + "---|---|---|---|")
    for method, r in rows.items():
        ops = sum(r["ops"].values())
        ratio = f"{r['hook_s'] * 1e3 / matmul_ms:.2f}x" if method != "none" else "-"
        hooks = [run["hook_s"] * 1e3 for run in runs[method]]
        span = f"{min(hooks):.1f}–{max(hooks):.1f} | " if spread else ""
        print(f"| {method} | {r['step_s'] * 1e3:.1f} | {r['hook_s'] * 1e3:.1f} | {span}"
              f"{r['hook_s'] / read_s:.0f}x | {ratio} | {r['peak_bytes'] / 1e9:.2f} | "
              f"{ops if r['ops'] else '-'} |")
    for method, r in rows.items():
        if r["ops"]:
            top = ", ".join(f"{k} {v}" for k, v in sorted(r["ops"].items(), key=lambda kv: -kv[1])[:8])
            print(f"\n{method}'s ops: {top}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": where, "torch": torch.__version__, "rows": rows, "runs": runs},
                      f, indent=1)
    if dist.is_initialized():  # (never here: the workers own the process group)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
