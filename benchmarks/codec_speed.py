"""The one-byte wire's codec against a plain cast, on the same tensors in the same run.

edgc's default wire (EDGCConfig.wire = "int8") quantizes every buffer a step sums to one
byte an element with a bfloat16 scale per block of 32 (edgc.comm.wire). This measures,
for a gradient buffer of `--numel` elements in each `--dtype`:

    quantize    wire.quantize: the buffer to codes and scales (what a replica sends)
    dequantize  wire.dequantize: codes and scales back to the buffer's dtype
    2-sum       wire.gathered_sum's local work with 2 replicas: quantize one buffer, then
                dequantize two and add them into it (the all-gather between is left out)
    cast        the same buffer cast to bfloat16, and (decode) bfloat16 back to its dtype:
                what the "bf16" wire and a bf16 all-reduce do instead

Each is timed `--repeats` times after a warm-up (CUDA: synchronised around each), and the
median is reported as time and as throughput over the buffer's own bytes (numel x its
element size), beside its ratio to the cast. `--against FILE` times another version of
edgc/comm/wire.py beside this one's, in the same run and on the same tensors (an older
commit's: `git show COMMIT:src/edgc/comm/wire.py > /tmp/wire_old.py`), its rows named
"FILE: operation". This is a benchmark, not a test: nothing is asserted.

    python3 benchmarks/codec_speed.py [--numel 8388608] [--dtype float32,bfloat16]
                                      [--wire int8] [--repeats 20] [--device cpu]
                                      [--threads N] [--against FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from edgc.comm import wire as edgc_wire
from edgc.comm.wire import codec, quantize

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The median seconds of `repeats` calls of `fn`, after two untimed ones."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def codec_ops(wire_module: Any, x: torch.Tensor, code: Any, other: torch.Tensor) -> list[tuple[str, Callable]]:
    """The codec's operations on `x` with `wire_module`'s quantize and dequantize, as its
    gathered_sum uses them: into buffers given (`out=`, `add=`) where its dequantize takes
    them, else as new tensors added up (the codec of before 2026-11-27)."""
    numel, dtype, device = x.numel(), x.dtype, x.device
    quant, dequant = wire_module.quantize, wire_module.dequantize
    in_place = "out" in inspect.signature(dequant).parameters
    sum_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    data, flat, decoded = quant(x, code), x.clone(), torch.empty_like(x)

    def two_sum() -> None:  # (as wire.gathered_sum does around its all-gather)
        mine = quant(flat, code)
        if not in_place:
            total = dequant(mine, numel, code, sum_dtype)
            total += dequant(other, numel, code, sum_dtype)
            flat.copy_(total)
            return
        total = flat if dtype == sum_dtype else torch.empty(numel, dtype=sum_dtype, device=device)
        dequant(mine, numel, code, sum_dtype, out=total)
        dequant(other, numel, code, sum_dtype, out=total, add=True)
        if total is not flat:
            flat.copy_(total)

    def decode() -> object:
        return dequant(data, numel, code, dtype, out=decoded) if in_place else dequant(data, numel, code, dtype)

    return [("quantize", lambda: quant(x, code)), ("dequantize", decode), ("2-sum", two_sum)]


def measure(numel: int, dtype: torch.dtype, wire: str, device: torch.device, repeats: int,
            against: tuple[str, Any] | None = None) -> list[tuple[str, float]]:
    """(name, seconds) of each operation on one buffer of `numel` elements in `dtype`."""
    code = codec(wire)
    assert code is not None
    gen = torch.Generator(device=device).manual_seed(0)
    x = (1e-3 * torch.randn(numel, generator=gen, device=device)).to(dtype)
    other = quantize((1e-3 * torch.randn(numel, generator=gen, device=device)).to(dtype), code)
    half = x.to(torch.bfloat16)
    ops: list[tuple[str, Callable[[], object]]] = codec_ops(edgc_wire, x, code, other)
    if against is not None:
        ops += [(f"{against[0]}: {name}", fn) for name, fn in codec_ops(against[1], x, code, other)]
    ops += [("cast to bf16", lambda: x.to(torch.bfloat16, copy=True)),
            ("cast from bf16", lambda: half.to(dtype, copy=True))]
    return [(name, timed(fn, device, repeats)) for name, fn in ops]


def load_wire(path: str) -> Any:
    """The module in `path`, a version of edgc/comm/wire.py."""
    spec = importlib.util.spec_from_file_location("wire_against", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=8 * 2**20, help="elements of the buffer (default 8M)")
    parser.add_argument("--dtype", default="float32,bfloat16", help="comma-separated: float32, bfloat16, float16")
    parser.add_argument("--wire", default="int8", choices=("int8", "fp8"))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (default: torch's)")
    parser.add_argument("--against", metavar="FILE", help="another version of edgc/comm/wire.py to time beside it")
    args = parser.parse_args(argv)
    if args.numel < 1 or args.repeats < 1:
        parser.error("--numel and --repeats must be positive")
    dtypes = [d.strip() for d in args.dtype.split(",")]
    for name in dtypes:
        if name not in DTYPES:
            parser.error(f"--dtype {name!r}: choose from {', '.join(DTYPES)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    against = (Path(args.against).name, load_wire(args.against)) if args.against else None
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.processor() or 'cpu'}, " \
        f"{torch.get_num_threads()} thread(s)"
    print(f"codec speed: {args.wire} wire, {args.numel:,} elements, median of {args.repeats}, "
          f"torch {torch.__version__} on {args.device} ({where})")
    print()
    print("| dtype | operation | ms | GB/s | vs its cast |")
    print("|---|---|---:|---:|---:|")
    for name in dtypes:
        dtype = DTYPES[name]
        gigabytes = args.numel * torch.empty((), dtype=dtype).element_size() / 1e9
        results = dict(measure(args.numel, dtype, args.wire, device, args.repeats, against))
        for op, seconds in results.items():
            cast = results["cast from bf16" if op.endswith("dequantize") else "cast to bf16"]
            ratio = "" if op.startswith("cast") else f"{seconds / cast:.2f}x"
            print(f"| {name} | {op} | {1e3 * seconds:.3g} | {gigabytes / seconds:.3g} | {ratio} |")


if __name__ == "__main__":
    main()
