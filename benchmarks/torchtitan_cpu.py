"""torchtitan's llama3 debug model with and without edgc, on a CPU: losses and bytes.

    python benchmarks/torchtitan_cpu.py --steps 300 --out benchmarks/results/cpu-20261129/torchtitan

Each method trains torchtitan's `llama3_debugmodel` (6 layers, width 256, 2048-token
vocabulary) through torchtitan's own entry point, `--module edgc.integrations.torchtitan`,
on 4 gloo processes as 2 replicas x 2 shards (HSDP), with the CPU shim of the tests
(tests/distributed/titan_shim.py), on the built-in corpus (sequences of 128 tokens, 2 per
process and step) and the same seed:

- native: torchtitan's own HSDP all-reduce (`--edgc.no-enable`);
- edgc: edgc's defaults under torchtitan (r_max 32, int8 wire, the window and warm-up
  scaled to the run).

It writes README.md (the command, the machine, a table: the mean training loss of the last
10% of steps, the validation loss at the end on 20 batches of the validation split, bytes
sent against native's, compressed steps, seconds a step) and results.json, and prints the
table. Timings on a 2-core machine running 4 processes say little; the losses and bytes are
the point.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIM = ROOT / "tests" / "distributed" / "titan_shim.py"
METHODS = {"native": ["--edgc.no-enable"], "edgc": []}


def run(method: str, steps: int, work: Path, home: Path) -> dict:
    """One torchtitan run, its dump folder in `work`; returns rank 0's record, its seconds
    and its command."""
    sys.path.insert(0, str(SHIM.parent))
    from titan_shim import CPU_FLAGS

    record = work / method / "record"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", str(SHIM),
           "--module", "edgc.integrations.torchtitan", "--config", "llama3_debugmodel", *CPU_FLAGS,
           "--training.seq-len", "128", "--training.local-batch-size", "2", "--training.steps", str(steps),
           "--parallelism.data-parallel-replicate-degree", "2", "--debug.seed", "0",
           "--validator.enable", "--validator.freq", str(steps), "--validator.steps", "20",
           "--metrics.log-freq", "1", "--metrics.disable-color-printing", "--dump-folder", str(work / method),
           *METHODS[method]]
    start = time.perf_counter()
    env = {**os.environ, "EDGC_TITAN_RECORD": str(record), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=home, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"{method} failed:\n{done.stderr[-6000:]}")
    got = json.loads((record / "rank0.json").read_text())
    shown = cmd[cmd.index("--module"):]
    at = shown.index("--dump-folder")
    return {"record": got, "seconds": seconds, "command": " ".join(shown[:at] + shown[at + 2:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--home", type=Path, default=ROOT, help="working directory: its runs/.data holds the corpus")
    args = parser.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="torchtitan-cpu-"))  # (the runs' dump folders: not kept)
    try:
        results = {m: run(m, args.steps, work, args.home) for m in METHODS}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tail = max(1, args.steps // 10)
    rows = {}
    for method, r in results.items():
        losses = [r["record"]["losses"][k] for k in sorted(r["record"]["losses"], key=int)]
        validation = r["record"]["validation"]
        stats = r["record"]["edgc"]
        rows[method] = {
            "train_loss_last_10pct": sum(losses[-tail:]) / tail,
            "validation_loss": validation[max(validation, key=int)] if validation else None,
            "bytes_sent": stats["bytes_sent"] if stats else None,
            "bytes_uncompressed": stats["bytes_uncompressed"] if stats else None,
            "compressed_steps": stats["compressed_steps"] if stats else 0,
            "final_rank": stats["step_rank"] if stats else None,
            "seconds_per_step": r["seconds"] / args.steps,
        }
    (args.out / "results.json").write_text(json.dumps({"steps": args.steps, "rows": rows}, indent=2) + "\n")
    lines = ["| method | training loss, last 10% | validation loss | bytes against native | compressed steps | "
             "rank at the end | s a step (run, startup included) |", "|---|---|---|---|---|---|---|"]
    for method, row in rows.items():
        ratio = f"{row['bytes_sent'] / row['bytes_uncompressed']:.3f}x" if row["bytes_sent"] else "1x"
        val = f"{row['validation_loss']:.4f}" if row["validation_loss"] is not None else "-"
        lines.append(f"| {method} | {row['train_loss_last_10pct']:.4f} | {val} | {ratio} | "
                     f"{row['compressed_steps']} | {row['final_rank'] or '-'} | {row['seconds_per_step']:.2f} |")
    table = "\n".join(lines)
    print(table)
    command = f"python benchmarks/torchtitan_cpu.py --steps {args.steps} --out {args.out.relative_to(ROOT)}" \
        if args.out.is_relative_to(ROOT) else f"python benchmarks/torchtitan_cpu.py --steps {args.steps}"
    (args.out / "README.md").write_text(
        f"# torchtitan's llama3 debug model with and without edgc, on a CPU\n\n"
        f"```\n{command}\n```\n\n"
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {__import__('torch').__version__}, "
        f"torchtitan {__import__('torchtitan').__version__}; 4 gloo processes as 2 replicas x 2 shards, "
        f"{args.steps} steps (benchmarks/torchtitan_cpu.py says what each method is).\n\n{table}\n\n"
        "Bytes: what this process handed to the replicate collectives, against what native HSDP's all-reduce of "
        "the same shards sends (edgc's `bytes_uncompressed`). The losses are torchtitan's logged global losses.\n\n"
        "Each method's torchtitan arguments:\n\n"
        + "\n".join(f"- {m}: `{r['command']}`" for m, r in results.items()) + "\n")


if __name__ == "__main__":
    main()
