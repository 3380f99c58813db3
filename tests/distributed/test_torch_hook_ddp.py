"""torch's powerSGD_hook (edgc.comm.baselines) under DDP on two gloo processes: a resumed
job's first step has DDP's initial buckets, not the rebuilt ones the checkpoint was saved
in, and must still repeat the uninterrupted run."""

import torch

import workers
from harness import run_workers


def test_torch_powersgd_resumes_exactly_across_ddp_rebucketing():
    out = run_workers(workers.torch_powersgd_resume_check, 2, 6, timeout=240)
    for r in out:
        first, rebuilt = r["resumed_layouts"][0], r["resumed_layouts"][1]
        # what this test is about: the first resumed step buckets differently from the
        # checkpoint's step (then DDP rebuilds to that layout), over several buckets
        assert len(r["saved_layout"]) >= 2
        assert first != r["saved_layout"] and rebuilt == r["saved_layout"]
        # saved per parameter: torch's buffer cut at DDP's own offsets
        assert r["saved_error"].keys() == r["cut"].keys()
        for i, e in r["cut"].items():
            assert torch.equal(r["saved_error"][i], e)
        assert r["resumed"] == r["straight"]
        assert torch.equal(r["resumed_params"], r["straight_params"])
