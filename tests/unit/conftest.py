"""Fixtures of the single-process unit tests."""

import gc

import pytest
import torch.distributed as dist


@pytest.fixture
def one_process_group(tmp_path):
    """A gloo process group of one rank (a file store in tmp_path), for tests of a hook or
    state that needs a group but no peers."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    # Collect the test's garbage here, on the main thread, before and after the group goes:
    # otherwise a later collection may run on one of gloo's threads (torch's hook runs
    # Python callbacks there) and free the last reference to a process group from its own
    # worker thread, which joins itself and aborts the process (SIGABRT, seen under load).
    gc.collect()
    dist.barrier()  # (every collective issued is done)
    dist.destroy_process_group()
    gc.collect()


@pytest.fixture
def as_edgc_0_1():
    """A function: a nested EDGCConfig mapping (EDGCConfig.to_dict) as edgc 0.1 saved it in a
    run's config: flat, with its own warm-up fields and the fields of removed policies."""
    from edgc.config import EDGCConfig

    def convert(values: dict) -> dict:
        flat = EDGCConfig.from_dict(values).to_flat()
        renamed = {"critical_lr_drop_factor": "lr_drop_factor", "cqm_smoothing": "entropy_smoothing",
                   "schedule_ranks": "rank_schedule"}
        new = ("warmup", "warmup_max_error", "warmup_min_steps")  # (0.1 had none of these)
        out = {renamed.get(k, k): v for k, v in flat.items() if k not in new}
        mode = flat["warmup"]
        out["warmup_error_check"] = mode == "release-check"
        out["warmup_max_error"] = flat["warmup_max_error"] if mode == "gradient" else None
        return {**out, "error_budget": 0.05, "spectral_headroom": 1.5}

    return convert
