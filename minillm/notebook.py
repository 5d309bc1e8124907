"""What the notebooks use beside the chapters' code: the library's source as the page shows it, a table.

``show(fn)`` prints a library function or class with each exercise region's reference solution
replaced by one line naming the exercise, so the code on the page is the code that runs, and a
student edition's page shows the stub. An exercise region is marked in the source by a line
``# EXERCISE 3.1 BEGIN: <what to implement>`` before the reference solution and a line
``# EXERCISE 3.1 END`` after it (the course kit, ``minillm.tools.course``, reads the same markers).
``format_table(rows)`` aligns rows of dicts, as the benchmarks print them.
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


# ---- a student edition's notebook: a cell that needs an unsolved exercise says so and the page goes on ----

UNSOLVED = re.compile(r"^Exercise (?P<id>A?\d+\.\d+): (?P<task>.*)$")  # what an exercise's stub raises


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
            print(f"this cell needs exercise {m['id']} ({m['task']}): solve it, then run the cell again")
            return None
        if isinstance(exc, NameError) and self.skipped:
            print(f"this cell needs a result of a cell above that needs exercise {self.skipped[-1]} ({exc})")
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
