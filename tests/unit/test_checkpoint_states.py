"""edgc.checkpoint in one process: the file round trip continues exactly, and a file from
another world size, another step, or a damaged one is refused with a clear error."""

import pytest
import torch

from edgc import EDGCConfig, EDGCState, edgc_hook
from edgc.checkpoint import (
    FILE_NAME,
    gather_states,
    load_states,
    read_states,
    resize_states,
    restore_state,
    save_states,
)
from edgc.comm.buckets import sync_with_hook

CONFIG = EDGCConfig(warmup_steps=1, window=2, max_rank=2, min_rank=1, iteration_sample_rate=1.0)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.Linear(10, 6))


def _steps(model: torch.nn.Module, state: EDGCState, start: int, n: int) -> None:
    """n steps of plain SGD with the gradient synchronised through edgc_hook."""
    for step in range(start, start + n):
        x = torch.randn(8, 12, generator=torch.Generator().manual_seed(step))
        model.zero_grad()
        model(x).square().mean().backward()
        sync_with_hook(list(model.parameters()), state, edgc_hook, cap_bytes=200)
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad


def test_save_then_load_continues_exactly(one_process_group, tmp_path):
    straight, s_state = _model(), EDGCState(None, CONFIG)
    _steps(straight, s_state, 0, 6)

    model, state = _model(), EDGCState(None, CONFIG)
    _steps(model, state, 0, 3)
    assert state.phase == "compress"
    assert save_states(state, tmp_path, step=3) == tmp_path / FILE_NAME
    weights = {k: v.clone() for k, v in model.state_dict().items()}

    resumed, r_state = _model(seed=1), EDGCState(None, CONFIG)
    resumed.load_state_dict(weights)
    load_states(r_state, tmp_path, step=3)
    _steps(resumed, r_state, 3, 3)
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    assert r_state.stats().compressed_steps == s_state.stats().compressed_steps == 5


def test_a_file_of_another_world_size_or_step_is_refused(one_process_group, tmp_path):
    state = EDGCState(None, CONFIG)
    _steps(_model(), state, 0, 2)
    save_states(state, tmp_path, step=2)
    data = read_states(tmp_path)
    assert data["world_size"] == 1 and len(data["replicas"]) == 1
    with pytest.raises(ValueError, match="saved at step 2, and training resumes at step 5"):
        load_states(EDGCState(None, CONFIG), tmp_path, step=5)
    two = data["replicas"] * 2
    with pytest.raises(ValueError, match="holds the states of 2 replicas, and this job has 1"):
        restore_state(EDGCState(None, CONFIG), two)
    torch.save({**data, "replicas": two, "world_size": 2}, tmp_path / FILE_NAME)
    with pytest.raises(ValueError, match="2 replicas, and this job has 1"):
        load_states(EDGCState(None, CONFIG), tmp_path)


def test_resized_states_share_the_agreed_values_and_average_the_error_feedback(one_process_group):
    a, b = EDGCState(None, CONFIG), EDGCState(None, CONFIG)
    _steps(_model(0), a, 0, 3)
    _steps(_model(1), b, 0, 3)  # (another start: another error feedback)
    states = [a.state_dict(), b.state_dict()]
    three = resize_states(states, 3)
    assert [(s["world_size"], s["replica"]) for s in three] == [(3, 0), (3, 1), (3, 2)]
    for group, ga, gb in zip(three[1]["compression"]["groups"], *(s["compression"]["groups"] for s in states),
                             strict=True):
        assert torch.equal(group["q"], ga["q"])
        if ga["error"] is not None:
            assert torch.equal(group["error"], ((ga["error"].double() + gb["error"].double()) / 2).float())
    assert three[2]["policy"] == states[0]["policy"] and three[0]["step"] == 3
    # each replica its own tensors; the list given is not changed
    three[0]["compression"]["groups"][0]["error"].add_(1.0)
    assert not torch.equal(three[0]["compression"]["groups"][0]["error"], three[1]["compression"]["groups"][0]["error"])
    assert states[0]["world_size"] == 1 and resize_states(states, 2) is states
    # resize=True at the doors: a job of one replica goes on from the two
    one = EDGCState(None, CONFIG)
    restore_state(one, states, resize=True)
    assert one.state_dict()["compression"]["groups"][0]["error"].equal(three[1]["compression"]["groups"][0]["error"])
    with pytest.raises(ValueError, match="world must be at least 1"):
        resize_states(states, 0)
    with pytest.raises(ValueError, match="non-empty list"):
        resize_states([], 2)
    with pytest.raises(ValueError, match="not an EDGC state"):
        resize_states([{"x": 1}, {"x": 2}], 1)
    later = EDGCState(None, CONFIG)
    _steps(_model(1), later, 0, 4)
    with pytest.raises(ValueError, match="replica 1's EDGC state is at step 4 .*replica 0's at step 3"):
        resize_states([states[0], later.state_dict()], 3)


def test_a_damaged_missing_or_foreign_file_gives_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no EDGC state at"):
        read_states(tmp_path)
    torch.save({"weights": torch.zeros(3)}, tmp_path / FILE_NAME)
    with pytest.raises(ValueError, match="not an EDGC state file"):
        read_states(tmp_path)
    for other in (b"a text file\n", bytes(range(256)) * 8, b""):  # not even a torch file (it said BadZipFile)
        (tmp_path / FILE_NAME).write_bytes(other)
        with pytest.raises(ValueError, match="not an EDGC state file"):
            read_states(tmp_path)
    save_states(EDGCState(None, CONFIG), tmp_path)  # (no group: a world of one)
    raw = bytearray((tmp_path / FILE_NAME).read_bytes())
    at = raw.find(b"edgc-replica-states")
    raw[at] ^= 0xFF
    (tmp_path / FILE_NAME).write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="checksum"):
        read_states(tmp_path / FILE_NAME)
    (tmp_path / FILE_NAME).write_bytes(bytes(raw[: len(raw) // 2]))
    with pytest.raises(ValueError, match="corrupt or truncated"):
        read_states(tmp_path)


def test_without_torch_distributed_the_list_is_this_process_alone():
    state = EDGCState(None, CONFIG)
    states = gather_states(state)
    assert len(states) == 1 and states[0]["replica"] == 0
    restore_state(EDGCState(None, CONFIG), states)
