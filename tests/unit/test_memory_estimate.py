"""edgc.memory.state_bytes, the state's bytes told before a run, against the state the
hook then holds; and `edgc simulate --memory`, which prints it per GPU for a named model
and layout."""

import math
import subprocess
import sys

import pytest
import torch

from edgc import EDGCConfig, EDGCState, edgc_hook
from edgc.bench.simulate.memory import gpu_shapes
from edgc.comm.buckets import sync_with_hook
from edgc.memory import state_bytes, torch_hook_bytes
from edgc.models import build_model


class _Model(torch.nn.Module):
    """A long matrix (an embedding's shape: long_rank_factor applies), two square ones,
    a bias and a matrix too small to compress."""

    def __init__(self, dtype):
        super().__init__()
        self.emb = torch.nn.Parameter(torch.randn(300, 16, dtype=dtype) * 0.1)
        self.a = torch.nn.Linear(16, 16, dtype=dtype)
        self.b = torch.nn.Linear(16, 16, bias=False, dtype=dtype)
        self.tiny = torch.nn.Parameter(torch.randn(3, 2, dtype=dtype))

    def forward(self, idx):
        x = self.emb[idx]
        return (self.b(self.a(x)) * self.tiny.sum()).float().square().mean()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("state_dtype", ["native", "float32", "bf16"])
@pytest.mark.parametrize("policy", ["static", "noise", "critical"])
def test_the_estimate_is_what_the_hook_then_holds(dtype, state_dtype, policy):
    torch.manual_seed(0)
    model = _Model(dtype)
    config = EDGCConfig(policy=policy, max_rank=4, warmup="fixed", warmup_steps=1, iteration_sample_rate=1.0,
                        window=2, state_dtype=state_dtype, **({} if policy == "static" else {"min_rank": 4}))
    state = EDGCState(None, config)
    for step in range(5):
        model.zero_grad()
        model(torch.randint(0, 300, (8,), generator=torch.Generator().manual_seed(step))).backward()
        sync_with_hook(list(model.parameters()), state, edgc_hook, cap_bytes=1 << 20)
    assert state.stats().compressed_steps == 4
    est = state_bytes([tuple(p.shape) for p in model.parameters()], dtype, config, rank=4)
    held = state.sync.compression
    assert est.compressed == sum(len(g.slots) * g.shape[0] * g.shape[1] for g in held.groups.values())
    assert est.error + est.q == held.nbytes  # error feedback and Q, exactly
    assert est.error + est.q <= state.stats().state_bytes <= est.total  # (the window's sums: at most)
    assert held.workspace.nbytes == 0  # (between steps)


def test_bytes_per_parameter_follow_the_kept_dtypes_and_torch_keeps_every_element():
    shapes = [(1024, 1024), (1024,)]
    f32 = state_bytes(shapes, torch.float32, EDGCConfig(max_rank=8), rank=8)
    bf16 = state_bytes(shapes, torch.bfloat16, EDGCConfig(max_rank=8), rank=8)
    assert (f32.error, f32.q, f32.compressed) == (1024 * 1024 * 4, 1024 * 8 * 4, 1024 * 1024)
    assert (bf16.error, bf16.q) == (1024 * 1024 * 2, 1024 * 8 * 4)  # (Q in the working dtype)
    # the workspace: one unit's matrices of the shape, in the working dtype (float32)
    assert f32.workspace == 1024 * 1024 * 4 and bf16.workspace == 1024 * 1024 * 4
    layers = [(1024, 1024)] * 8 + [(4096, 1024)] * 8  # four units: two of each shape a unit
    assert state_bytes(layers, torch.bfloat16, EDGCConfig(max_rank=8)).workspace == 2 * 4096 * 1024 * 4
    assert state_bytes(layers, torch.bfloat16, EDGCConfig(max_rank=8, max_units=1)).workspace == 8 * 4096 * 1024 * 4
    # torch: every element's error (the bias too) and P and Q, in the gradient's dtype
    assert torch_hook_bytes(shapes, torch.bfloat16, 8) == (1024 * 1024 + 1024 + 2048 * 8) * 2
    with pytest.raises(ValueError, match="rank must be at least 1"):
        state_bytes(shapes, torch.float32, rank=0)


def test_fsdp_shards_divide_the_first_dimension_rounded_up():
    model = build_model("tiny", device="meta")
    whole = gpu_shapes(model, 1, 1, 1)
    sharded = gpu_shapes(model, 1, 1, 3)
    assert len(whole) == len(sharded) == 1
    for s, t in zip(whole[0], sharded[0], strict=True):
        assert t == (math.ceil(s[0] / 3), *s[1:])
    with pytest.raises(ValueError, match="dp_shard"):
        gpu_shapes(model, 1, 1, 0)


def _simulate(*args):
    return subprocess.run([sys.executable, "-m", "edgc", "simulate", "--memory", *args], capture_output=True,
                          text=True, timeout=120)


def test_simulate_memory_prints_the_state_per_gpu_for_each_state_dtype():
    done = _simulate("--preset", "small", "--tp", "1", "--pp", "1", "--grad-dtype", "float32", "--rank-max", "8")
    assert done.returncode == 0, done.stderr
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in done.stdout.splitlines()
            if line.startswith("| native") or line.startswith("| float32") or line.startswith("| bf16")}
    model = build_model("small", device="meta")
    shapes = [tuple(p.shape) for p in model.parameters()]
    est = state_bytes(shapes, torch.float32, EDGCConfig(max_rank=8), rank=8)
    assert set(rows) == {"native", "float32", "bf16"}
    assert float(rows["native"][3]) == pytest.approx(est.total / 1e9, abs=0.006)  # total (GB), 2 decimals
    assert float(rows["native"][4]) == pytest.approx(est.total / est.elements, abs=0.006)  # bytes per parameter
    assert float(rows["bf16"][4]) < float(rows["native"][4])
    hsdp = _simulate("--gpt", "8,1024", "--tp", "2", "--pp", "2", "--dp-shard", "4")
    assert hsdp.returncode == 0, hsdp.stderr
    assert "TP 2 x PP 2 x FSDP2 shards 4" in hsdp.stdout and "GPT 8 x 1024" in hsdp.stdout
    bad = _simulate("--gpt", "8x1024")
    assert bad.returncode != 0 and "LAYERS,WIDTH" in bad.stderr
    plain = subprocess.run([sys.executable, "-m", "edgc", "simulate", "--dp-shard", "2"], capture_output=True,
                           text=True, timeout=120)
    assert plain.returncode != 0 and "go with --memory" in plain.stderr
