"""The library's layers (DESIGN: backend -> config/tokenizers -> attention and kernels -> model and
caches -> sampling -> decoding loops -> batching -> serving, chat, training; then the tools): every
minillm module imports only from its own layer or the layers below, the model and the caches meet
only through the cache contract, no two modules import each other, even lazily, and the chapters'
modules never import the tools (``minillm/tools/``: CLI, demo, benchmarks, course kit, GPU check)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "minillm"

LAYERS = [  # lowest first; a module may import from its own layer and the ones before it
    {"backend", "streaming", "strict", "cache_contract", "config", "tokenizer", "bpe", "notebook", "kernels",
     "kernels.build"},
    {"quantize", "qkernels"},  # the weight formats, then their packed CPU kernels
    {"attention", "nn", "flash_attention", "kernels.launch", "data", "sampling", "workloads"},  # nn: layer functions
    {"model", "kv_cache", "kv_quant", "paged_kv", "prefix_blocks"},
    {"llama", "checkpoint", "gguf", "registry", "drafts", "fused", "qcuda"},  # fused, qcuda: kernels, references
    {"generate", "speculative", "measure", "decode_step"},
    {"token_tree"},
    {"draft_free", "lookahead", "medusa", "eagle"},
    {"batch_speculative"},
    {"serving", "chat", "train"},
    {"medusa_train", "eagle_train"},  # drafts learn with train.py's AdamW, on text the target writes
    {"tools", "__main__", ""},  # every module under minillm/tools/; the package re-exports the chapters
]
MODEL = {"model", "llama"}
CACHES = {"kv_cache", "paged_kv", "prefix_blocks"}


def module_name(path: Path) -> str:
    """minillm/kernels/build.py -> "kernels.build"; minillm/__init__.py -> "" (the package)."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set:
    """The minillm modules a file imports (at any depth of the file, lazy imports included)."""
    name = module_name(path)
    package = [p for p in (name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]) if p]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
            if node.module:
                found.add(".".join([*base, node.module]))
            else:  # from . import x
                found |= {".".join([*base, alias.name]) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minillm"):
            found.add(node.module.removeprefix("minillm").lstrip("."))
    return {m for m in found if m != name}


def layer(module: str) -> int:
    for i, members in enumerate(LAYERS):
        if module in members or (module.split(".")[0] == "tools" and "tools" in members):
            return i
    raise AssertionError(f"minillm.{module} is in no layer of tests/test_layers.py: place it")


GRAPH = {module_name(p): imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_import_goes_down_or_sideways():
    upward = [f"{m} (layer {layer(m)}) imports {d} (layer {layer(d)})"
              for m, deps in GRAPH.items() for d in deps if layer(d) > layer(m)]
    assert not upward, "\n".join(upward)


def test_no_chapter_module_imports_the_tools():
    """The chapters stand without the tools: only the tools themselves and ``python -m minillm`` reach
    into ``minillm/tools/`` (the package's notebook helpers live in ``minillm.notebook``)."""
    reaching = [(m, d) for m, deps in GRAPH.items() for d in deps
                if d.split(".")[0] == "tools" and m.split(".")[0] != "tools" and m != "__main__"]
    assert not reaching, reaching


def test_model_and_caches_meet_only_through_the_contract():
    crossing = [(m, d) for m, deps in GRAPH.items() for d in deps
                if (m in MODEL and d in CACHES) or (m in CACHES and d in MODEL)]
    assert not crossing, crossing
    assert GRAPH["attention"] <= {"backend"}, GRAPH["attention"]


def test_no_import_cycle():
    """Depth-first search over the import graph; a back edge is a cycle."""
    state, cycles = {}, []

    def visit(m, path):
        state[m] = "open"
        for d in sorted(GRAPH.get(m, ())):
            if state.get(d) == "open":
                cycles.append(path[path.index(d):] + [d])
            elif d not in state:
                visit(d, [*path, d])
        state[m] = "done"

    for m in GRAPH:
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


def test_the_checker_sees_imports():
    """The graph is not empty by accident: known edges are there."""
    assert "backend" in GRAPH["attention"] and "kv_cache" in GRAPH["generate"]
    assert "kernels.build" in GRAPH["kernels.launch"] and "tools.cli" in GRAPH["__main__"]
    assert "medusa" in GRAPH["medusa_train"] and "tools.options" in GRAPH["tools.cli"]
