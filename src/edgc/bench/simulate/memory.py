"""`edgc simulate --memory`: the bytes edgc's hook state takes on each GPU, before a run.

One GPU's gradient is laid out as `stage_gradients` lays it out (tensor and pipeline
parallelism: a TP rank's shards, one stage's parameters), then sharded on the first
dimension over the FSDP2 shard group (`dp_shard`, rounded up as FSDP2 pads it), and
counted by `edgc.memory.state_bytes` for each state_dtype, beside what torch's
powerSGD_hook would keep for the same gradient (a DDP hook; torch has none for FSDP).
Each row is the stage that holds the most.
"""

from __future__ import annotations

import torch

from edgc.bench.simulate.layout import stage_gradients
from edgc.config import STATE_DTYPES, EDGCConfig
from edgc.memory import state_bytes, torch_hook_bytes
from edgc.models.gpt2 import GPT, GPTConfig, build_model

__all__ = ["DTYPES", "gpt_model", "gpu_shapes", "memory_report"]

#: Gradient dtypes by the names the CLI takes.
DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def gpt_model(spec: str) -> GPT:
    """A GPT-2-shaped model on the meta device from "LAYERS,WIDTH" (a vocabulary of 50257,
    1024 positions, heads of 128): the shapes of a model no preset names. Raises ValueError
    for a malformed spec."""
    try:
        layers, width = (int(v) for v in spec.split(","))
    except ValueError:
        raise ValueError(f"--gpt takes LAYERS,WIDTH (two integers, e.g. 32,4096), got {spec!r}") from None
    if layers < 1 or width < 128 or width % 128:
        raise ValueError(f"--gpt {spec}: at least one layer, and a width that is a multiple of 128")
    config = GPTConfig(n_layer=layers, n_head=width // 128, n_embd=width, vocab_size=50257, block_size=1024)
    with torch.device("meta"):
        return GPT(config)


def gpu_shapes(model: GPT, tp: int, pp: int, dp_shard: int, tp_layout: str = "vocab") -> list[list[tuple[int, ...]]]:
    """Per pipeline stage, the shapes of the gradient one GPU of that stage synchronises."""
    if dp_shard < 1:
        raise ValueError(f"dp_shard must be at least 1, got {dp_shard}")
    stages = stage_gradients(model, tp, pp, tp_layout)
    return [[(-(-s[0] // dp_shard), *s[1:]) for s in stage.shapes] for stage in stages]


def memory_report(model: GPT, name: str, dtype: str, tp: int, pp: int, dp_shard: int, rank: int,
                  tp_layout: str = "vocab") -> str:
    """The markdown table `edgc simulate --memory` prints (see module doc)."""
    stages = gpu_shapes(model, tp, pp, dp_shard, tp_layout)
    grad_dtype = DTYPES[dtype]
    params = sum(p.numel() for p in model.parameters())
    layout = "DDP" if tp == pp == dp_shard == 1 else f"TP {tp} x PP {pp} x FSDP2 shards {dp_shard}"
    lines = [f"## Hook state per GPU: {name} ({params / 1e9:.2f} B parameters), {layout}, {dtype} gradients, "
             f"rank {rank}", "",
             "| state_dtype | parameters on the GPU | error feedback (GB) | Q (GB) | total (GB) | bytes per "
             "parameter | step workspace (GB, transient) | torch powerSGD_hook (GB) |",
             "|---|---|---|---|---|---|---|---|"]
    for state_dtype in STATE_DTYPES:
        config = EDGCConfig(state_dtype=state_dtype, max_rank=rank)
        counted = [state_bytes(shapes, grad_dtype, config, rank) for shapes in stages]
        worst = max(range(len(stages)), key=lambda i: counted[i].total)
        held, shapes = counted[worst], stages[worst]
        torch_held = torch_hook_bytes(shapes, grad_dtype, rank)
        lines.append(f"| {state_dtype} | {_count(held.elements)} | {held.error / 1e9:.2f} | {held.q / 1e9:.3f} | "
                     f"{held.total / 1e9:.2f} | {held.total / held.elements:.2f} | {held.workspace / 1e9:.3f} | "
                     f"{torch_held / 1e9:.2f} |")
    lines += ["", "(edgc.memory.state_bytes; the window's sums counted at most. Rows: the stage that holds the "
              f"most of {len(stages)}. torch's hook: its error feedback of every element and its P and Q, both in "
              "the gradient's dtype.)", ""]
    return "\n".join(lines)


def _count(n: int) -> str:
    """A parameter count in billions, or millions below 0.1 billion."""
    return f"{n / 1e9:.3f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def named_model(preset: str | None, gpt: str | None) -> tuple[GPT, str]:
    """The model `--memory` counts: `--gpt LAYERS,WIDTH`, else the preset, on the meta device."""
    if gpt is not None:
        return gpt_model(gpt), f"GPT {gpt.replace(',', ' x ')}"
    assert preset is not None
    return build_model(preset, device="meta"), preset


def check_layout(tp: int, pp: int, dp_shard: int) -> None:
    """Raise ValueError for a degree below 1."""
    for flag, value in (("--tp", tp), ("--pp", pp), ("--dp-shard", dp_shard)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
