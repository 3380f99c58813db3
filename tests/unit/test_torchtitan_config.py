"""edgc.integrations.torchtitan's configs, parsed by torchtitan's own ConfigManager (as
`torchrun -m torchtitan.train --module edgc.integrations.torchtitan --config ...` does):
the settings arrive as `--edgc.FIELD`, the offline defaults replace torchtitan's test
assets, and bad input is refused in one line before any process group or model exists.

The cases run in one subprocess with the CPU shim installed (it patches torch's device
probe, which this process must keep)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torchtitan", reason="the torchtitan extra (Python 3.11+)")

SCRIPT = textwrap.dedent('''
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import titan_shim
    titan_shim.install()
    from torchtitan.config import ConfigManager
    from torchtitan.trainer import Trainer
    import edgc.integrations.torchtitan as titan

    import contextlib, io

    def outcome(make):
        shown = io.StringIO()
        try:
            with contextlib.redirect_stderr(shown):
                value = make()
        except SystemExit:  # (torchtitan's parser, tyro, shows a setting's error and exits)
            return {"error": "SystemExit", "message": " ".join(shown.getvalue().split())}
        except Exception as exc:  # (each case's error, as a user sees it: its type and message)
            return {"error": type(exc).__name__, "message": str(exc)}
        return {"value": value}

    def parse(*flags, config="llama3_debugmodel"):
        return ConfigManager().parse_args(["--module", "edgc.integrations.torchtitan", "--config", config,
                                           *titan_shim.CPU_FLAGS, *flags])

    def built(*flags, config="llama3_debugmodel"):
        parse(*flags, config=config).build()

    def summary(*flags):
        c = parse(*flags)
        e = c.edgc_config()
        return {"type": type(c).__name__, "assets": c.hf_assets_path, "loader": type(c.dataloader).__qualname__,
                "loss": type(c.loss).__qualname__, "backend": c.parallelism.spmd_backend, "max_rank": e.max_rank,
                "window": e.window, "warmup_steps": e.warmup_steps, "warmup_min_steps": e.warmup_min_steps,
                "total_steps": e.total_steps, "wire": e.wire, "noise_exponent": e.noise.exponent}

    cases = {
        "defaults": lambda: summary("--training.steps", "300"),
        "given": lambda: summary("--training.steps", "300", "--edgc.max-rank", "16", "--edgc.window", "7",
                                 "--edgc.wire", "native", "--edgc.noise-exponent", "0.25"),
        "qwen3": lambda: type(parse(config="qwen3_debugmodel")).__name__,
        "max_rank_none": lambda: parse("--edgc.max-rank", "None"),
        "window_0": lambda: parse("--edgc.window", "0"),
        "no_replicas": lambda: built(),
        "pp": lambda: built("--parallelism.data-parallel-replicate-degree", "2",
                            "--parallelism.pipeline-parallel-degree", "2"),
        "cp": lambda: built("--parallelism.data-parallel-replicate-degree", "2",
                            "--parallelism.context-parallel-degree", "2"),
        "spmd_types": lambda: built("--parallelism.data-parallel-replicate-degree", "2",
                                    "--parallelism.spmd-backend", "spmd_types"),
        "cuda_graphs": lambda: built("--parallelism.data-parallel-replicate-degree", "2",
                                     "--training.no-disable-cuda-graphs"),
        "moe": lambda: built("--parallelism.data-parallel-replicate-degree", "2", config="qwen3_moe_debug"),
        "unknown_setting": lambda: titan.with_edgc(titan._torchtitan_config("llama3_debugmodel")(), windoww=5),
        "bad_setting": lambda: titan.with_edgc(titan._torchtitan_config("llama3_debugmodel")(), warmup="sometimes"),
        "not_a_trainer_config": lambda: titan.with_edgc(object()),
        "no_such_config": lambda: titan.llama3_no_such_config,
    }
    print(json.dumps({name: outcome(make) for name, make in cases.items()}))
''')


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    home = tmp_path_factory.mktemp("titan-config")
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(Path(__file__).parents[1] / "distributed")],
                          cwd=home, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_config_function_becomes_torchtitans_trainer_with_edgc_scaled_to_the_run(outcomes):
    got = outcomes["defaults"]["value"]
    assert got["type"] == "Config" and got["backend"] == "partial_dtensor"
    # offline: the built-in corpus replaces tests/assets (its tokenizer and its data)
    assert got["assets"] == "runs/.data/builtin-v2-bpe2048-all" and got["loader"] == "EDGCCorpusDataLoader.Config"
    assert got["loss"] == "CrossEntropyLoss.Config"  # (the chunked loss syncs the head once per chunk)
    # r_max 32; a 300-step run: window 300 // 15, warm-up at most 300 // 10, at least the rate's (2 steps)
    assert (got["max_rank"], got["window"], got["warmup_steps"], got["warmup_min_steps"], got["total_steps"]) == \
        (32, 20, 30, 2, 300)
    assert outcomes["qwen3"]["value"] == "Config"


def test_settings_come_as_edgc_flags_and_override_the_run_defaults(outcomes):
    got = outcomes["given"]["value"]
    assert (got["max_rank"], got["window"], got["wire"], got["noise_exponent"]) == (16, 7, "native", 0.25)
    assert got["warmup_steps"] == 30  # (not given: still scaled)


@pytest.mark.parametrize("case, error, words", [
    ("max_rank_none", "SystemExit", "max_rank=None"),
    ("window_0", "SystemExit", "EDGCConfig.window=0: must be a positive integer"),
    ("no_replicas", "ValueError", "data-parallel-replicate-degree is 1"),
    ("pp", "ValueError", "pipeline-parallel-degree 2"),
    ("cp", "ValueError", "context-parallel-degree 2"),
    ("spmd_types", "ValueError", "spmd-backend spmd_types"),
    ("cuda_graphs", "ValueError", "CUDA graphs would replay"),
    ("moe", "ValueError", "routed experts"),
    ("unknown_setting", "ValueError", "no edgc setting(s) ['windoww']"),
    ("bad_setting", "ValueError", "EDGCConfig.warmup='sometimes'"),
    ("not_a_trainer_config", "TypeError", "takes torchtitan's Trainer.Config"),
    ("no_such_config", "AttributeError", "llama3_no_such_config"),
])
def test_bad_input_is_refused_in_one_line_before_anything_runs(outcomes, case, error, words):
    got = outcomes[case]
    assert got.get("error") == error, got
    assert words in got["message"] and "\n" not in got["message"], got["message"]
