"""edgc.checkpoint across 2 gloo processes: every replica's state gathered in rank order,
and each handed back its own, by scatter or from a file."""

import torch

from harness import assert_same, run_workers
from workers import replicas_check, resize_check


def test_gather_scatter_and_file_round_trip(tmp_path):
    results = run_workers(replicas_check, 2, str(tmp_path))
    mine = [r["mine"] for r in results]
    assert results[0]["on_one"] is None and results[1]["on_one"] is not None
    assert_same(results[1]["on_one"], mine, "gathered on 1")
    assert_same(results[0]["on_all"], mine, "gathered on all")
    assert_same(results[1]["on_all"], mine, "gathered on all")
    # the error feedback differs between replicas, so each must get its own back
    errors = [m["compression"]["groups"][0]["error"] for m in mine]
    assert not torch.equal(errors[0], errors[1])
    for r, own in zip(results, mine, strict=True):
        assert_same(r["scattered"], own, "scattered")
        assert_same(r["from_file"], own, "from the file")
        assert "holds the states of 1 replicas, and this job has 2" in r["wrong_length"]
    assert results[0]["gathered"] is None
    assert results[1]["gathered"] == [[0.0] * 3, [1.0] * 3]


def test_a_job_of_another_size_resumes_the_states_with_the_mean_error_feedback(tmp_path):
    saved = [r["mine"] for r in run_workers(replicas_check, 2, str(tmp_path))]  # (edgc_state.pt at step 3)
    assert saved[0]["phase"] == "compress" and saved[0]["step"] == 3
    for world in (1, 3):
        results = run_workers(resize_check, world, str(tmp_path))
        for replica, r in enumerate(results):
            assert f"holds the states of 2 replicas, and this job has {world}" in r["refused"]
            loaded = r["loaded"]
            assert (loaded["world_size"], loaded["replica"]) == (world, replica)
            assert (loaded["step"], loaded["phase"], loaded["applied_rank"]) == \
                (saved[0]["step"], saved[0]["phase"], saved[0]["applied_rank"])
            assert_same(loaded["policy"], saved[0]["policy"], "the policy's state")
            for g, group in enumerate(loaded["compression"]["groups"]):
                old = [s["compression"]["groups"][g] for s in saved]
                assert torch.equal(group["q"], old[0]["q"]) and torch.equal(old[0]["q"], old[1]["q"])
                if group["error"] is None:
                    continue
                # the mean of the two replicas' error feedback: what is still to be sent, on average
                mean = (old[0]["error"].double() + old[1]["error"].double()) / 2
                assert group["error"].dtype == old[0]["error"].dtype
                assert torch.equal(group["error"], mean.to(group["error"].dtype))
            # compression goes on at once: no second warm-up
            assert r["phase"] == "compress" and r["step"] == 6
            assert r["compressed_steps"] == saved[0]["stats"]["compressed_steps"] + 3
            assert all(rank > 0 for rank in r["ranks"]), r["ranks"]
        assert len({tuple(r["ranks"]) for r in results}) == 1  # one rank history on every replica
