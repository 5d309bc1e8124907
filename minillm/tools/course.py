"""The course kit: turn the reference into a student edition, and say which tests check what.

Each chapter marks the functions a student writes with a line
``# EXERCISE 3.1 BEGIN: <what to implement>`` before the reference solution and a line
``# EXERCISE 3.1 END`` after it, and each chapter's test file says which of its tests check each
exercise, as literals that this module reads without importing the tests:

    EXERCISES = {"3.1": "prefill_decode or overflow", ...}   # exercise -> pytest -k expression
    NEEDS = {"3.1": "loop or shipped"}   # tests here that also run another chapter's exercise
    DEPENDS = {"3.3": "1.1, 1.2"}   # exercises of other chapters that an exercise's grading tests run

``student_edition(root, out)`` copies the project (``root``: a checkout, see ``minillm.tools.project``),
replaces the body of every marked region (or of the chosen chapters' regions) by
``raise NotImplementedError("Exercise 3.1: <the text after BEGIN:>")`` (markers, signature and
docstring kept) and writes the manifest: per exercise its chapter, file, function, the pytest
command that grades it, the other tests that fail until it is solved (``also_fails``) and the
exercises of other chapters its grading tests also run (``depends``: solve those first; the stub
says so in a comment).
``grade(project)`` runs each exercise's grading command there and reports passed / total.
docs/instructors.md explains the rule; tests/test_course.py enforces it.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..notebook import MARKER, stub_message
from .project import pytest_outcomes

EXERCISE_ID = re.compile(r"^(?P<chapter>A?\d+)\.\d+$")  # 3.1, A1.2
NOTEBOOK_TEST = "tests/test_notebooks.py"
MANIFEST_JSON, MANIFEST_MD = "MANIFEST.json", "MANIFEST.md"
# never copied: version control, caches, build outputs, training state, logs
IGNORED = (".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis", ".benchmarks",
           ".ipynb_checkpoints", "_build", "build", "*.egg-info", "*.pyc", "*.tmp", "*.train.npz",
           "*.log.json")
# left out of the student edition: the bug zoo holds reference lines, the kit checks the reference
# and the flash mutants are exercises 4.1 and 4.2 with one bug each, the fix in their docstrings
INSTRUCTORS_ONLY = ("tests/test_course.py", "tests/test_bug_zoo.py", "tests/fixtures/bug_zoo.py",
                    "tests/fixtures/course_plugin.py", "tests/fixtures/flash_mutants.py")


class CourseError(ValueError):
    """Malformed exercise markers or declarations, an unknown chapter, or an unusable output folder."""


@dataclass
class Selection:
    """Tests of one file selected by a pytest -k expression."""

    tests: str  # tests/test_x.py
    keyword: str  # -k expression ("" selects the whole file)

    @property
    def command(self) -> str:
        if not self.keyword:
            return f"python -m pytest {self.tests}"
        keyword = f'"{self.keyword}"' if " " in self.keyword else self.keyword
        return f"python -m pytest {self.tests} -k {keyword}"


@dataclass
class Exercise:
    id: str  # "3.1"
    chapter: str  # "3"
    task: str  # the text after BEGIN:
    file: str  # minillm/kv_cache.py
    function: str  # KVCache.attend
    begin: int  # 1-based line of the BEGIN marker
    end: int  # 1-based line of the END marker
    checks: Selection | None = None  # the tests that grade it
    also_fails: list[Selection] = field(default_factory=list)  # other tests that need it solved
    depends: list[str] = field(default_factory=list)  # other chapters' exercises its grading tests run

    @property
    def command(self) -> str:
        return self.checks.command if self.checks else ""


# ------------------------------------------------------------------------------------------------
# reading the markers and the declarations


def _enclosing_function(tree: ast.Module, line: int) -> str:
    """Qualified name of the innermost function around ``line``: "KVCache.attend", "generate.next_logits"."""
    defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    names, body = [], tree.body
    while True:
        inner = next((n for n in body if isinstance(n, defs) and n.lineno <= line <= n.end_lineno), None)
        if inner is None:
            return ".".join(names)
        names.append(inner.name)
        body = [n for n in ast.walk(inner) if n is not inner and isinstance(n, defs)]


def parse_markers(text: str, rel: str) -> list[Exercise]:
    """The marked regions of the source ``text`` of file ``rel``; CourseError for malformed markers."""
    lines = text.splitlines()
    found, open_ = [], None
    for n, line in enumerate(lines, 1):
        m = MARKER.match(line)
        if not m:
            continue
        where = f"{rel}:{n}"
        ex_id = m["id"]
        if not EXERCISE_ID.match(ex_id):
            raise CourseError(f"{where}: exercise id {ex_id!r} is not of the form 3.1 or A1.2")
        if m["kind"] == "BEGIN":
            if open_ is not None:
                raise CourseError(f"{where}: EXERCISE {ex_id} BEGIN inside EXERCISE {open_[0]} (no END yet)")
            if not m["task"]:
                raise CourseError(f"{where}: EXERCISE {ex_id} BEGIN needs ': <what to implement>'")
            open_ = (ex_id, n, m["indent"], m["task"].strip())
        else:
            if open_ is None or open_[0] != ex_id or open_[2] != m["indent"]:
                raise CourseError(f"{where}: EXERCISE {ex_id} END does not close an open BEGIN at its indentation")
            if n == open_[1] + 1:
                raise CourseError(f"{where}: EXERCISE {ex_id} has an empty region")
            found.append((open_, n))
            open_ = None
    if open_ is not None:
        raise CourseError(f"{rel}:{open_[1]}: EXERCISE {open_[0]} BEGIN has no END")
    tree = ast.parse(text, filename=rel) if found else None
    return [
        Exercise(id=ex_id, chapter=EXERCISE_ID.match(ex_id)["chapter"], task=task, file=rel,
                 function=_enclosing_function(tree, begin), begin=begin, end=end)
        for (ex_id, begin, _, task), end in found
    ]


def _declared(tree: ast.Module, name: str, rel: str) -> list[tuple[str, str]]:
    """(exercise id, -k expression) pairs of the literal dict ``name``; a key may be a tuple of ids."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            value = ast.literal_eval(node.value)
            if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
                raise CourseError(f"{rel}: {name} must be a dict of exercise id(s) -> pytest -k expression")
            return [(ex_id, keyword) for key, keyword in value.items()
                    for ex_id in ((key,) if isinstance(key, str) else key)]
    return []


def find_exercises(root: Path) -> list[Exercise]:
    """Every exercise of the project, in id order, with the tests that check it and that need it.

    Raises CourseError for duplicate ids, an exercise no test file claims, a claim of an exercise
    that has no marker, a DEPENDS outside the file that grades the exercise or naming an unknown
    exercise or one of its own chapter, or a chapter with fewer than 2 or more than 4 exercises.
    """
    root = Path(root)
    exercises: dict[str, Exercise] = {}
    for path in sorted((root / "minillm").rglob("*.py")):
        for ex in parse_markers(path.read_text(), path.relative_to(root).as_posix()):
            if ex.id in exercises:
                first = exercises[ex.id]
                where = f"{first.file}:{first.begin} and {ex.file}:{ex.begin}"
                raise CourseError(f"exercise {ex.id} is marked twice: {where}")
            exercises[ex.id] = ex
    depends = []
    for path in sorted((root / "tests").glob("test_*.py")):
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(), filename=rel)
        depends += [(rel, ex_id, ids) for ex_id, ids in _declared(tree, "DEPENDS", rel)]
        for kind in ("EXERCISES", "NEEDS"):
            for ex_id, keyword in _declared(tree, kind, rel):
                if ex_id not in exercises:
                    raise CourseError(f"{rel}: {kind} names exercise {ex_id}, which no source file marks")
                ex = exercises[ex_id]
                if kind == "NEEDS":
                    ex.also_fails.append(Selection(rel, keyword))
                elif ex.checks is not None:
                    raise CourseError(f"exercise {ex_id} is checked by two files: {ex.checks.tests} and {rel}")
                else:
                    ex.checks = Selection(rel, keyword)
    for rel, ex_id, ids in depends:
        _add_depends(exercises, rel, ex_id, [i.strip() for i in ids.split(",")])
    chapters: dict[str, list[Exercise]] = {}
    for ex in exercises.values():
        if ex.checks is None:
            raise CourseError(f"exercise {ex.id} ({ex.file}:{ex.begin}) is checked by no test file's EXERCISES")
        chapters.setdefault(ex.chapter, []).append(ex)
    for chapter, members in chapters.items():
        if not 2 <= len(members) <= 4:
            raise CourseError(f"chapter {chapter} has {len(members)} exercises; every chapter needs 2-4")
        notebook = chapter_notebook(root, chapter)
        if notebook is not None:
            for ex in members:
                ex.also_fails.append(Selection(NOTEBOOK_TEST, notebook.stem))
    return sorted(exercises.values(), key=lambda e: exercise_sort_key(e.id))


def _add_depends(exercises: dict[str, Exercise], rel: str, ex_id: str, ids: list[str]) -> None:
    """Record DEPENDS[ex_id] = ids of test file ``rel``; CourseError for a declaration that cannot hold."""
    ex = exercises.get(ex_id)
    if ex is None or ex.checks is None or ex.checks.tests != rel:
        raise CourseError(f"{rel}: DEPENDS names exercise {ex_id}, which this file does not grade (EXERCISES)")
    for dep in ids:
        if dep not in exercises:
            raise CourseError(f"{rel}: DEPENDS[{ex_id!r}] names exercise {dep!r}, which no source file marks")
        if exercises[dep].chapter == ex.chapter:
            raise CourseError(f"{rel}: DEPENDS[{ex_id!r}] names {dep}, of the same chapter (solved with it anyway)")
    ex.depends = sorted(set(ex.depends) | set(ids), key=exercise_sort_key)


def exercise_sort_key(ex_id: str) -> tuple:
    chapter, number = ex_id.split(".")
    return (chapter.startswith("A"), int(chapter.lstrip("A")), int(number))


def chapter_notebook(root: Path, chapter: str) -> Path | None:
    """notebooks/03_*.ipynb for chapter "3", notebooks/A1_*.ipynb for "A1"; None when there is none."""
    prefix = chapter if chapter.startswith("A") else f"{int(chapter):02d}"
    found = sorted((Path(root) / "notebooks").glob(f"{prefix}_*.ipynb"))
    return found[0] if found else None


# ------------------------------------------------------------------------------------------------
# writing the student edition


def stub_source(text: str, exercises: list[Exercise]) -> str:
    """Replace the lines between each BEGIN and END marker by one ``raise NotImplementedError``, after
    a comment naming the exercises its grading tests also need (``depends``) when there are any."""
    lines = text.splitlines(keepends=True)
    for ex in sorted(exercises, key=lambda e: e.begin, reverse=True):
        indent = MARKER.match(lines[ex.begin - 1])["indent"]
        message = stub_message(ex.id, ex.task)
        needs = [f"{indent}# {depends_note(ex)}\n"] if ex.depends else []
        lines[ex.begin : ex.end - 1] = needs + [f"{indent}raise NotImplementedError({json.dumps(message)})\n"]
    return "".join(lines)


def depends_note(ex: Exercise) -> str:
    """The sentence the stub and the manifest give an exercise with dependencies."""
    return f"its grading tests also run exercise(s) {', '.join(ex.depends)}: solve those too"


def copy_project(root: Path, out: Path, leave_out: tuple = ()) -> Path:
    """Copy the project to ``out`` without .git, caches, build outputs, training state and the
    ``leave_out`` paths (relative). The student edition, the kit's tests and the bug zoo use it."""
    root = Path(root)
    skip = {(root / rel).resolve() for rel in leave_out}

    def ignore(folder, names):
        return set(shutil.ignore_patterns(*IGNORED)(folder, names)) | {
            n for n in names if (Path(folder) / n).resolve() in skip}

    shutil.copytree(root, out, ignore=ignore, dirs_exist_ok=True)
    return Path(out)


def stubbed_sources(root: Path, exercises: list[Exercise]) -> dict[str, str]:
    """{file: its text with these exercises stubbed}."""
    by_file: dict[str, list[Exercise]] = {}
    for ex in exercises:
        by_file.setdefault(ex.file, []).append(ex)
    return {rel: stub_source((Path(root) / rel).read_text(), members) for rel, members in by_file.items()}


def manifest(exercises: list[Exercise]) -> list[dict]:
    rows = []
    for ex in exercises:
        row = asdict(ex)
        row["command"] = ex.command
        row["also_fails"] = [dict(asdict(s), command=s.command) for s in ex.also_fails]
        row["checks"] = dict(asdict(ex.checks), command=ex.command)
        rows.append(row)
    return rows


def manifest_markdown(exercises: list[Exercise]) -> str:
    out = ["# Exercises", "",
           "Each marked region raises `NotImplementedError` until you write it. The command in the last",
           "column grades it; the tests under *also fails* pass once it (and what they use) is solved.", "",
           "| exercise | chapter | file | function | what to implement | also needs | grade with |",
           "|---|---|---|---|---|---|---|"]
    for ex in exercises:
        where = f"`{ex.file}` | `{ex.function}`"
        out.append(f"| {ex.id} | {ex.chapter} | {where} | {ex.task} | {', '.join(ex.depends)} | `{ex.command}` |")
    out += ["", "## Also fails until solved", ""]
    for ex in exercises:
        out.append(f"- **{ex.id}**: " + "; ".join(f"`{s.command}`" for s in ex.also_fails))
    return "\n".join(out) + "\n"


def select_chapters(exercises: list[Exercise], chapters=None) -> list[Exercise]:
    """The exercises of ``chapters`` ("3", "A1"; None: all); CourseError naming an unknown chapter."""
    if chapters is None:
        return exercises
    known = sorted({ex.chapter for ex in exercises}, key=lambda c: exercise_sort_key(c + ".0"))
    unknown = [c for c in chapters if c not in known]
    if unknown:
        raise CourseError(f"no exercises in chapter(s) {', '.join(unknown)}; chapters: {', '.join(known)}")
    return [ex for ex in exercises if ex.chapter in chapters]


def student_edition(root: Path, out: Path, chapters=None) -> list[Exercise]:
    """Write the student edition of ``root`` to ``out`` (empty or absent, and outside ``root``) with
    the exercises of ``chapters`` (None: every chapter) stubbed -> those exercises."""
    root, out = Path(root).resolve(), Path(out).resolve()
    if out == root or root in out.parents:
        raise CourseError(f"{out} is inside the project {root}: the copy would contain itself; choose a folder outside")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CourseError(f"{out} is not an empty folder: refusing to overwrite it")
    exercises = select_chapters(find_exercises(root), chapters)
    copy_project(root, out, leave_out=INSTRUCTORS_ONLY)
    for rel, text in stubbed_sources(root, exercises).items():
        (out / rel).write_text(text)
    (out / MANIFEST_JSON).write_text(json.dumps(manifest(exercises), indent=1) + "\n")
    (out / MANIFEST_MD).write_text(manifest_markdown(exercises))
    return exercises


# ------------------------------------------------------------------------------------------------
# grading and the edition's own check


GRADE_TIMEOUT_S = 900  # per exercise


@dataclass
class Grade:
    exercise: str
    command: str
    depends: list[str]  # exercises of other chapters its grading tests also run
    passed: int  # tests of the grading selection that passed
    total: int  # tests it selected (skipped ones not counted)
    seconds: float

    @property
    def ok(self) -> bool:
        return self.total > 0 and self.passed == self.total


def project_exercises(project: Path) -> list[Exercise]:
    """The exercises of a project: its MANIFEST.json (a student edition) or, failing that, its markers."""
    path = Path(project) / MANIFEST_JSON
    if not path.is_file():
        return find_exercises(project)
    exercises = []
    for row in json.loads(path.read_text()):
        checks = Selection(**{k: row["checks"][k] for k in ("tests", "keyword")})
        also = [Selection(s["tests"], s["keyword"]) for s in row["also_fails"]]
        fields = {k: row[k] for k in ("id", "chapter", "task", "file", "function", "begin", "end")}
        exercises.append(Exercise(**fields, checks=checks, also_fails=also, depends=row.get("depends", [])))
    return exercises


def grade(project: Path, chapters=None) -> list[Grade]:
    """Run each exercise's grading selection (of ``chapters``; None: all) in ``project`` -> its grades."""
    project = Path(project).resolve()
    if not (project / "tests").is_dir():
        raise CourseError(f"{project} has no tests/ folder: point grade at a copy of the project")
    grades = []
    for ex in select_chapters(project_exercises(project), chapters):
        args = [ex.checks.tests] + (["-k", ex.checks.keyword] if ex.checks.keyword else [])
        outcomes, seconds, _ = pytest_outcomes(project, args, GRADE_TIMEOUT_S)
        counted = [o for _, o in outcomes if o != "skipped"]
        grades.append(Grade(ex.id, ex.command, ex.depends, counted.count("passed"), len(counted), seconds))
    return grades


def format_grades(grades: list[Grade]) -> str:
    """The score table: one row per exercise, then the total."""
    from ..notebook import format_table

    rows = [{"exercise": g.exercise, "tests passed": f"{g.passed}/{g.total}", "result": "pass" if g.ok else "FAIL",
             "time s": round(g.seconds, 1), "also needs": ",".join(g.depends), "grade with": g.command}
            for g in grades]
    solved = sum(g.ok for g in grades)
    return format_table(rows) + f"\n\n{solved}/{len(grades)} exercises pass"


MIN_SOLUTION_LINE = 28  # characters: shorter lines ("return out", "self.allocator.free(block)") give nothing away
STRUCTURE = ("#", "for ", "while ", "with ", "else", "try")  # comments and loop or block headers, not the answer


def solution_lines(root: Path, ex: Exercise) -> set[str]:
    """The lines of an exercise's reference solution that would give it away, stripped: at least
    MIN_SOLUTION_LINE characters and not a comment or a loop/block header."""
    lines = (Path(root) / ex.file).read_text().splitlines()[ex.begin : ex.end - 1]
    return {s for s in (line.strip() for line in lines) if len(s) >= MIN_SOLUTION_LINE and not s.startswith(STRUCTURE)}


def leaked_solutions(root: Path, edition: Path, exercises: list[Exercise]) -> list[tuple[str, str, str]]:
    """Solution lines of ``root``'s exercises found verbatim in a text file of the student ``edition``
    -> [(exercise, file, line)]; empty when the edition gives no answer away."""
    wanted = {line: ex.id for ex in exercises for line in solution_lines(root, ex)}
    leaks = []
    for path in sorted(Path(edition).rglob("*")):
        if not path.is_file() or path.suffix in (".npz", ".png", ".so", ".pyc"):
            continue
        text = path.read_text(errors="replace")
        rel = path.relative_to(edition).as_posix()
        leaks += [(ex_id, rel, line) for line, ex_id in wanted.items()
                  if line in text or json.dumps(line)[1:-1] in text]  # as written, or inside a notebook's JSON
    return leaks
