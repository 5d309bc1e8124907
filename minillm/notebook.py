"""What the notebooks use beside the chapters' code: the library's source as the page shows it, a table.

``show(fn)`` prints a library function or class with each exercise region's reference solution
replaced by one line naming the exercise, so the code on the page is the code that runs, and a
student edition's page shows the stub. An exercise region is marked in the source by a line
``# EXERCISE 3.1 BEGIN: <what to implement>`` before the reference solution and a line
``# EXERCISE 3.1 END`` after it (the course kit, ``minillm.tools.course``, reads the same markers).
``format_table(rows)`` aligns rows of dicts, as the benchmarks print them. ``draw_block_tables(cache)``
draws a paged KV cache's block tables and its block pool (chapter 6).
"""

from __future__ import annotations

import ast
import inspect
import re

MARKER = re.compile(r"^(?P<indent>[ \t]*)# EXERCISE (?P<id>\S+) (?P<kind>BEGIN|END)\b:?\s*(?P<task>.*)$")


def source_without_solutions(obj) -> str:
    """The source of a library function or class as a notebook shows it: each exercise region's
    reference solution is replaced by one line naming the exercise (the student writes that part)."""
    out, hidden = [], False
    for line in inspect.getsource(obj).splitlines():
        marker = MARKER.match(line)
        if marker and marker["kind"] == "END":
            hidden = False
        if not hidden:
            out.append(line)
        if marker and marker["kind"] == "BEGIN":
            hidden = True
            out.append(f"{marker['indent']}...  (exercise {marker['id']}: the solution is yours to write)")
    return "\n".join(out)


def show(*objects) -> None:
    """Print ``source_without_solutions`` of each object: the code on the page is the code that runs."""
    for obj in objects:
        print(source_without_solutions(obj), end="\n\n")



def format_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """Rows of dicts -> an aligned text table (floats with 4 significant digits)."""
    columns = columns or list(rows[0])

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


# ---- figures a page draws ----


def draw_block_tables(cache, ax=None, title: str | None = None):
    """Draw each sequence's block table (top) pointing into the physical block pool (bottom) of a
    ``PagedKVCache`` (chapter 6; read through its attributes, so this module imports no cache).

    A physical block is colored like the sequence holding it, grey when several hold it (the number
    is its reference count), outlined dashed when only the prefix cache holds it; shading shows the
    slots holding tokens.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle

    if ax is None:
        _, ax = plt.subplots(figsize=(max(6, 0.75 * cache.num_blocks), 1.6 + 0.8 * len(cache.block_tables)))
    bs, colors = cache.page_size, {}
    owner, filled = {}, [0] * cache.num_blocks
    for n, (seq, table) in enumerate(cache.block_tables.items()):
        colors[seq] = f"C{n % 10}"
        for i, b in enumerate(table):
            owner[b] = seq
            filled[b] = max(filled[b], min(bs, cache.lengths[seq] - i * bs))
    for b in [] if cache.prefix_blocks is None else cache.prefix_blocks.held_blocks():
        filled[b] = bs  # only full blocks are cached
    for b in range(cache.num_blocks):  # the pool, y = 0
        count = cache.allocator.ref_counts[b]
        shared = count > 1 or (count == 1 and b not in owner)
        color = "white" if count == 0 else ("0.6" if shared else colors[owner[b]])
        color = "0.85" if count == 1 and b not in owner else color
        ls = "--" if count == 1 and b not in owner else "-"
        ax.add_patch(Rectangle((b, 0), 0.9, 0.6, fc="white", ec="k", ls=ls))
        ax.add_patch(Rectangle((b, 0), 0.9 * filled[b] / bs, 0.6, fc=color, alpha=0.8, ec="none"))
        ax.text(b + 0.45, -0.25, str(b), ha="center", va="top", fontsize=8)
        if count > 1:
            ax.text(b + 0.45, 0.3, f"x{count}", ha="center", va="center", fontsize=8)
        elif count == 1 and b not in owner:
            ax.text(b + 0.45, 0.3, "cached", ha="center", va="center", fontsize=6)
    for row, (seq, table) in enumerate(cache.block_tables.items()):  # the tables, above
        y = 1.6 + 0.9 * row
        ax.text(-0.2, y + 0.3, f"seq {seq} (len {cache.lengths[seq]})", ha="right", va="center", fontsize=8)
        for i, b in enumerate(table):
            ax.add_patch(Rectangle((i, y), 0.9, 0.6, fc=colors[seq], alpha=0.35, ec="k"))
            ax.text(i + 0.45, y + 0.3, str(b), ha="center", va="center", fontsize=8)
            ax.add_artist(FancyArrowPatch((i + 0.45, y), (b + 0.45, 0.62), arrowstyle="->", color=colors[seq],
                                          lw=0.8, alpha=0.7, mutation_scale=8))
    ax.text(-0.2, 0.3, "physical\nblocks", ha="right", va="center", fontsize=8)
    ax.set_xlim(-2.2, cache.num_blocks + 0.2)
    ax.set_ylim(-0.7, 1.6 + 0.9 * max(1, len(cache.block_tables)))
    ax.axis("off")
    ax.set_title(title or f"block tables (page size {bs})", fontsize=10)
    return ax


# ---- a student edition's notebook: a cell that needs an unsolved exercise says so and the page goes on ----

UNSOLVED = re.compile(r"^Exercise (?P<id>A?\d+\.\d+): (?P<task>.*)$")  # what an exercise's stub raises
SKIPPED = "this cell needs "  # how a cell that met an unsolved exercise's stub begins its one line


def stub_message(ex_id: str, task: str) -> str:
    """The NotImplementedError message of exercise ``ex_id``'s stub in a student edition (the course kit
    writes it; ``skip_unsolved_exercises`` reads it): "Exercise 3.1: append the new keys/values"."""
    return f"Exercise {ex_id}: {task}"


class UnsolvedExercises:
    """Turns a cell's stub NotImplementedError into one printed line, and remembers which exercises cells
    needed, so a later cell that fails on a name such a cell would have defined says why (one line too).

    ``transform(tree)`` rewrites a cell's AST (IPython's ``ast_transformers`` protocol: ``visit``) from

        <statements>
        <last expression>

    into

        try:
            <statements>
            _minillm_value = <last expression>
        except (NotImplementedError, NameError) as _minillm_exc:
            _minillm_value = _minillm_unsolved(_minillm_exc)   # prints one line, or re-raises
        _minillm_value                                          # displayed as the cell's value

    so a cell that calls an unsolved exercise ends quietly and the notebook goes on.
    """

    VALUE, HANDLER = "_minillm_value", "_minillm_unsolved"

    def __init__(self):
        self.skipped: list[str] = []  # exercises whose cells were skipped, in order

    def __call__(self, exc: BaseException):
        """The except clause's body: a stub's error -> print one line -> None; anything else re-raises."""
        if isinstance(exc, NotImplementedError) and (m := UNSOLVED.match(str(exc))):
            if m["id"] not in self.skipped:
                self.skipped.append(m["id"])
            print(f"{SKIPPED}exercise {m['id']} ({m['task']}): solve it, then run the cell again")
            return None
        if isinstance(exc, NameError) and self.skipped:
            print(f"{SKIPPED}a result of a cell above that needs exercise {self.skipped[-1]} ({exc})")
            return None
        raise exc

    def visit(self, tree: ast.Module) -> ast.Module:
        body = list(tree.body)
        if not body or isinstance(body[0], ast.ImportFrom) and body[0].module == "__future__":
            return tree
        value, exc = ast.Name(self.VALUE, ast.Store()), "_minillm_exc"
        if isinstance(body[-1], ast.Expr):
            body[-1] = ast.Assign([value], body[-1].value)
        else:
            body.append(ast.Assign([value], ast.Constant(None)))
        handler = ast.ExceptHandler(
            ast.Tuple([ast.Name("NotImplementedError", ast.Load()), ast.Name("NameError", ast.Load())], ast.Load()),
            exc,
            [ast.Assign([value], ast.Call(ast.Name(self.HANDLER, ast.Load()), [ast.Name(exc, ast.Load())], []))],
        )
        guarded = ast.Try(body, [handler], [], [])
        tree.body = [guarded, ast.Expr(ast.Name(self.VALUE, ast.Load()))]
        return ast.fix_missing_locations(tree)


def skip_unsolved_exercises(shell=None) -> UnsolvedExercises | None:
    """In a Jupyter notebook: from now on a cell that runs into an unsolved exercise prints one line
    ("this cell needs exercise 3.3 ...") instead of a traceback, and the rest of the notebook goes on.
    Outside IPython (a script, the tests) it does nothing and returns None. Calling it again is harmless."""
    if shell is None:
        try:
            from IPython import get_ipython
        except ImportError:
            return None
        shell = get_ipython()
    if shell is None:
        return None
    guard = next((t for t in shell.ast_transformers if isinstance(t, UnsolvedExercises)), None)
    if guard is None:
        guard = UnsolvedExercises()
        shell.ast_transformers.append(guard)
    shell.user_ns[UnsolvedExercises.HANDLER] = guard
    return guard
