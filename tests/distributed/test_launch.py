"""The local launcher: results by rank, worker errors surfaced, hangs killed."""

import os
import signal
import time

import pytest
import torch.distributed as dist

from edgc.train.launch import START_METHOD_ENV, WorkerError, run_local


def _sum_ranks(rank, world):
    import torch

    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return (rank, world, float(t), os.environ.get("EDGC_TEST_MARK"), os.getcwd())


def _fail_on_one(rank, world):
    if rank == 1:
        raise RuntimeError("boom on rank 1")
    dist.barrier()  # rank 0 would wait forever for rank 1
    return rank


def _killed_beside_an_error(rank, world):
    # rank 0 fails in words the launcher does not know as a peer's failure; rank 1 is then
    # killed from outside, as by the OOM killer: the kill is what the user must hear of
    if rank == 1:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError("some collective error in words of its own")


def _hang(rank, world):
    time.sleep(600)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_results_come_back_by_rank(monkeypatch, tmp_path, method):
    monkeypatch.setenv(START_METHOD_ENV, method)
    monkeypatch.setenv("EDGC_TEST_MARK", method)  # (set after any fork server started: each worker sees it)
    monkeypatch.chdir(tmp_path)
    assert run_local(_sum_ranks, 2, timeout=60) == [(r, 2, 1.0, method, str(tmp_path)) for r in range(2)]


def test_an_unknown_start_method_is_refused(monkeypatch):
    monkeypatch.setenv(START_METHOD_ENV, "fork")
    with pytest.raises(ValueError, match="EDGC_START_METHOD='fork': use spawn or forkserver"):
        run_local(_sum_ranks, 2)


def test_worker_error_is_reported_and_peers_are_killed():
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="boom on rank 1"):
        run_local(_fail_on_one, 2, timeout=120)
    assert time.monotonic() - t0 < 60


def test_a_worker_killed_from_outside_is_named_before_a_peers_error():
    with pytest.raises(WorkerError, match="worker 1 was killed by SIGKILL") as info:
        run_local(_killed_beside_an_error, 2, timeout=120)
    assert info.value.how == "signal" and "words of its own" in info.value.details


def test_hang_is_killed_at_timeout():
    with pytest.raises(WorkerError, match="did not finish in time"):
        run_local(_hang, 2, timeout=8)


def test_bad_nproc():
    with pytest.raises(ValueError, match="nproc"):
        run_local(_sum_ranks, 0)
