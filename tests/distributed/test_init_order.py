"""Where users build the state: before the process group, in another process, on a group
of its own; and whose state a replica may load."""

import torch

import workers
from edgc import EDGCConfig, EDGCState
from harness import run_workers
from test_hook_ddp import DYNAMIC


def test_state_built_before_the_group_and_pickled_into_workers_syncs():
    # Lightning's recipe: the state is made in the launching process, with no group, and
    # travels to the workers by pickle. It must bind the workers' group at its first step.
    state = EDGCState(None, EDGCConfig.from_dict(DYNAMIC))
    results = run_workers(workers.train_given_state, 2, state, 16, timeout=240)
    assert [r["world_size"] for r in results] == [2, 2]
    assert results[0]["stats"].compressed_steps == 12
    assert torch.equal(results[0]["params"], results[1]["params"])  # replicas did not drift


def test_state_built_before_init_process_group_syncs(tmp_path):
    results = run_workers(workers.state_before_init, 2, DYNAMIC, str(tmp_path / "store"), 16, timeout=240)
    assert [r["world_size"] for r in results] == [2, 2]
    assert torch.equal(results[0]["params"], results[1]["params"])
    # and it trains exactly like a state built after the group
    after = run_workers(workers.train_and_report, 2, DYNAMIC, 16, timeout=240)
    assert torch.equal(results[0]["params"], after[0]["params"])


def test_state_on_its_own_group_pickles_and_asks_for_the_group_back():
    results = run_workers(workers.pickle_own_group, 2, DYNAMIC, timeout=240)
    for r in results:
        assert r["group_after"] is None
        assert "set state.process_group" in r["error"]
    assert torch.equal(results[0]["params"], results[1]["params"])


def test_state_dict_records_its_replica_and_refuses_another():
    results = run_workers(workers.replica_check, 2, DYNAMIC, timeout=240)
    assert [r["replica"] for r in results] == [0, 1]
    assert "saved by replica 0" in results[1]["refused"] and "strict_replica=False" in results[1]["refused"]
    assert results[1]["loaded_other"] == 6
