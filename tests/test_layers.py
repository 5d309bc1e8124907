"""The library's layers (DESIGN: backend -> config/tokenizers -> attention and kernels -> model and
caches -> sampling -> decoding loops -> batching -> serving, chat, training; then the tools): every
minillm module imports only from its own layer or the layers below, the model and the caches meet
only through the cache contract, no two modules import each other, even lazily, and the chapters'
modules never import the tools (``minillm/tools/``: CLI, demo, benchmarks, course kit, GPU check)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "minillm"

LAYERS = [  # lowest first; a module may import from its own layer and the ones before it
    {"backend", "cpu_target", "streaming", "strict", "cache_contract", "config", "tokenizer", "bpe", "notebook",
     "kernels", "kernels.build"},
    {"quantize", "qkernels"},  # the weight formats, then their packed CPU kernels
    {"attention", "nn", "flash_attention", "row_attention", "block_kernels", "kernels.launch", "data", "sampling",
     "workloads"},  # nn: layer functions
    {"model", "kv_cache", "kv_quant", "paged_kv", "prefix_blocks"},
    {"llama", "checkpoint", "gguf", "registry", "drafts", "fused", "qcuda"},  # fused, qcuda: kernels, references
    {"generate", "speculative", "measure", "decode_step"},
    {"token_tree"},
    {"draft_free", "lookahead", "medusa", "eagle"},
    {"batch_speculative"},
    {"serving", "chat", "train"},
    {"medusa_train", "eagle_train"},  # drafts learn with train.py's AdamW, on text the target writes
    {"speculative_chat"},  # chat's replies in token_tree's rounds, on the proposers of chapters 9 and 11
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


def upward(graph: dict) -> list:
    """Each import of ``graph`` that goes up a layer, as "m (layer i) imports d (layer j)"."""
    return [f"{m} (layer {layer(m)}) imports {d} (layer {layer(d)})"
            for m, deps in graph.items() for d in deps if layer(d) > layer(m)]


def test_every_import_goes_down_or_sideways():
    assert not upward(GRAPH), "\n".join(upward(GRAPH))


def test_an_upward_import_is_caught():
    """The check can fail: the layer functions importing a model, or the static step a decoding loop."""
    planted = GRAPH | {"fused": GRAPH["fused"] | {"generate"}, "nn": GRAPH["nn"] | {"model"}}
    assert sorted(upward(planted)) == ["fused (layer 4) imports generate (layer 5)",
                                       "nn (layer 2) imports model (layer 3)"]


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


# Names of a block's own parameters (GPT-2's second norm and MLP, Llama's norms and projections): where the block
# is written. config.py declares every parameter's name and shape; gguf.py maps a file's names onto them.
BLOCK_NAMES = {"model": ("ln_1", "ln_2", "attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"),
               "llama": ("input_layernorm", "post_attention_layernorm", "self_attn.o_proj", "mlp.down_proj")}
NAME_TABLES = {"config", "gguf"}


def functions_naming(source: str, names) -> dict:
    """{name: the functions of ``source`` whose code (not docstrings) holds a string with ``name`` in it}."""
    tree, found = ast.parse(source), {name: set() for name in names}
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    for fn in (node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)):
        for node in ast.walk(fn):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                for name in names:
                    if name in node.value:
                        found[name].add(fn.name)
    return found


def test_each_familys_block_is_written_once():
    """The forward pass, training, the static step and the fused path run one block per family (``gpt_block``,
    ``llama_block``): a block's parameter names appear in the code of that one function, in no other chapter
    module (the name tables aside)."""
    names = [name for family in BLOCK_NAMES.values() for name in family]
    where = {name: set() for name in names}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        if module.split(".")[0] != "tools" and module not in NAME_TABLES:
            for name, functions in functions_naming(path.read_text(), names).items():
                where[name] |= {f"{module}.{f}" for f in functions}
    for name in BLOCK_NAMES["model"]:
        assert where[name] == {"model.gpt_block"}, (name, where[name])
    for name in BLOCK_NAMES["llama"]:
        assert where[name] == {"llama.llama_block"}, (name, where[name])


def test_a_second_copy_of_a_block_is_caught():
    """The check can fail: a second function (a per-family branch of a decode step) naming a block's weights."""
    copy = 'def step(p, i):\n    """ln_2 is named in a docstring: not code."""\n    return p[f"h.{i}.ln_2.weight"]\n'
    assert functions_naming(copy, ["ln_2", "ln_1"]) == {"ln_2": {"step"}, "ln_1": set()}
