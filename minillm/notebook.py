"""What the notebooks use beside the chapters' code: the library's source as the page shows it, a table.

``show(fn)`` prints a library function or class with each exercise region's reference solution
replaced by one line naming the exercise, so the code on the page is the code that runs, and a
student edition's page shows the stub. An exercise region is marked in the source by a line
``# EXERCISE 3.1 BEGIN: <what to implement>`` before the reference solution and a line
``# EXERCISE 3.1 END`` after it (the course kit, ``minillm.tools.course``, reads the same markers).
``format_table(rows)`` aligns rows of dicts, as the benchmarks print them.
"""

from __future__ import annotations

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
