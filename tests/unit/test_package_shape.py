"""The package's shape: no import circle anywhere in src/edgc (type-only imports included),
no source file over 600 lines, no policy named inside comm/ or fsdp.py, and no plotting or
terminal library imported by a training worker."""

import ast
from pathlib import Path

import edgc

SRC = Path(edgc.__file__).resolve().parent
MOST_LINES = 600


def _module(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Each module of edgc and the edgc modules it imports anywhere in its source (in
    functions and under TYPE_CHECKING too): `from a.b import c` counts a.b, and a.b.c where
    that is a module."""
    modules = {_module(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` as a list of modules, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_the_cycle_finder_finds_a_circle_and_none_where_there_is_none():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circle_anywhere_in_the_package():
    graph = _imports()
    assert "edgc.comm.sync" in graph and "edgc.comm.step" in graph["edgc.comm.sync"]  # (the graph is read)
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_no_source_file_is_over_600_lines():
    lines = {str(p.relative_to(SRC)): len(p.read_text().splitlines()) for p in SRC.rglob("*.py")}
    long = {name: n for name, n in lines.items() if n > MOST_LINES}
    assert not long, long


def _policy_comparisons(source: str, names: set[str]) -> list[int]:
    """Lines of `source` that choose behaviour by a policy's name: a comparison of something
    named "policy" (config.policy, policy) with text, or with a policy's name in quotes.
    (Comparing two policies' names for equality, as a loaded state's with the config's,
    chooses nothing.)"""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        named = any(isinstance(n, ast.Attribute) and n.attr == "policy" or isinstance(n, ast.Name) and n.id == "policy"
                    for n in sides)
        values = [e for n in sides for e in (n.elts if isinstance(n, (ast.Tuple, ast.List, ast.Set)) else [n])]
        texts = [v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
        if (named and texts) or any(t in names for t in texts):
            lines.append(node.lineno)
    return lines


def test_the_comparison_finder_sees_both_forms():
    names = {"noise", "cqm"}
    source = "a = cfg.policy == 'x'\nb = p in ('cqm', 'y')\nc = d['noise']\ne = d['p'] != cfg.policy\n"
    assert _policy_comparisons(source, names) == [1, 2]


def test_comm_and_fsdp_never_compare_a_policy_s_name():
    from edgc.policy.registry import REMOVED, policy_names

    names = {*policy_names(), *REMOVED}
    files = [*(SRC / "comm").glob("*.py"), SRC / "fsdp.py"]
    hits = {p.name: found for p in files if (found := _policy_comparisons(p.read_text(), names))}
    assert not hits, hits


def test_a_training_worker_starts_without_the_plotting_and_terminal_libraries():
    # every worker of `edgc train` imports these modules; matplotlib and rich cost 0.4 s
    # of CPU a process to import, and only the summary and rank 0's progress bar need them
    import subprocess
    import sys

    code = ("import sys, edgc.train.trainer, edgc.train.pipeline, edgc.train.parallel; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'matplotlib', 'rich'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
