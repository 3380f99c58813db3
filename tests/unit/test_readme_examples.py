"""The README's quick starts are lines of the examples, which the tests run
(tests/distributed/test_examples.py): a block that drifts from its example fails here."""

import re

import pytest

from edgc.models import build_model
from readme_snippets import README, ROOT, marked_lines, readme_blocks

QUICK_STARTS = {("examples/ddp.py", "ddp"): "## Quick start: DDP",
                ("examples/hsdp.py", "fsdp"): "## Quick start: FSDP2 and HSDP"}


def _section(text: str, code: str) -> str:
    """The heading of the README section that holds `code`."""
    return re.findall(r"^## .*$", text[:text.index(code)], re.M)[-1]


def test_each_quick_start_is_its_examples_marked_lines_in_its_own_section():
    text = README.read_text()
    blocks = readme_blocks(text)
    assert set(blocks) == set(QUICK_STARTS)
    for (example, name), code in blocks.items():
        assert code == marked_lines(ROOT / example, name), f"README's block differs from {example}'s '{name}' lines"
        assert _section(text, code) == QUICK_STARTS[example, name]


def test_the_ddp_quick_start_is_the_whole_example_after_its_docstring():
    # (what the README shows runs as a file: tests/distributed/test_examples.py runs it)
    source = (ROOT / "examples" / "ddp.py").read_text()
    after_docstring = source.split('"""', 2)[2]
    assert marked_lines(ROOT / "examples" / "ddp.py", "ddp").strip() == "\n".join(
        line for line in after_docstring.strip().splitlines() if not line.startswith("# --- readme:"))


def test_the_fsdp_quick_start_registers_after_sharding_and_accumulates():
    code = marked_lines(ROOT / "examples" / "hsdp.py", "fsdp")
    sharded = code.rindex("fully_shard(model")
    registered = code.index("register_edgc(model, mesh")
    assert code.index("for block in model.h:") < sharded < registered < code.index(".backward()")
    assert hasattr(build_model("tiny", device="meta"), "h")  # (the blocks' name in edgc.models' GPT)
    assert "model.set_requires_all_reduce(" in code


def test_quick_starts_scale_the_config_to_the_run():
    for code in readme_blocks().values():
        assert "total_steps=" in code and "window=" not in code


def test_marked_lines_join_segments_and_refuse_an_open_one(tmp_path):
    example = tmp_path / "ex.py"
    example.write_text("import os\n# --- readme: a ---\nimport torch\n\n# --- readme: end ---\nx = 1\n"
                       "# --- readme: a ---\n\ny = torch.ones(2)\n# --- readme: end ---\n")
    assert marked_lines(example, "a") == "import torch\n\ny = torch.ones(2)\n"
    with pytest.raises(ValueError, match="no '# --- readme: b ---' lines"):
        marked_lines(example, "b")
    example.write_text("# --- readme: a ---\nimport torch\n")
    with pytest.raises(ValueError, match="has no '# --- readme: end ---'"):
        marked_lines(example, "a")

