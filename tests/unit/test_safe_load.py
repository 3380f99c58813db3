"""Loading never runs code: a file that names a Python function to call on load (a crafted
pickle) is refused at every door edgc reads through, with one line naming the file and
what it holds, and nothing runs; trust=True loads a file one trusts."""

import dataclasses
import io
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from edgc.checkpoint import FILE_NAME, load_states, read_states
from edgc.fsdp import EDGCFSDPState
from edgc.safeload import UnsafeFileError, _held, load_torch
from edgc.train.checkpoint import CHECKPOINT_NAME, load_checkpoint, save_checkpoint

SYSTEM = f"{os.system.__module__}.system"  # (how pickle names os.system: posix.system on Linux)


class _Touch:
    """Unpickled, it would run a shell command that creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


@dataclasses.dataclass
class Note:
    """A harmless object that is not a tensor nor a plain value: only a trusted load takes it."""

    text: str = "hello"


def _states_file(replicas: list) -> dict:
    return {"format": "edgc-replica-states", "version": 1, "world_size": len(replicas), "step": None,
            "replicas": replicas}


def _checkpoint(extra: object) -> dict:
    return {"format": "edgc-checkpoint", "version": 1, "step": 3, "train": {"method": "edgc"}, "extra": extra}


def _assert_refused(exc: pytest.ExceptionInfo, *named: str) -> None:
    message = str(exc.value)
    assert "\n" not in message, message
    assert "is refused" in message and f"it holds {SYSTEM}" in message and "if you trust the file" in message, message
    for name in named:
        assert name in message, message


def test_a_crafted_file_runs_nothing_through_the_helper(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "crafted.pt"
    torch.save({"x": _Touch(marker)}, path)
    with pytest.raises(UnsafeFileError) as exc:
        load_torch(path, what="test file", how="trust=True")
    _assert_refused(exc, f"test file {str(path)!r}", "load it with trust=True")
    assert isinstance(exc.value, ValueError)
    buf = io.BytesIO()
    torch.save([_Touch(marker)], buf)
    with pytest.raises(UnsafeFileError) as exc:
        load_torch(buf.getvalue(), what="the blob of rank 3", how="trust=True")
    _assert_refused(exc, "the blob of rank 3 is refused")
    assert not marker.exists()


def test_a_crafted_state_file_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    torch.save(_states_file([{"comm": _Touch(marker)}]), tmp_path / FILE_NAME)
    with pytest.raises(ValueError) as exc:
        read_states(tmp_path)
    _assert_refused(exc, f"EDGC state {str(tmp_path / FILE_NAME)!r}", "read_states(..., trust=True)")
    with pytest.raises(ValueError) as exc:
        read_states(tmp_path / FILE_NAME, mmap=True)
    _assert_refused(exc, str(tmp_path / FILE_NAME))
    with pytest.raises(ValueError) as exc:
        load_states(object(), tmp_path)
    _assert_refused(exc, "load_states(..., trust=True)")
    assert not marker.exists()


def test_a_crafted_trainer_checkpoint_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    torch.save(_checkpoint(_Touch(marker)), tmp_path / CHECKPOINT_NAME)
    for where in (tmp_path, tmp_path / CHECKPOINT_NAME):
        with pytest.raises(ValueError) as exc:
            load_checkpoint(where)
        _assert_refused(exc, f"checkpoint {str(tmp_path / CHECKPOINT_NAME)!r}", "edgc train --trust-checkpoint")
    assert not marker.exists()


class _FakeSync:
    """Stands in for the FSDP state's GradientSync: what it saves and what it was given."""

    def __init__(self) -> None:
        self.loaded = None

    def state_dict(self, copy: bool = True) -> dict:
        return {"step": 1}

    def load_state_dict(self, d, *, strict_replica: bool = True) -> None:
        self.loaded = d


def _fsdp_state() -> EDGCFSDPState:
    """A one-process FSDP state over the fake core: no model, mesh or process group."""
    return EDGCFSDPState([], _FakeSync(), (1, 1, 1))  # (1 replica x 1 shard x 1 TP rank)


def test_a_crafted_fsdp_state_entry_runs_nothing_as_bytes_or_as_a_tensor(tmp_path):
    marker = tmp_path / "ran"
    saved = _fsdp_state().state_dict()
    (key,) = [k for k in saved if k.startswith("rank")]
    buf = io.BytesIO()
    torch.save({"step": _Touch(marker)}, buf)
    crafted = buf.getvalue()
    as_tensor = torch.frombuffer(bytearray(crafted), dtype=torch.uint8)  # (as edgc train's checkpoints hold it)
    for blob in (crafted, as_tensor):
        state = _fsdp_state()
        with pytest.raises(ValueError) as exc:
            state.load_state_dict({**saved, key: blob})
        _assert_refused(exc, f"EDGC FSDP state entry {key!r}", "load_state_dict(..., trust=True)")
        assert state.sync.loaded is None
    assert not marker.exists()
    state = _fsdp_state()
    state.load_state_dict(saved)  # (what it saves loads as it is)
    assert state.sync.loaded == {"step": 1}


def test_trust_loads_a_file_one_trusts_at_every_door(tmp_path):
    torch.save(_states_file([{"note": Note("states")}]), tmp_path / FILE_NAME)
    with pytest.raises(UnsafeFileError, match=rf"holds {__name__}\.Note, a Python global"):
        read_states(tmp_path)
    assert read_states(tmp_path, trust=True)["replicas"] == [{"note": Note("states")}]

    class Loaded:
        def load_state_dict(self, d):
            self.d = d

    into = Loaded()
    load_states(into, tmp_path, trust=True)
    assert into.d == {"note": Note("states")}

    torch.save(_checkpoint(Note("checkpoint")), tmp_path / CHECKPOINT_NAME)
    with pytest.raises(UnsafeFileError, match=rf"holds {__name__}\.Note"):
        load_checkpoint(tmp_path)
    assert load_checkpoint(tmp_path, trust=True)["extra"] == Note("checkpoint")

    saved = _fsdp_state().state_dict()
    (key,) = [k for k in saved if k.startswith("rank")]
    buf = io.BytesIO()
    torch.save({"note": Note("fsdp")}, buf)
    state = _fsdp_state()
    with pytest.raises(UnsafeFileError, match=rf"holds {__name__}\.Note"):
        state.load_state_dict({**saved, key: buf.getvalue()})
    state.load_state_dict({**saved, key: buf.getvalue()}, trust=True)
    assert state.sync.loaded == {"note": Note("fsdp")}


def test_what_edgc_saves_loads_without_trust_and_damage_is_still_damage(tmp_path):
    payload = {"step": 2, "train": {"method": "edgc", "lr": 1e-3}, "layout": (1, 2), "hsdp": None,
               "model": {"w": torch.randn(3, 2)}, "dtype": torch.bfloat16, "generator": torch.Generator().get_state()}
    save_checkpoint(tmp_path / CHECKPOINT_NAME, payload)
    back = load_checkpoint(tmp_path)
    assert back["layout"] == (1, 2) and back["dtype"] is torch.bfloat16 and torch.equal(back["model"]["w"],
                                                                                         payload["model"]["w"])
    # a crafted file cut short or with a flipped byte is reported as damaged, before any loading
    marker = tmp_path / "ran"
    torch.save(_checkpoint(_Touch(marker)), tmp_path / "crafted.pt")
    raw = (tmp_path / "crafted.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        load_checkpoint(tmp_path / "cut.pt", trust=True)
    assert not marker.exists()


def test_a_refusal_without_a_named_global_gives_torchs_reason():
    assert _held("Weights only load failed.\n\tWeightsUnpickler error: Unsupported operand 149\n\nCheck") == (
        "it holds what torch's weights-only loader refuses (Unsupported operand 149)")
    assert _held("Trying to load unsupported GLOBAL posix.system whose module posix is blocked.") == (
        "it holds posix.system, a Python global that loading would call")


def _edgc(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python -m edgc ARGS` as a user runs it, its output captured."""
    return subprocess.run([sys.executable, "-m", "edgc", *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_edgc_train_resume_of_a_crafted_checkpoint_runs_nothing_and_says_so_in_one_line(tmp_path):
    # refused while the command reads the checkpoint, before any worker starts
    run, marker = tmp_path / "run", tmp_path / "ran"
    run.mkdir()
    torch.save(_checkpoint(_Touch(marker)), run / CHECKPOINT_NAME)
    for how in (["--resume", str(run)], ["--auto-resume", "--out", str(run)]):
        proc = _edgc("train", *how, "--no-progress", cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("edgc train: error: checkpoint "), proc.stderr
        assert str(run / CHECKPOINT_NAME) in lines[0] and f"it holds {SYSTEM}" in lines[0], lines[0]
        assert "edgc train --trust-checkpoint" in lines[0]
    assert not marker.exists()
    assert sorted(p.name for p in run.iterdir()) == [CHECKPOINT_NAME]  # (nothing written into the run)
