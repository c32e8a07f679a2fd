"""The package layout's rules, read from the source (every import, lazy ones included): the
runtime never imports a tool (the harnesses, the simulator, the command), verl_ext's packages import
each other without cycles, and no module imports another package's private names; and importing
what veRL loads does not load a tool."""

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "verl_ext"
RUNTIME = ("sharding", "model", "workload", "perf", "engine", "spec", "vllm", "pipe", "history", "config",
           "trace", "rollout", "cpu", "plugin")
TOOLS = ("compare", "ab", "measure", "sim", "verl_runs", "cli")


def _imports():
    """(importing package, imported module, imported names, file, line) for every verl_ext import."""
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        package = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        module = ["verl_ext", *rel.with_suffix("").parts]
        if module[-1] == "__init__":
            module = module[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [(a.name, ()) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module[: len(module) - node.level + (path.name == "__init__.py")]
                    name = ".".join(base + ([node.module] if node.module else []))
                else:
                    name = node.module or ""
                targets = [(name, tuple(a.name for a in node.names))]
            else:
                continue
            for name, names in targets:
                if name.startswith("verl_ext."):
                    out.append((package, name, names, str(rel), node.lineno))
    return out


def _graph():
    edges = defaultdict(set)
    for package, name, _, _, _ in _imports():
        target = name.split(".")[1]
        if target != package:
            edges[package].add(target)
    return edges


def test_the_import_scan_sees_the_known_edges():
    edges = _graph()
    assert "perf" in edges["pipe"] and "engine" in edges["pipe"] and "compare" in edges["sim"]


def test_every_package_is_runtime_or_tool():
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and any(p.glob("*.py"))}
    packages |= {p.stem for p in ROOT.glob("*.py") if p.stem != "__init__"}
    assert packages == set(RUNTIME) | set(TOOLS)


def test_the_runtime_never_imports_a_tool():
    offending = [f"{f}:{line} imports {name}" for package, name, _, f, line in _imports()
                 if package in RUNTIME and name.split(".")[1] in TOOLS]
    assert not offending, offending


def test_what_verl_loads_loads_no_tool():
    """The plugin entry point, the rollout manager and the vLLM plugin, imported as veRL and vLLM
    import them, leave every tool package unloaded."""
    import subprocess
    import sys

    code = ("import sys, verl_ext.plugin, verl_ext.rollout.manager, verl_ext.vllm.plugin, verl_ext.vllm.proposer\n"
            f"print(sorted({{m.split('.')[1] for m in sys.modules if m.startswith('verl_ext.')}} & {set(TOOLS)!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_packages_import_each_other_without_cycles():
    edges = _graph()
    state, cycles = {}, []

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycles, cycles


def test_no_module_imports_another_packages_private_names():
    offending = []
    for package, name, names, f, line in _imports():
        target = name.split(".")
        own = target[1] == package
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        if any(part.startswith("_") for part in target[2:]) and not own:
            private.append(name)
        if private and not own:
            offending.append(f"{f}:{line} imports {private} from {name}")
    assert not offending, offending


def test_the_name_vllm_is_always_the_real_vllm():
    """``verl_ext.vllm`` shares its last name with vLLM: no module binds the name ``vllm`` to
    anything but the real vLLM (a relative ``from . import vllm``, ``from verl_ext import vllm``,
    ``import verl_ext.vllm as vllm``); every module imports vLLM absolutely."""
    offending = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                bound = [a.asname or a.name for a in node.names]
                if "vllm" in bound or (node.level and (node.module or "").split(".")[0] == "vllm"):
                    offending.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            elif isinstance(node, ast.Import):
                if any(a.asname == "vllm" and a.name != "vllm" for a in node.names):
                    offending.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offending, offending


def _architecture_table():
    """docs/ARCHITECTURE.md's package table: [(packages of the row, the imports it states)]."""
    import re

    text = (ROOT.parent / "docs" / "ARCHITECTURE.md").read_text()
    section = text[text.index("## Packages"):]
    section = section[:section.index("\n## ", 3)]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        names = [re.sub(r"(/|\.py)$", "", n) for n in re.findall(r"`([^`]+)`", cells[0])]
        stated = None if cells[2] == "any" else set(re.findall(r"`([^`]+)`", cells[2]))
        rows.append((names, stated))
    return rows


def test_the_architecture_table_lists_every_package_and_the_imports_it_has():
    rows = _architecture_table()
    listed = [n for names, _ in rows for n in names]
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and any(p.glob("*.py"))}
    packages |= {p.stem for p in ROOT.glob("*.py") if p.stem != "__init__"}
    assert sorted(listed) == sorted(packages), "docs/ARCHITECTURE.md's package table and verl_ext's packages differ"
    edges, above, wrong = _graph(), set(), []
    for names, stated in rows:
        for name in names:
            actual = edges.get(name, set())
            if stated is not None and actual != stated:
                wrong.append(f"{name}: the table says {sorted(stated)}, the code imports {sorted(actual)}")
            if stated is not None and not actual <= above:
                wrong.append(f"{name} imports {sorted(actual - above)}, listed below it")
        above |= set(names)
    assert not wrong, wrong
