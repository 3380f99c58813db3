"""`edgc bench soak`: run the hook many times on many small buckets, and count races.

A hook that lets replicas issue their collectives in different orders does not fail every
run: gloo pairs the collectives by the order they were issued in, so a run hangs or
aborts only when timing happens to differ between replicas (torch's powerSGD_hook failed
4 of 7 runs of a 29M-parameter GPT here). One run proves little; this command repeats
the same job `--runs` times and counts the failures:

- each run trains a GPT preset on `--nproc` local gloo workers (loopback) under DDP with
  small buckets (`--bucket-cap-mb`: 0.05 MB gives 17 on `tiny`, one per matrix), EDGC with
  the CQM policy, a short window and an entropy sample every step, so the rank changes
  several times per run, starting from a different seed each run;
- a run that does not finish within `--timeout` is a hang; a worker that dies, fails, or
  reports its result and then does not exit cleanly (gloo's abort at interpreter exit)
  is an abort; replicas whose parameters or rank histories differ at the end are a
  mismatch.

It prints one line per run and a summary, and returns 1 if any run failed.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from edgc.config import SYNC_MODES
from edgc.models import PRESETS

__all__ = ["SoakResult", "add_parser", "run", "soak", "soak_worker"]


def soak_worker(rank: int, world: int, opts: dict[str, Any]) -> dict[str, Any]:
    """One replica of one soak run; returns a digest of its parameters, the rank of every
    step and how many buckets DDP handed over in the last step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from edgc import EDGCConfig, EDGCState, edgc_hook
    from edgc.comm.replicas import tensors_digest
    from edgc.models import build_model

    torch.manual_seed(opts["seed"])
    model = build_model(opts["preset"], vocab_size=opts["vocab"], block_size=opts["block"])
    ddp = DDP(model, bucket_cap_mb=opts["bucket_cap_mb"])
    config = EDGCConfig(policy="cqm", max_rank=opts["rank"], min_rank=max(1, opts["rank"] // 4), rank_step=2,
                        window=3, warmup_steps=2, iteration_sample_rate=1.0, min_compression_rate=1.0,
                        sync_mode=opts["sync_mode"], seed=opts["seed"])
    state = EDGCState(None, config)
    calls = [0]

    def counting_hook(state, bucket):  # (unannotated: DDP checks annotations as objects)
        calls[0] = 1 if bucket.index() == 0 else calls[0] + 1
        return edgc_hook(state, bucket)

    ddp.register_comm_hook(state, counting_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(opts["seed"] * 7919 + rank)  # this replica's batches
    ranks = []
    for _ in range(opts["steps"]):
        tokens = torch.randint(0, opts["vocab"], (opts["batch"], opts["block"] + 1), generator=gen)
        _, loss = ddp(tokens[:, :-1], tokens[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in model.parameters()):
            opt.step()
        ranks.append(state.stats().step_rank)
    return {"digest": tensors_digest(model.parameters()), "ranks": ranks, "buckets": calls[0],
            "compressed": state.stats().compressed_steps}


@dataclass
class SoakResult:
    """One soak run's outcome."""

    outcome: str  # "ok", "hang", "abort" or "mismatch"
    seconds: float
    buckets: int = 0  # buckets DDP handed over per step (after its first step)
    ranks: list[int] = field(default_factory=list)  # distinct ranks of compressed steps
    detail: str = ""  # what failed


def soak(runs: int, nproc: int, opts: dict[str, Any], timeout: float,
         report: Callable[[int, SoakResult], None] | None = None) -> list[SoakResult]:
    """`runs` runs of `soak_worker` on `nproc` local workers, run k with seed opts["seed"] + k;
    `report(k, result)` is called after each. Returns the results."""
    from edgc.train.launch import WorkerError, run_local

    results = []
    for k in range(runs):
        t0 = time.perf_counter()
        out = SoakResult("ok", 0.0)
        try:
            replicas = run_local(soak_worker, nproc, dict(opts, seed=opts["seed"] + k), timeout=timeout,
                                 threads=1, strict_exit=True)
        except WorkerError as exc:
            out.outcome, out.detail = ("hang" if exc.how == "timeout" else "abort"), str(exc)
        else:
            first = replicas[0]
            out.buckets, out.ranks = first["buckets"], sorted({r for r in first["ranks"] if r > 0})
            differ = [r for r, rep in enumerate(replicas)
                      if (rep["digest"], rep["ranks"]) != (first["digest"], first["ranks"])]
            if differ:
                out.outcome, out.detail = "mismatch", f"replicas {differ} differ from replica 0"
        out.seconds = time.perf_counter() - t0
        results.append(out)
        if report is not None:
            report(k, out)
    return results


_DESCRIPTION = """\
Run the same EDGC job --runs times, on local gloo workers (loopback), to catch races that \
fail only some runs: a GPT preset trained on random tokens under DDP with many small \
buckets, the CQM policy with a short window and an entropy sample every step, so that the \
rank changes several times per run; run k starts from seed + k. A run that outlives \
--timeout is a hang; a worker that dies, fails or does not exit cleanly is an abort; \
replicas whose parameters or rank histories differ at the end are a mismatch. Prints a line \
per run and a summary, and exits 1 if any run failed."""

_EXAMPLES = """\
examples:
  edgc bench soak --runs 50 --nproc 4 --bucket-cap-mb 0.05           the 50-run soak
  edgc bench soak --runs 5 --nproc 2 --sync-mode whole-step          a short one of the whole-step mode"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("soak", help="repeat a many-bucket EDGC job and count hangs, aborts and replica mismatches",
                       description=_DESCRIPTION, epilog=_EXAMPLES)
    p.add_argument("--runs", type=int, default=50, help="jobs to run, one after the other")
    p.add_argument("--nproc", type=int, default=4, help="local gloo workers per job")
    p.add_argument("--bucket-cap-mb", type=float, default=0.05, help="DDP bucket size: small means many buckets")
    p.add_argument("--sync-mode", choices=SYNC_MODES, default="pipelined", help="EDGCConfig.sync_mode")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="GPT preset trained on random tokens")
    p.add_argument("--vocab", type=int, default=2048, help="vocabulary size of the model and the random tokens")
    p.add_argument("--block", type=int, default=64, help="context length of the synthetic batches")
    p.add_argument("--batch", type=int, default=4, help="sequences per worker per step")
    p.add_argument("--steps", type=int, default=20, help="steps per job (2 uncompressed, then windows of 3)")
    p.add_argument("--rank", type=int, default=8, help="r_max; the rank moves in [r_max/4, r_max]")
    p.add_argument("--seed", type=int, default=0, help="seed of run 0; run k uses seed + k")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run before it counts as a hang")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the summary (markdown) here")


def run(args: argparse.Namespace) -> int:
    if args.runs < 1 or args.nproc < 2 or args.steps < 6 or args.bucket_cap_mb <= 0:
        raise ValueError("--runs must be >= 1, --nproc >= 2, --steps >= 6 (two windows of compression) "
                         "and --bucket-cap-mb > 0")
    opts = {"preset": args.preset, "vocab": args.vocab, "block": args.block, "batch": args.batch,
            "steps": args.steps, "rank": args.rank, "seed": args.seed, "bucket_cap_mb": args.bucket_cap_mb,
            "sync_mode": args.sync_mode}

    def report(k: int, r: SoakResult) -> None:
        print(f"[soak] run {k + 1}/{args.runs}: {r.outcome} in {r.seconds:.0f}s, {r.buckets} buckets, "
              f"ranks {r.ranks}{' - ' + r.detail if r.detail else ''}", flush=True)

    results = soak(args.runs, args.nproc, opts, args.timeout, report)
    counts = {o: sum(r.outcome == o for r in results) for o in ("ok", "hang", "abort", "mismatch")}
    unchanged = sum(r.outcome == "ok" and len(r.ranks) < 2 for r in results)
    text = (f"# edgc bench soak\n\n{args.runs} runs of {args.nproc} gloo workers (loopback), {args.preset}, "
            f"--bucket-cap-mb {args.bucket_cap_mb} ({max(r.buckets for r in results)} buckets), "
            f"sync mode {args.sync_mode}, {args.steps} steps, ranks in [{max(1, args.rank // 4)}, {args.rank}]; "
            f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}.\n\n"
            "| runs | ok | hangs | aborts | replica mismatches | runs whose rank never changed |\n"
            "|---|---|---|---|---|---|\n"
            f"| {args.runs} | {counts['ok']} | {counts['hang']} | {counts['abort']} | {counts['mismatch']} | "
            f"{unchanged} |\n")
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)
    return 0 if counts["ok"] == args.runs else 1
