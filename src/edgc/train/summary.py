"""Figures of a finished run, and its summary.md and plots."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgc.train.blocks import BlockLosses, paired_difference
from edgc.train.metrics import perplexity, read_metrics

if TYPE_CHECKING:
    from rich.console import Console

# (rich and matplotlib, through edgc.train.plots, are imported where a table is drawn or
# a plot made: a training worker imports this module and needs neither to start)

__all__ = ["RunSummary", "compare_loss", "load_run", "memory_table", "show_table", "stage_table", "summarize", "table",
           "table_cells", "write_summary"]


@dataclass
class RunSummary:
    """The comparison figures of one run."""

    name: str
    method: str
    steps: int
    final_val_loss: float
    final_val_ppl: float
    total_bytes: int
    total_bytes_uncompressed: int
    mean_step_time: float
    total_comm_time: float
    mean_tokens_per_s: float
    final_rank: int
    final_val_loss_se: float = math.nan
    """Standard error of final_val_loss (NaN for runs logged before it was recorded)."""
    total_expert_bytes: int = 0
    """The part of total_bytes that averaged the experts' gradients (models with experts)."""
    total_a2a_bytes: int = 0
    """Bytes a worker sent on average to the experts' all-to-alls (activations; not in total_bytes)."""
    mean_busiest_share: float = math.nan
    """The busiest expert's share of the assignments, averaged over the steps (1/E: balanced)."""
    blocks: BlockLosses | None = field(default=None, repr=False, compare=False)
    """The final evaluation's block losses (val_blocks.npz), when the run kept them: the
    comparison against another run on the same blocks is then paired."""


def load_run(run_dir: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(config, metrics records) of a run folder; raises FileNotFoundError naming what is
    missing, and ValueError naming a config.json that is not a JSON object."""
    run_dir = Path(run_dir)
    for name in ("config.json", "metrics.jsonl"):
        if not (run_dir / name).is_file():
            raise FileNotFoundError(f"{str(run_dir)!r} is not an edgc run folder: {name} is missing")
    path = run_dir / "config.json"
    try:
        config = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{str(path)!r} is not valid JSON ({exc}); the run's settings are also in its "
                         f"checkpoint.pt, and a resume writes config.json afresh") from None
    if not isinstance(config, dict):
        raise ValueError(f"{str(path)!r} must hold a JSON object of the run's settings")
    return config, read_metrics(run_dir / "metrics.jsonl")


def summarize(name: str, config: dict[str, Any], records: list[dict[str, Any]],
              blocks: BlockLosses | None = None) -> RunSummary:
    """The comparison figures of one run from its config and metrics records; `blocks`,
    the block losses of its last evaluation (`load_block_losses(folder, step)`), if kept."""
    train = [r for r in records if r.get("kind") == "train"]
    val = [r for r in records if r.get("kind") == "val"]
    if not train:
        raise ValueError(f"run {name!r} has no training steps logged")
    # the first steps include one-off start-up costs; leave out 5% from the mean step time
    timed = train[len(train) // 20 :] or train
    # (a diverged run logs its non-finite losses as null)
    last_val = val[-1]["val_loss"] if val and val[-1]["val_loss"] is not None else math.nan
    last_se = val[-1].get("val_loss_se") if val else None
    return RunSummary(
        name=name, method=config.get("method", "?"), steps=train[-1]["step"],
        final_val_loss=last_val, final_val_ppl=perplexity(last_val),
        total_bytes=sum(r["bytes_sent"] for r in train),
        total_bytes_uncompressed=sum(r["bytes_uncompressed"] for r in train),
        mean_step_time=sum(r["step_time"] for r in timed) / len(timed),
        total_comm_time=sum(r["comm_time"] for r in train),
        mean_tokens_per_s=sum(r["tokens_per_s"] for r in timed) / len(timed),
        final_rank=train[-1]["rank"],
        final_val_loss_se=last_se if last_se is not None else math.nan,
        total_expert_bytes=sum(r.get("expert_bytes", 0) for r in train),
        total_a2a_bytes=sum(r.get("a2a_bytes", 0) for r in train),
        mean_busiest_share=(sum(r["busiest_expert_share"] for r in train) / len(train)
                            if all("busiest_expert_share" in r for r in train) else math.nan),
        blocks=blocks,
    )


def compare_loss(loss: float, se: float, base_loss: float, base_se: float,
                 paired: tuple[float, float] | None = None) -> str:
    """`loss` against `base_loss` in percent, e.g. "+0.12% (within SE)" when the difference
    is at most their combined standard error sqrt(se^2 + base_se^2), "—" when either loss
    is missing. Both runs are evaluated on the same blocks, so their errors are positively
    correlated and the combined SE overstates the noise of the difference. With `paired`
    (the mean of the per-block differences and its SE, edgc.train.evaluation's
    `paired_difference`) the verdict uses that instead: "+0.12% (+0.0060 ± 0.0009 paired:
    beyond SE)". Either measures the evaluation's noise, not another seed's."""
    if not (math.isfinite(loss) and math.isfinite(base_loss)) or base_loss == 0:
        return "—"
    diff = loss - base_loss
    text = f"{diff / base_loss:+.2%}"
    if paired is not None and math.isfinite(paired[1]):
        mean, pse = paired
        return text + f" ({mean:+.4f} ± {pse:.4f} paired: {'within' if abs(mean) <= pse else 'beyond'} SE)"
    combined = math.sqrt(se * se + base_se * base_se)
    if math.isfinite(combined):
        text += " (within SE)" if abs(diff) <= combined else " (beyond SE)"
    return text


def _paired(run: RunSummary, base: RunSummary) -> tuple[float, float] | None:
    """run's loss minus base's over the same validation blocks, with its paired SE; None
    without both runs' block losses, or when they were evaluated on other blocks."""
    if run.blocks is None or base.blocks is None or not np.array_equal(run.blocks.starts, base.blocks.starts):
        return None
    return paired_difference(run.blocks, base.blocks)


def _loss_with_se(loss: float, se: float) -> str:
    if not math.isfinite(loss):
        return "not finite"
    return f"{loss:.4f} ± {se:.4f}" if math.isfinite(se) else f"{loss:.4f}"


def table_cells(summaries: list[RunSummary]) -> tuple[list[str], list[list[str]]]:
    """The comparison table's header and rows, as text; ratios are against the first run.
    The validation loss comes with its standard error, and "val loss vs first" says whether
    a difference is within the two runs' combined standard error (see `compare_loss`)."""
    base = summaries[0]
    header = ["run", "method", "steps", "final val loss ± SE", "val loss vs first", "val ppl", "total MB sent",
              "bytes vs first", "mean step (ms)", "comm time (s)", "final rank"]
    rows = []
    for s in summaries:
        versus = "—" if s is base else compare_loss(s.final_val_loss, s.final_val_loss_se,
                                                     base.final_val_loss, base.final_val_loss_se, _paired(s, base))
        rows.append([
            s.name, s.method, str(s.steps), _loss_with_se(s.final_val_loss, s.final_val_loss_se), versus,
            f"{s.final_val_ppl:.2f}", f"{s.total_bytes / 1e6:.1f}",
            f"{s.total_bytes / base.total_bytes:.3f}" if base.total_bytes else "—",
            f"{s.mean_step_time * 1e3:.1f}", f"{s.total_comm_time:.2f}", str(s.final_rank),
        ])
    return header, rows


def table(summaries: list[RunSummary]) -> str:
    """The comparison table (`table_cells`) in markdown, as summary.md and report.md hold it."""
    header, rows = table_cells(summaries)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def show_table(summaries: list[RunSummary], console: Console | None = None) -> None:
    """Print the comparison table to `console` (stdout by default). In a terminal it is
    drawn as a table, a row per run, or a column per run when the rows would not fit its
    width; elsewhere (a log, a pipe) it is the markdown of `table`, as summary.md holds it."""
    from rich import box
    from rich.console import Console
    from rich.measure import Measurement
    from rich.table import Table

    console = console or Console()
    if not console.is_terminal:
        console.file.write(table(summaries))
        return
    header, rows = table_cells(summaries)
    drawn = Table(*header, box=box.SIMPLE_HEAD)
    for column in drawn.columns[2:]:  # (the figures)
        column.justify = "right"
    for row in rows:
        drawn.add_row(*row)
    if Measurement.get(console, console.options.update_width(10_000), drawn).maximum > console.width:
        drawn = Table("", *(row[0] for row in rows), box=box.SIMPLE_HEAD)
        for column in drawn.columns[1:]:
            column.justify = "right"
        for i, name in enumerate(header[1:], start=1):
            drawn.add_row(name, *(row[i] for row in rows))
    console.print(drawn)


#: The per-stage lists in a pipeline run's train records that stage_table averages.
_STAGE_KEYS = ("stage_rank", "stage_comm_time", "stage_sync_end", "stage_idle_time", "stage_p2p_bytes")


def stage_table(loaded: list[tuple[str, dict, list[dict]]]) -> str:
    """Per pipeline stage (runs with --pp > 1): mean rank, sync time and when the sync ends
    (seconds from the step's start), idle time and bytes to the neighbour stages, over
    compressed steps (all steps, for runs that never compress), leaving out the first 5%."""
    lines = []
    for name, _, records in loaded:
        train = [r for r in records if r.get("kind") == "train" and "stage_rank" in r]
        timed = [r for r in train[len(train) // 20 :] if r["phase"] == "compress"] or train[len(train) // 20 :]
        if not timed:
            continue
        for p in range(len(timed[0]["stage_rank"])):
            mean = {key: sum(r.get(key, [0.0] * (p + 1))[p] for r in timed) / len(timed) for key in _STAGE_KEYS}
            uncompressed = sum(1 for r in timed if r["stage_rank"][p] == 0) / len(timed)
            lines.append(f"| {name} | {p} | {mean['stage_rank']:.1f} | {uncompressed:.0%} | "
                         f"{mean['stage_comm_time'] * 1e3:.0f} | {mean['stage_sync_end'] * 1e3:.0f} | "
                         f"{mean['stage_idle_time'] * 1e3:.0f} | {mean['stage_p2p_bytes'] / 1e3:.0f} |")
    if not lines:
        return ""
    return ("Pipeline stages, compressed steps (rank 0 = uncompressed; sync end: ms from the step's start; "
            "p2p: activations and their gradients sent to the neighbour stages):\n\n"
            "| run | stage | mean rank | uncompressed | sync comm (ms) | sync ends at (ms) | idle (ms) "
            "| p2p KB/step |\n"
            "|---|---|---|---|---|---|---|---|\n" + "\n".join(lines) + "\n\n")


def _layout(config: dict[str, Any]) -> str:
    world = config.get("world_size")
    pp, tp = config.get("pp", 1), config.get("tp", 1)
    by_tp = f" x {tp} TP ranks" if tp > 1 else ""
    if pp > 1 and world:
        said = [str(config.get("schedule")), f"{config.get('microbatches')} micro-batches",
                *(_tp_options(config) if tp > 1 else [])]
        return f"{world} workers as {pp} pipeline stages x {_replicas(config)} replicas{by_tp} ({', '.join(said)})"
    if tp > 1 and world:
        shard, split = config.get("dp_shard", 1), _tp_options(config)
        return (f"{world} workers as {_replicas(config)} replicas x {shard} shard{'s' if shard > 1 else ''}{by_tp}"
                + (f" ({', '.join(split)})" if split else ""))
    return f"{world} worker" + ("" if world == 1 else "s")


def _tp_options(config: dict[str, Any]) -> list[str]:
    """What a TP run's plan split beyond the blocks: ["vocabulary split", "sequence parallel"]."""
    return [name for key, name in (("vocab_parallel", "vocabulary split"), ("sequence_parallel", "sequence parallel"))
            if config.get(key)]


def _replicas(config: dict[str, Any]) -> int | None:
    """How many replicas a run's gradient was averaged over: the data-parallel ones (under
    HSDP the nodes, dp_replicate; with pipelining world // pp; with tensor parallelism
    divided by tp as well); None where the config does not say."""
    world = config.get("world_size")
    if not world:
        return None
    pp, tp = config.get("pp") or 1, config.get("tp", 1)
    # (FSDP2 or HSDP: TrainConfig.hsdp, read off the saved dict)
    if config.get("dp_shard", 1) != 1 or config.get("dp_replicate") is not None or (tp > 1 and pp == 1):
        return config.get("dp_replicate") or max(1, world // (config.get("dp_shard", 1) * tp))
    return max(1, world // (pp * tp))


def _validation_line(config: dict[str, Any], records: list[dict[str, Any]]) -> str:
    """A sentence on the final evaluation: loss ± standard error, and what it covered."""
    val = [r for r in records if r.get("kind") == "val"]
    if not val:
        return ""
    if val[-1].get("val_loss") is None:
        return "No finite validation loss: the run diverged (see `skipped` and `grad_norm` in metrics.jsonl).\n\n"
    if val[-1].get("val_loss_se") is None:
        return ""
    last = val[-1]
    loss, se = last["val_loss"], last["val_loss_se"]
    tokens = last.get("val_tokens") or 0
    block = config.get("block_size") or 1
    timed = [r["val_time"] for r in val if r.get("val_time") is not None]
    return (f"Validation loss {loss:.4f} ± {se:.4f} (standard error, {se / loss:.2%} of the loss) over "
            f"{tokens // block:,} blocks of {block} tokens ({tokens:,} tokens), the same blocks at every "
            f"evaluation" + (f"; {sum(timed) / len(timed):.1f} s per evaluation" if timed else "") + ".\n\n")


def memory_table(loaded: list[tuple[str, dict, list[dict]]]) -> str:
    """Each run's "memory" record (rank 0's, at the end of the run) as a markdown table:
    the EDGC state it held (error feedback, Q and the window's sums), all it held of
    parameters, optimiser and EDGC state, and its peak; "" when no run has one."""
    rows = []
    for name, _, records in loaded:
        memory = next((r for r in reversed(records) if r.get("kind") == "memory"), None)
        if memory is not None:
            rows.append(f"| {name} | {memory.get('compression_mb', 0.0):.2f} | "
                        f"{memory.get('state_mb', math.nan):.1f} | {memory.get('peak_mb', math.nan):.0f} |")
    if not rows:
        return ""
    return ("Memory of rank 0 at the end of the run (MB; the peak is CUDA memory allocated, or on the CPU the "
            "process's resident set):\n\n| run | EDGC state | parameters, optimiser and EDGC state | peak |\n"
            "|---|---|---|---|\n" + "\n".join(rows) + "\n\n")


def write_summary(run_dir: str | Path) -> Path:
    """Write summary.md and the plots of one run folder; returns summary.md's path."""
    run_dir = Path(run_dir)
    config, records = load_run(run_dir)
    s = summarize(run_dir.name, config, records)
    from edgc.train.plots import plot_runs

    plot_runs([(s.method, records)], run_dir)
    if _replicas(config) == 1:  # (what is counted then crosses no link: a ring of one sends nothing)
        bytes_line = "Bytes: none cross a link, with one replica.\n\n"
    else:
        ratio = s.total_bytes_uncompressed / s.total_bytes if s.total_bytes else 1.0
        bytes_line = (f"Bytes: {s.total_bytes / 1e6:.1f} MB sent per replica (all its stages and TP ranks) against "
                      f"{s.total_bytes_uncompressed / 1e6:.1f} MB for uncompressed all-reduce "
                      f"({ratio:.2f}x fewer).\n\n")
    if math.isfinite(s.mean_busiest_share):
        split = any("expert_bytes" in r for r in records)
        bytes_line += ("Experts: " + (f"{s.total_expert_bytes / 1e6:.1f} MB of those bytes averaged the experts' "
                                      f"gradients, {(s.total_bytes - s.total_expert_bytes) / 1e6:.1f} MB the dense "
                                      "parameters'; " if split else "")
                       + f"the tokens' all-to-all sent {s.total_a2a_bytes / 1e6:.1f} MB per worker (activations, "
                       f"not compressed); the busiest expert took {s.mean_busiest_share:.1%} of the assignments on "
                       f"average.\n\n")
    text = (
        f"# Run {run_dir.name}\n\n"
        f"{config['method']} on {config['preset']}, {_layout(config)}, {s.steps} steps.\n\n"
        + table([s]) + "\n"
        + _validation_line(config, records)
        + stage_table([(run_dir.name, config, records)])
        + bytes_line
        + memory_table([(run_dir.name, config, records)])
        + "![loss](loss.png)\n![entropy](entropy.png)\n![rank](rank.png)\n![bytes](bytes.png)\n"
        + ("![stages](stages.png)\n" if (run_dir / "stages.png").is_file() else "")
    )
    path = run_dir / "summary.md"
    path.write_text(text)
    return path
