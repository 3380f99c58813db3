"""A script that trains with edgc_hook over gloo and simply ends, as users' scripts do
(no destroy_process_group), exits 0.

Before the hook kept its latest collectives' handles, a gloo thread could drop the last
reference to a finished all-reduce during interpreter shutdown, and the process aborted
with "terminate called without an active exception" after its training had finished (seen
in CI through examples/hf_trainer.py)."""

import subprocess
import sys
import textwrap

import pytest

from edgc.train.launch import free_port

SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from edgc import EDGCConfig, EDGCState, edgc_hook
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    ddp = DDP(model, bucket_cap_mb=0.005)
    state = EDGCState(None, EDGCConfig(max_rank=4, warmup_steps=1))
    ddp.register_comm_hook(state, edgc_hook)
    for _ in range(4):
        ddp(torch.randn(16, 32)).square().mean().backward()
    assert state.stats().compressed_steps > 0
""")


@pytest.mark.slow
def test_training_scripts_end_without_an_abort(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    for attempt in range(4):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                               "--master-port", str(free_port()), str(script)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and "terminate called" not in proc.stderr, \
            f"run {attempt}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
