"""The course kit: turn the reference into a student edition, grade a submission with the reference's tests.

Each chapter marks the functions a student writes with a line
``# EXERCISE 3.1 BEGIN: <what to implement>`` before the reference solution and a line
``# EXERCISE 3.1 END`` after it. The tests say what they check, with markers that this module reads
from the test files' source, without importing them:

    @pytest.mark.exercise("3.1")              # grades exercise 3.1 (its chapter's test file)
    @pytest.mark.uses_exercise("3.1", "3.3")  # runs those exercises' code: fails until they are solved

and ``tests/conftest.py`` holds the one table of what each exercise's grading tests also run:

    EXERCISE_DEPENDS = {"3.3": "1.1, 1.2, 3.1", ...}   # solve these first (chapters and the exercise's own)

``python -m pytest tests/test_kv_cache.py --exercise 3.1`` runs the tests marked for 3.1 (the option
lives in tests/conftest.py). ``student_edition(root, out)`` copies the project's tracked files,
replaces the body of every chosen region by ``raise NotImplementedError("Exercise 3.1: <task>")``
(markers, signature and docstring kept) and writes the manifest. ``grade(submission)`` reads from
the submission only the bodies of the handed-out exercise regions, refuses a body that reaches for
the test machinery, the process, files or code made at run time (REFUSED and the rules beside it),
writes the others into a fresh copy of the reference project (its tests, its fixtures, every other
line of its library: never the submission's), runs each exercise's grading command there with no
other minillm importable, and says pass, FAIL, REFUSED, MISSING, or BLOCKED where a test dies on the
stub of a dependency the instructor handed out and the submission left unsolved.
docs/instructors.md explains the rules; tests/test_course.py enforces them.
"""

from __future__ import annotations

import ast
import fnmatch
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..notebook import MARKER, UNSOLVED, stub_message
from .project import is_project_root, run_pytest

EXERCISE_ID = re.compile(r"^(?P<chapter>A?\d+)\.\d+$")  # 3.1, A1.2
GRADES, USES = "exercise", "uses_exercise"  # the test markers
DEPENDS_FILE, DEPENDS_TABLE = "tests/conftest.py", "EXERCISE_DEPENDS"
NOTEBOOK_TEST = "tests/test_notebooks.py"
MANIFEST_JSON, MANIFEST_MD = "MANIFEST.json", "MANIFEST.md"
# never copied: version control, caches, build outputs, training state, logs
IGNORED = (".git", ".venv", "venv", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis", ".benchmarks",
           ".ipynb_checkpoints", "_build", "build", "*.egg-info", "*.pyc", "*.so", "*.tmp", "*.train.npz",
           "*.log.json")
# what a copy holds when the project is not a git checkout (a student edition, an unpacked zip):
# the project's own folders and top-level files; anything else there (a .env, a venv, a model file
# downloaded beside it) is not part of the project
PROJECT_FILES = ("minillm", "tests", "notebooks", "docs", ".ci", "README.md", "LICENSE", "pyproject.toml",
                 "requirements*.txt", ".gitignore")
# left out of the student edition: the bug zoo holds reference lines, the kit checks the reference
# and the flash mutants are exercises 4.1 and 4.2 with one bug each, the fix in their docstrings
INSTRUCTORS_ONLY = ("tests/test_course.py", "tests/test_bug_zoo.py", "tests/fixtures/bug_zoo.py",
                    "tests/fixtures/course_plugin.py", "tests/fixtures/flash_mutants.py")


class CourseError(ValueError):
    """Malformed exercise markers or declarations, an unknown chapter, or an unusable output folder."""


@dataclass
class Selection:
    """Tests that pytest selects: ``tests`` (a file or one test's node id) and an option (``--exercise 3.1``)."""

    tests: str  # tests/test_x.py or tests/test_x.py::test_y[param]
    option: str = ""  # "--exercise 3.1", "--uses-exercise 3.1" or "" (the node id alone)

    @property
    def args(self) -> list[str]:
        return [self.tests, *self.option.split()]

    @property
    def command(self) -> str:
        target = f'"{self.tests}"' if "[" in self.tests else self.tests
        return " ".join(["python -m pytest", target, self.option]).strip()


@dataclass
class Exercise:
    id: str  # "3.1"
    chapter: str  # "3"
    task: str  # the text after BEGIN:
    file: str  # minillm/kv_cache.py
    function: str  # KVCache.attend
    begin: int  # 1-based line of the BEGIN marker
    end: int  # 1-based line of the END marker
    tests: str = ""  # the test file whose tests are marked exercise(id)
    graded_by: list[str] = field(default_factory=list)  # those tests' names (the functions carrying the mark)
    also_fails: list[Selection] = field(default_factory=list)  # other tests that need it solved
    depends: list[str] = field(default_factory=list)  # exercises its grading tests also run (EXERCISE_DEPENDS)

    @property
    def checks(self) -> Selection:
        return Selection(self.tests, f"--exercise {self.id}")

    @property
    def command(self) -> str:
        return self.checks.command if self.tests else ""


# ------------------------------------------------------------------------------------------------
# reading the markers and the declarations


def _enclosing_defs(tree: ast.Module, line: int) -> list[ast.AST]:
    """The functions and classes around ``line``, outermost first: [ClassDef KVCache, FunctionDef attend]."""
    defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    found, body = [], tree.body
    while True:
        inner = next((n for n in body if isinstance(n, defs) and n.lineno <= line <= n.end_lineno), None)
        if inner is None:
            return found
        found.append(inner)
        body = [n for n in ast.walk(inner) if n is not inner and isinstance(n, defs)]


def _enclosing_function(tree: ast.Module, line: int) -> str:
    """Qualified name of the innermost function around ``line``: "KVCache.attend", "generate.next_logits"."""
    return ".".join(node.name for node in _enclosing_defs(tree, line))


def scan_markers(text: str, rel: str) -> list[tuple[str, int, int, str]]:
    """[(exercise id, BEGIN line, END line, task)] of the source ``text`` of file ``rel``, without
    parsing it as Python (lines are 1-based); CourseError for malformed markers."""
    found, open_ = [], None
    for n, line in enumerate(text.splitlines(), 1):
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
            found.append((ex_id, open_[1], n, open_[3]))
            open_ = None
    if open_ is not None:
        raise CourseError(f"{rel}:{open_[1]}: EXERCISE {open_[0]} BEGIN has no END")
    return found


def parse_markers(text: str, rel: str) -> list[Exercise]:
    """The marked regions of the source ``text`` of file ``rel``; CourseError for malformed markers."""
    found = scan_markers(text, rel)
    tree = ast.parse(text, filename=rel) if found else None
    return [
        Exercise(id=ex_id, chapter=EXERCISE_ID.match(ex_id)["chapter"], task=task, file=rel,
                 function=_enclosing_function(tree, begin), begin=begin, end=end)
        for ex_id, begin, end, task in found
    ]


def _mark_name(call: ast.Call) -> str | None:
    """"exercise" for ``pytest.mark.exercise(...)`` (or ``mark.exercise(...)``), else None."""
    func = call.func
    if isinstance(func, ast.Attribute) and func.attr in (GRADES, USES):
        owner = func.value
        if (isinstance(owner, ast.Attribute) and owner.attr == "mark") or (isinstance(owner, ast.Name)
                                                                            and owner.id == "mark"):
            return func.attr
    return None


def read_test_marks(text: str, rel: str) -> list[tuple[str, str, str]]:
    """(marker, exercise id, test) for every ``exercise``/``uses_exercise`` mark in the test file's
    source: on a test's decorators, on one of its parameters (``pytest.param(..., marks=...)``) or on
    a module-level parameter list (test ""). CourseError for an id that is not a string literal."""
    tree = ast.parse(text, filename=rel)
    owner = {}  # id(call) -> the test function whose decorators hold it
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for dec in node.decorator_list:
                for sub in ast.walk(dec):
                    owner[id(sub)] = node.name
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (name := _mark_name(node)):
            if node.keywords or not node.args or not all(isinstance(a, ast.Constant) and isinstance(a.value, str)
                                                         for a in node.args):
                raise CourseError(f"{rel}:{node.lineno}: pytest.mark.{name} takes exercise ids as string literals")
            found += [(name, a.value, owner.get(id(node), "")) for a in node.args]
    return found


def _marks_by_test(marks: list[tuple[str, str, str]]) -> list[tuple[str, set, set]]:
    """[(test, exercises its own marks grade, exercises they use)] of the tests that grade one."""
    tests: dict[str, tuple[set, set]] = {}
    for name, ex_id, test in marks:
        if test:
            tests.setdefault(test, (set(), set()))[name == USES].add(ex_id)
    return [(test, graded, used) for test, (graded, used) in tests.items() if graded]


def read_depends(root: Path) -> dict[str, list[str]]:
    """The table EXERCISE_DEPENDS of tests/conftest.py: {exercise: [exercises its grading tests also run]}."""
    path = Path(root) / DEPENDS_FILE
    if not path.is_file():
        return {}
    for node in ast.parse(path.read_text(), filename=DEPENDS_FILE).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == DEPENDS_TABLE
                                                for t in node.targets):
            table = ast.literal_eval(node.value)
            if not isinstance(table, dict) or not all(isinstance(v, str) for v in table.values()):
                raise CourseError(f"{DEPENDS_FILE}: {DEPENDS_TABLE} must be a dict of exercise -> 'ids, ...'")
            return {ex_id: [i.strip() for i in ids.split(",") if i.strip()] for ex_id, ids in table.items()}
    return {}


def find_exercises(root: Path) -> list[Exercise]:
    """Every exercise of the project, in id order, with the tests that grade it and that need it.

    Raises CourseError for duplicate ids, an exercise no test is marked for or marked in two files, a
    mark naming an exercise that has no region, a test file grading exercises of two chapters, an
    EXERCISE_DEPENDS entry naming an unknown exercise or itself, or a chapter with fewer than 2 or
    more than 4 exercises.
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
    graded_uses = []  # (file, test, exercises it grades, exercises whose code it runs)
    for path in sorted((root / "tests").glob("test_*.py")):
        rel = path.relative_to(root).as_posix()
        uses, chapters = set(), set()
        marks = read_test_marks(path.read_text(), rel)
        for name, ex_id, test in marks:
            ex = exercises.get(ex_id)
            if ex is None:
                raise CourseError(f"{rel}: a {name} mark names exercise {ex_id}, which no source file marks")
            if name == USES:
                uses.add(ex_id)
                continue
            if ex.tests not in ("", rel):
                raise CourseError(f"exercise {ex_id} is graded by tests in two files: {ex.tests} and {rel}")
            ex.tests = rel
            chapters.add(ex.chapter)
            if test and test not in ex.graded_by:
                ex.graded_by.append(test)
        if len(chapters) > 1:
            raise CourseError(f"{rel} grades exercises of chapters {', '.join(sorted(chapters))}: one chapter a file")
        for ex_id in sorted(uses, key=exercise_sort_key):
            exercises[ex_id].also_fails.append(Selection(rel, f"--uses-exercise {ex_id}"))
        graded_uses += [(rel, test, graded, used) for test, graded, used in _marks_by_test(marks)]
    for ex_id, ids in read_depends(root).items():
        for dep in [ex_id, *ids]:
            if dep not in exercises:
                raise CourseError(f"{DEPENDS_FILE}: {DEPENDS_TABLE} names exercise {dep!r}, which no source file marks")
        if ex_id in ids:
            raise CourseError(f"{DEPENDS_FILE}: {DEPENDS_TABLE}[{ex_id!r}] names the exercise itself")
        exercises[ex_id].depends = sorted(set(ids), key=exercise_sort_key)
    for rel, test, graded, used in graded_uses:  # a grading test that runs Y's code is blocked by Y
        for ex_id in graded:
            missing = sorted((used | graded) - {ex_id} - set(exercises[ex_id].depends), key=exercise_sort_key)
            if missing:
                raise CourseError(f"{rel}::{test} grades {ex_id} and runs {', '.join(missing)}, which "
                                  f"{DEPENDS_FILE}'s {DEPENDS_TABLE}[{ex_id!r}] does not name")
    chapters: dict[str, list[Exercise]] = {}
    for ex in exercises.values():
        if not ex.tests:
            raise CourseError(f"exercise {ex.id} ({ex.file}:{ex.begin}) is graded by no test: "
                              f"mark its tests @pytest.mark.exercise({ex.id!r})")
        chapters.setdefault(ex.chapter, []).append(ex)
    for chapter, members in chapters.items():
        if not 2 <= len(members) <= 4:
            raise CourseError(f"chapter {chapter} has {len(members)} exercises; every chapter needs 2-4")
        notebook = chapter_notebook(root, chapter)
        if notebook is not None:
            for ex in members:
                ex.also_fails.append(Selection(f"{NOTEBOOK_TEST}::test_notebook_executes[{notebook.name}]"))
    return sorted(exercises.values(), key=lambda e: exercise_sort_key(e.id))


def exercise_list(text: str) -> list[str]:
    """An argparse type: "3.1,5.2" -> ["3.1", "5.2"]."""
    import argparse

    ids = [i.strip() for i in text.split(",") if i.strip()]
    bad = [i for i in ids if not EXERCISE_ID.match(i)]
    if not ids or bad:
        raise argparse.ArgumentTypeError(f"name exercises as 3.1,5.2 (got {text!r})")
    return ids


def exercise_sort_key(ex_id: str) -> tuple:
    chapter, number = ex_id.split(".")
    return (chapter.startswith("A"), int(chapter.lstrip("A")), int(number))


def chapter_notebook(root: Path, chapter: str) -> Path | None:
    """notebooks/03_*.ipynb for chapter "3", notebooks/A1_*.ipynb for "A1"; None when there is none."""
    prefix = chapter if chapter.startswith("A") else f"{int(chapter):02d}"
    found = sorted((Path(root) / "notebooks").glob(f"{prefix}_*.ipynb"))
    return found[0] if found else None


def select(exercises: list[Exercise], chapters=None, ids=None, among="") -> list[Exercise]:
    """The exercises of ``chapters`` ("3", "A1") and those named in ``ids`` ("3.1"); both None: all.
    CourseError naming an unknown chapter or exercise (``among``: where they were looked for, " in ...")."""
    if chapters is None and ids is None:
        return exercises
    known = sorted({ex.chapter for ex in exercises}, key=lambda c: exercise_sort_key(c + ".0"))
    unknown = [c for c in chapters or () if c not in known]
    if unknown:
        raise CourseError(f"no exercises in chapter(s) {', '.join(unknown)}{among}; chapters: {', '.join(known)}")
    unknown = [i for i in ids or () if i not in {ex.id for ex in exercises}]
    if unknown:
        raise CourseError(f"no exercise {', '.join(unknown)}{among}; exercises: {', '.join(ex.id for ex in exercises)}")
    return [ex for ex in exercises if ex.chapter in (chapters or ()) or ex.id in (ids or ())]


# ------------------------------------------------------------------------------------------------
# copying the project


def project_files(root: Path) -> list[str]:
    """The project's files, relative to ``root``: what git tracks when ``root`` is the top of a git
    checkout, else the files under PROJECT_FILES; never a symbolic link (nor what lies behind one),
    never a cache or build output (IGNORED)."""
    root = Path(root).resolve()
    tracked = _git_files(root)
    if tracked is None:
        tracked = walk_files(root, PROJECT_FILES)
    keep = []
    for rel in tracked:
        parts = rel.split("/")
        if any(fnmatch.fnmatch(part, pattern) for part in parts for pattern in IGNORED):
            continue
        path, inside = root, True
        for part in parts:  # no link anywhere on the way (a tracked link to a folder, a linked parent)
            path = path / part
            if path.is_symlink():
                inside = False
                break
        if inside and path.is_file():
            keep.append(rel)
    return keep


def walk_files(root: Path, patterns=("*",)) -> list[str]:
    """The files under the entries of ``root`` that match ``patterns``, relative to ``root``; links
    (to files or folders) are not followed."""
    root, found = Path(root), []
    for entry in sorted({p for pattern in patterns for p in root.glob(pattern)}):
        if entry.is_symlink():
            continue
        if entry.is_file():
            found.append(entry.name)
        for folder, dirs, files in os.walk(entry):  # os.walk does not follow links to folders
            dirs[:] = sorted(d for d in dirs if not (Path(folder) / d).is_symlink())
            found += [(Path(folder) / f).relative_to(root).as_posix() for f in sorted(files)]
    return found


def _git_files(root: Path) -> list[str] | None:
    """``git ls-files`` of ``root`` when it is the top of a git work tree, else None."""
    if not (root / ".git").exists() or shutil.which("git") is None:
        return None
    top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != root:
        return None
    listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, text=True)
    return [p for p in listed.stdout.split("\0") if p] if listed.returncode == 0 else None


def copy_project(root: Path, out: Path, leave_out: tuple = ()) -> Path:
    """Copy the project's files (``project_files``) to ``out``, less the ``leave_out`` paths (relative,
    files or folders). The student edition, grading, the kit's tests and the bug zoo use it."""
    root, out = Path(root), Path(out)
    skip = tuple(rel.rstrip("/") for rel in leave_out)
    for rel in project_files(root):
        if any(rel == s or rel.startswith(s + "/") for s in skip):
            continue
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, out / rel)
    return out


# ------------------------------------------------------------------------------------------------
# writing the student edition


def with_bodies(text: str, bodies: list[tuple[int, int, list[str]]]) -> str:
    """``text`` with the lines strictly between each BEGIN line and END line (1-based) replaced by
    the given lines (each ending in a newline): [(begin, end, lines)]."""
    lines = text.splitlines(keepends=True)
    for begin, end, body in sorted(bodies, key=lambda b: b[0], reverse=True):
        lines[begin : end - 1] = body
    return "".join(lines)


def stub_body(text: str, ex: Exercise, needs: list[str]) -> list[str]:
    """The lines of exercise ``ex``'s stub in the source ``text``: a comment naming the exercises its
    grading tests also need (``needs``, when any), then ``raise NotImplementedError("Exercise 3.1: <task>")``."""
    indent = MARKER.match(text.splitlines()[ex.begin - 1])["indent"]
    note = [f"{indent}# {depends_note(needs)}\n"] if needs else []
    return note + [f"{indent}raise NotImplementedError({json.dumps(stub_message(ex.id, ex.task))})\n"]


def stub_source(text: str, exercises: list[Exercise], stubbed=None) -> str:
    """Replace the lines between each BEGIN and END marker by one ``raise NotImplementedError``, after
    a comment naming the exercises its grading tests also need (``depends``; of those, only the ones
    in ``stubbed`` when given: the others keep their reference code)."""
    needs = {ex.id: [d for d in ex.depends if stubbed is None or d in stubbed] for ex in exercises}
    return with_bodies(text, [(ex.begin, ex.end, stub_body(text, ex, needs[ex.id])) for ex in exercises])


def depends_note(depends: list[str]) -> str:
    """The sentence the stub and the manifest give an exercise with dependencies."""
    return f"its grading tests also run exercise(s) {', '.join(depends)}: solve those too"


def stubbed_sources(root: Path, exercises: list[Exercise]) -> dict[str, str]:
    """{file: its text with these exercises stubbed}."""
    by_file: dict[str, list[Exercise]] = {}
    for ex in exercises:
        by_file.setdefault(ex.file, []).append(ex)
    stubbed = {ex.id for ex in exercises}
    return {rel: stub_source((Path(root) / rel).read_text(), members, stubbed) for rel, members in by_file.items()}


def _in_edition(ex: Exercise, stubbed: set[str]) -> Exercise:
    """The exercise as the edition's manifest shows it: only the dependencies the edition stubs."""
    return Exercise(**{**asdict(ex), "also_fails": list(ex.also_fails),
                       "depends": [d for d in ex.depends if d in stubbed]})


def manifest(exercises: list[Exercise]) -> list[dict]:
    rows = []
    for ex in exercises:
        row = asdict(ex)
        row["command"] = ex.command
        row["also_fails"] = [dict(asdict(s), command=s.command) for s in ex.also_fails]
        rows.append(row)
    return rows


LAB_COMMAND = "python -m minillm course lab"


def manifest_markdown(exercises: list[Exercise]) -> str:
    out = ["# Exercises", "",
           "## Install and open", "",
           "In this folder, in a virtual environment of its own or the one you already use:", "",
           "```bash",
           "pip install -r requirements.txt",
           f"{LAB_COMMAND}        # JupyterLab on notebooks/, importing the minillm of this folder",
           "```", "",
           f"`{LAB_COMMAND}` puts this folder first on the notebooks' import path, so they run your code even",
           "where another copy of minillm is installed; its first line names the folder they import from.",
           "Run the grading commands below from this folder too.", "",
           "## What to write", "",
           "Each marked region raises `NotImplementedError` until you write it. The command in the last",
           "column grades it; *also needs* names the exercises its tests also run (solve those first);",
           "the tests under *also fails* pass once it (and what they use) is solved.", "",
           "| exercise | chapter | file | function | what to implement | also needs | grade with |",
           "|---|---|---|---|---|---|---|"]
    for ex in exercises:
        where = f"`{ex.file}` | `{ex.function}`"
        out.append(f"| {ex.id} | {ex.chapter} | {where} | {ex.task} | {', '.join(ex.depends)} | `{ex.command}` |")
    out += ["", "## Also fails until solved", ""]
    for ex in exercises:
        out.append(f"- **{ex.id}**: " + "; ".join(f"`{s.command}`" for s in ex.also_fails))
    return "\n".join(out) + "\n"


def student_edition(root: Path, out: Path, chapters=None, exercises=None) -> list[Exercise]:
    """Write the student edition of ``root`` to ``out`` (empty or absent, and outside ``root``) with
    the exercises of ``chapters`` and those named in ``exercises`` stubbed (both None: every one)
    -> those exercises, as the manifest lists them."""
    root, out = Path(root).resolve(), Path(out).resolve()
    if out == root or root in out.parents:
        raise CourseError(f"{out} is inside the project {root}: the copy would contain itself; choose a folder outside")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CourseError(f"{out} is not an empty folder: refusing to overwrite it")
    chosen = select(find_exercises(root), chapters=chapters, ids=exercises)
    copy_project(root, out, leave_out=INSTRUCTORS_ONLY)
    for rel, text in stubbed_sources(root, chosen).items():
        (out / rel).write_text(text)
    stubbed = {ex.id for ex in chosen}
    listed = [_in_edition(ex, stubbed) for ex in chosen]
    (out / MANIFEST_JSON).write_text(json.dumps(manifest(listed), indent=1) + "\n")
    (out / MANIFEST_MD).write_text(manifest_markdown(listed))
    return listed


# ------------------------------------------------------------------------------------------------
# the notebooks of an edition


def lab_root(cwd=None) -> Path:
    """The project a student opens the notebooks of: the nearest one at or above ``cwd`` (their
    edition), else the checkout this package runs from."""
    cwd = Path(cwd or Path.cwd()).resolve()
    for candidate in (cwd, *cwd.parents):
        if is_project_root(candidate):
            return candidate
    from .project import project_root

    return project_root()


def lab_environment(root: Path, env=None) -> dict:
    """``env`` (default: this process's) with ``root`` first on PYTHONPATH: a Jupyter server started
    with it starts kernels that import ``root``'s minillm, whatever else is installed."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(root).resolve()), *filter(None, [env.get("PYTHONPATH")])])
    return env


def lab(root: Path, jupyter_args=()) -> int:
    """Run ``jupyter <jupyter_args>`` (default: ``lab notebooks``) in ``root`` with ``lab_environment``."""
    args = list(jupyter_args) or ["lab", "notebooks"]
    print(f"notebooks import minillm from {Path(root).resolve() / 'minillm'}", flush=True)
    return subprocess.call([sys.executable, "-m", "jupyter", *args], cwd=root, env=lab_environment(root))


# ------------------------------------------------------------------------------------------------
# grading: what is taken from a submission


GRADE_TIMEOUT_S = 900  # per exercise
MAX_SOURCE_BYTES = 1_000_000  # a submission's source file, or a manifest, larger than this is refused unread

# What a region body may not reach for: the test machinery, the interpreter and the process, files
# and the network, code made or looked up at run time. A body that names one of these (as a variable,
# an attribute, or a module it imports or imports from) is refused: it earns nothing, the stub runs in
# its place, and its grade says why: "REFUSED (imports pytest: the test machinery)". Refused too: an
# import of a module outside REGION_IMPORTS, a dunder outside SAFE_DUNDERS, `global`/`nonlocal`, an
# attribute assigned on anything but a parameter of the function (`np.allclose = ...`), an item
# assigned into a module-level name, a private name reached through a module (`np._core`), a class
# made in the body (`class`, `type(name, bases, namespace)`: its methods would stand in for NumPy's),
# and a string naming a dunder (`{"__array_ufunc__": ...}`, `updated=("__dict__",)`).
REFUSED = {
    **dict.fromkeys(("pytest", "_pytest", "pluggy", "unittest", "hypothesis", "conftest", "testing", "test"),
                    "the test machinery"),
    **dict.fromkeys(("sys", "os", "posix", "atexit", "builtins", "signal", "gc", "inspect", "threading", "_thread",
                     "multiprocessing", "concurrent", "asyncio", "ctypes", "ctypeslib", "faulthandler", "resource",
                     "environ", "modules", "tools", "exit", "quit", "KeyboardInterrupt", "SystemExit",
                     "GeneratorExit", "BaseException", "mro", "f_globals", "f_locals", "f_back", "f_builtins",
                     "tb_frame", "tb_next", "gi_frame", "gi_code", "cr_frame", "ag_frame", "co_code"),
                    "the interpreter or the process"),
    **dict.fromkeys(("open", "io", "pathlib", "Path", "shutil", "tempfile", "glob", "socket", "ssl", "urllib",
                     "http", "pickle", "marshal", "shelve", "mmap", "load", "save", "savez", "savez_compressed",
                     "savetxt", "loadtxt", "genfromtxt", "fromfile", "fromregex", "tofile", "dump", "memmap",
                     "open_memmap", "DataSource"),
                    "files or the network"),
    **dict.fromkeys(("exec", "eval", "compile", "__import__", "importlib", "runpy", "subprocess", "f2py", "globals",
                     "locals", "vars", "getattr", "setattr", "delattr", "breakpoint", "input", "help",
                     "get_type_hints", "singledispatch", "singledispatchmethod"),
                    "code made or looked up at run time"),
    **dict.fromkeys(("update_wrapper", "wraps"), "attributes set on another object"),
    "ma": "masked arrays, whose masked entries every comparison skips",
}
REGION_IMPORTS = ("numpy", "math", "cmath", "itertools", "functools", "collections", "heapq", "bisect", "numbers",
                  "hashlib", "minillm")  # and the package's own modules (from .kv_cache import ...), not its tools
SAFE_DUNDERS = ("__getitem__", "__len__", "__contains__", "__iter__", "__next__", "__name__")
NESTED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def _chain(node: ast.AST) -> tuple[ast.AST, int, bool]:
    """The root of ``a.b[i].c`` (the Name ``a``, or whatever else it starts from), how many attributes
    the chain holds, and whether the one next to the root is an attribute."""
    attributes, next_to_root = 0, False
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Starred)):
        attributes += isinstance(node, ast.Attribute)
        next_to_root = isinstance(node, ast.Attribute)
        node = node.value
    return node, attributes, next_to_root


def _stored(node: ast.AST) -> list[ast.AST]:
    """The targets a statement (or comprehension) assigns or deletes, tuples unpacked."""
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor, ast.comprehension)):
        targets = [node.target]
    elif isinstance(node, ast.Delete):
        targets = node.targets
    elif isinstance(node, (ast.With, ast.AsyncWith)):
        targets = [item.optional_vars for item in node.items if item.optional_vars is not None]
    else:
        return []
    flat = []
    while targets:
        t = targets.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            targets += t.elts
        else:
            flat.append(t.value if isinstance(t, ast.Starred) else t)
    return flat


def _refused_name(name: str, verb: str) -> str:
    if name in REFUSED:
        return f"{verb} {name}: {REFUSED[name]}"
    if name.startswith("__") and name.endswith("__") and name not in SAFE_DUNDERS:
        return f"{verb} {name}: the interpreter's internals"
    return ""


def _refused_import(node: ast.Import | ast.ImportFrom) -> str:
    modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
    names = [a.asname for a in node.names if a.asname] + ([a.name for a in node.names]
                                                          if isinstance(node, ast.ImportFrom) else [])
    for module in modules:
        for part in filter(None, module.split(".")):
            if why := _refused_name(part, "imports"):
                return why
        top = module.split(".")[0]
        if (isinstance(node, ast.Import) or node.level == 0) and top not in REGION_IMPORTS:
            return f"imports {top}: a solution imports only {', '.join(REGION_IMPORTS)}"
    return next(filter(None, (_refused_name(n, "imports") for n in names)), "")


def _refused_store(target: ast.AST, params: set, local: set, nested: bool) -> str:
    if not isinstance(target, (ast.Attribute, ast.Subscript)):
        return ""
    root, attributes, next_to_root = _chain(target)
    what = ast.unparse(target)
    if not isinstance(root, ast.Name) or root.id not in local:
        return f"assigns {what}: state outside the function"
    if attributes and (nested or attributes > 1 or not next_to_root or root.id not in params):
        return f"assigns {what}: only a parameter's own attributes may be set (self.length = ...)"
    return ""


def refused_in_body(reference: str, ex: Exercise, body: list[str]) -> str:
    """Why grading refuses ``body`` as exercise ``ex``'s region (REFUSED and the rules above), or "".
    The body is read where it would run: in the reference file ``reference``, in place of the region."""
    text = with_bodies(reference, [(ex.begin, ex.end, body)])
    last = ex.begin + len(body)  # the region's last line in ``text``
    try:
        tree = ast.parse(text)
    except SyntaxError as exc:
        return f"does not parse: {exc.msg} (line {(exc.lineno or ex.begin) - ex.begin} of the region)"
    function = _enclosing_defs(tree, ex.begin)[-1]
    a = function.args
    params = {arg.arg for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if arg is not None}
    local = params | {n.id for n in ast.walk(function) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    inside = [n for n in ast.walk(function) if ex.begin < getattr(n, "lineno", 0) <= last]
    nested = {id(sub) for n in inside if isinstance(n, NESTED) for sub in ast.walk(n) if sub is not n}
    type_of = {id(n.func) for n in inside if isinstance(n, ast.Call) and len(n.args) == 1 and not n.keywords
               and not isinstance(n.args[0], ast.Starred)}  # type(x) asks; type(name, bases, namespace) makes
    for node in inside:
        if isinstance(node, ast.ClassDef):
            why = f"defines class {node.name}: a class made in a solution stands in for other code"
        elif isinstance(node, ast.Name) and node.id == "type" and id(node) not in type_of:
            why = "uses type(name, bases, namespace): a class made in a solution stands in for other code"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("__"):
            why = _refused_name(node.value, "names")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            why = _refused_import(node)
        elif isinstance(node, ast.Name):
            why = _refused_name(node.id, "uses")
        elif isinstance(node, ast.Attribute):
            root = _chain(node)[0]
            private = node.attr.startswith("_") and isinstance(root, ast.Name) and root.id not in local
            why = _refused_name(node.attr, "uses") or (
                f"uses {ast.unparse(node)}: a private name of another module" if private else "")
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            why = f"declares {ast.unparse(node)}: state outside the function"
        else:
            why = next(filter(None, (_refused_store(t, params, local, id(node) in nested) for t in _stored(node))), "")
        if why:
            return why
    return ""


def is_stub(text: str, ex: Exercise) -> bool:
    """Whether the region of ``ex`` (its lines in ``text``) in the source ``text`` is its stub: one ``raise
    NotImplementedError("Exercise <its id>: ...")`` (comments aside), as the student edition wrote it."""
    tree = ast.parse(text)
    parent = _enclosing_defs(tree, ex.begin)[-1]
    body = [n for n in ast.walk(parent) if isinstance(n, ast.stmt) and ex.begin < n.lineno < ex.end]
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or not isinstance(body[0].exc, ast.Call):
        return False
    call = body[0].exc
    message = call.args[0] if len(call.args) == 1 and not call.keywords else None
    return (isinstance(call.func, ast.Name) and call.func.id == "NotImplementedError"
            and isinstance(message, ast.Constant) and isinstance(message.value, str)
            and (m := UNSOLVED.match(message.value)) is not None and m["id"] == ex.id)


def read_submitted(submission: Path, rel: str) -> tuple[str | None, str]:
    """The text of the file ``rel`` of the folder ``submission`` -> (text, "") or (None, why it was not
    read): a symbolic link anywhere on the way, a path out of the folder, no such file, not a regular
    file, more than MAX_SOURCE_BYTES, not UTF-8."""
    path = submission
    for part in rel.split("/"):
        path = path / part
        if path.is_symlink():
            return None, f"REFUSED ({path.relative_to(submission).as_posix()} is a symbolic link)"
    if not path.exists():
        return None, f"MISSING (no {rel})"
    if not path.resolve().is_relative_to(submission.resolve()):
        return None, f"REFUSED ({rel} lies outside the submission)"
    try:  # no link followed, no wait on a FIFO
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        return None, f"REFUSED ({rel} cannot be read: {exc.strerror})"
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            return None, f"REFUSED ({rel} is not a regular file)"
        data = f.read(MAX_SOURCE_BYTES + 1) if info.st_size <= MAX_SOURCE_BYTES else b""
    if info.st_size > MAX_SOURCE_BYTES or len(data) > MAX_SOURCE_BYTES:
        return None, f"REFUSED ({rel} is larger than {MAX_SOURCE_BYTES} bytes)"
    try:
        return data.decode("utf-8"), ""
    except UnicodeDecodeError:
        return None, f"REFUSED ({rel} is not UTF-8 text)"


def submitted_bodies(submission: Path, rel: str, reference: str, exercises: list[Exercise]) -> dict[str, tuple]:
    """{exercise: (its region's body in the submission's file ``rel``, "") or (None, why none is taken)}
    for the ``exercises`` of that file (``reference``: the file's reference text)."""
    text, problem = read_submitted(submission, rel)
    if text is None:
        return {ex.id: (None, problem) for ex in exercises}
    try:
        found = scan_markers(text, rel)
    except CourseError as exc:
        return {ex.id: (None, f"REFUSED ({exc})") for ex in exercises}
    lines = text.splitlines(keepends=True)
    taken = {}
    for ex in exercises:
        regions = [(begin, end) for ex_id, begin, end, _ in found if ex_id == ex.id]
        if len(regions) != 1:
            many = f"EXERCISE {ex.id} is marked {len(regions)} times in {rel}"
            taken[ex.id] = (None, f"REFUSED ({many})" if regions else f"MISSING (no EXERCISE {ex.id} region in {rel})")
            continue
        body = [line if line.endswith("\n") else line + "\n" for line in lines[regions[0][0] : regions[0][1] - 1]]
        why = refused_in_body(reference, ex, body)
        taken[ex.id] = (None, f"REFUSED ({why})") if why else (body, "")
    return taken


# The first plugin of a grading run (pytest -p ISOLATION_PLUGIN), written into the grading copy: before
# the tests import minillm it drops every import hook that would find minillm elsewhere (an editable
# install's finder supplies, from the reference checkout, any module the copy lacks); at the end, a run
# that imported any minillm module from outside the copy, was cut short, or did not finish every test
# it selected exits before its JUnit report is written, so it reports nothing and its grade is a FAIL.
ISOLATION_PLUGIN = "_minillm_grading_isolation"
ISOLATION_SOURCE = '''\
"""Written by minillm.tools.course for one grading run: minillm comes from this folder or not at all."""
import os
import sys
from importlib.machinery import BuiltinImporter, FrozenImporter, PathFinder

import pytest

COPY = os.path.dirname(os.path.realpath(__file__))
FINISHED = set()


def inside(path):
    return path is not None and os.path.realpath(str(path)).startswith(COPY + os.sep)


def finds_minillm_elsewhere(finder):
    try:
        spec = finder.find_spec("minillm", None)
    except Exception:
        return False
    return spec is not None and not inside(spec.origin)


sys.meta_path[:] = [f for f in sys.meta_path
                    if f in (BuiltinImporter, FrozenImporter, PathFinder) or not finds_minillm_elsewhere(f)]


def pytest_runtest_logfinish(nodeid, location):
    FINISHED.add(nodeid)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    modules = [(name, getattr(m, "__file__", None) or next(iter(getattr(m, "__path__", None) or ()), None))
               for name, m in list(sys.modules.items()) if name == "minillm" or name.startswith("minillm.")]
    foreign = [f"{name} from {where}" for name, where in modules if where is not None and not inside(where)]
    unfinished = [item.nodeid for item in session.items if item.nodeid not in FINISHED]
    if foreign or unfinished or exitstatus not in (0, 1, 5):
        why = foreign[:1] or [f"{len(unfinished)} tests did not finish (exit status {int(exitstatus)})"]
        sys.stderr.write(f"grading run refused: {why[0]}\\n")
        sys.stderr.flush()
        os._exit(3)
'''


def grading_copy(root: Path, submission: Path, scratch: Path, handed_out: list[Exercise]) -> tuple[Path, dict]:
    """A fresh copy of the reference project ``root`` in ``scratch`` whose ``handed_out`` exercises' regions
    hold the submission's bodies (its stub where none is taken): nothing else of the submission is read.
    -> (the copy, {exercise: "" or why its body was not taken}), with the isolation plugin written in."""
    project = copy_project(root, Path(scratch) / "project")
    by_file: dict[str, list[Exercise]] = {}
    for ex in handed_out:
        by_file.setdefault(ex.file, []).append(ex)
    handed, problems = {ex.id for ex in handed_out}, {}
    for rel, members in by_file.items():
        reference = (Path(root) / rel).read_text()
        taken = submitted_bodies(Path(submission), rel, reference, members)
        stubs = {ex.id: stub_body(reference, ex, [d for d in ex.depends if d in handed]) for ex in members}
        bodies = [(ex.begin, ex.end, taken[ex.id][0] or stubs[ex.id]) for ex in members]
        (project / rel).write_text(with_bodies(reference, bodies))
        problems.update({ex_id: problem for ex_id, (_, problem) in taken.items()})
    (project / f"{ISOLATION_PLUGIN}.py").write_text(ISOLATION_SOURCE)
    return project, problems


def unsolved_exercises(project: Path, exercises: list[Exercise]) -> set[str]:
    """The ``exercises`` whose region in the grading copy ``project`` is still the stub."""
    unsolved = set()
    for rel in {ex.file for ex in exercises}:
        text = (Path(project) / rel).read_text()
        regions = {region.id: region for region in parse_markers(text, rel)}  # where they lie in the copy
        unsolved |= {ex.id for ex in exercises if ex.file == rel and is_stub(text, regions[ex.id])}
    return unsolved


# ------------------------------------------------------------------------------------------------
# grading: running the tests


@dataclass
class Grade:
    exercise: str
    command: str
    depends: list[str]  # exercises its grading tests also run
    passed: int  # grading tests that passed
    failed: int  # grading tests that failed for a reason of their own (the exercise's code, its own stub)
    blocked: dict[str, list[str]]  # test -> the other exercises whose stubs it died on
    seconds: float
    problem: str = ""  # why nothing was run or counted: "REFUSED (imports pytest: ...)", "MISSING (...)"

    @property
    def total(self) -> int:
        """The tests the student could have made pass: blocked ones are not counted."""
        return self.passed + self.failed

    @property
    def blockers(self) -> list[str]:
        return sorted({b for ids in self.blocked.values() for b in ids}, key=exercise_sort_key)

    @property
    def ok(self) -> bool:
        return not self.problem and self.total > 0 and self.failed == 0 and not self.blocked

    @property
    def result(self) -> str:
        if self.problem:
            return self.problem
        if self.ok:
            return "pass"
        if self.failed or not self.blocked:
            return "FAIL"
        return f"BLOCKED (by {', '.join(self.blockers)})"


def raised_exercises(text: str) -> list[str]:
    """The exercises whose stub's NotImplementedError a failure report shows ("NotImplementedError:
    Exercise 3.1: <task>", as ``minillm.notebook.stub_message`` writes it), in order of appearance."""
    found = []
    for part in text.split("NotImplementedError: ")[1:]:
        m = UNSOLVED.match(part.splitlines()[0] if part else "")
        if m and m["id"] not in found:
            found.append(m["id"])
    return found


def may_block(ex: Exercise, handed_out: set[str], unsolved: set[str]) -> list[str]:
    """The exercises that can block ``ex``: its declared dependencies (EXERCISE_DEPENDS) that the
    instructor handed out and that the submission left unsolved (their regions still the stub)."""
    return [d for d in ex.depends if d in handed_out and d in unsolved]


def classify(exercise: str, failure: str, blockers: list[str]) -> list[str]:
    """[] when a failing grading test of ``exercise`` is the student's to fix, else the exercises whose
    stubs it died on: only when every stub its report names is one of ``blockers`` (``may_block``).
    Its own stub, no stub, or a stub of any other exercise: the student's to fix."""
    raised = raised_exercises(failure)
    return raised if raised and exercise not in raised and set(raised) <= set(blockers) else []


def run_tests(project: Path, args: list[str], timeout: float) -> tuple[list[tuple[str, str, str]], float, str]:
    """pytest ``args`` in the grading copy ``project``, importing its minillm and nothing of another
    (ISOLATION_PLUGIN; no user site-packages, no working folder on the path) -> ([(test, "passed" |
    "failed" | "skipped", failure report)], seconds, output tail). Errors count as failures; a run cut
    short or past ``timeout`` reports no test."""
    env = {"MPLBACKEND": "Agg", "PYTHONNOUSERSITE": "1", "PYTHONSAFEPATH": "1"}
    cases, seconds, output = run_pytest(project, ["-p", ISOLATION_PLUGIN, *args], timeout, env=env)
    return [(c.nodeid, c.outcome, c.report) for c in cases], seconds, output[-4000:]


def grade_exercise(project: Path, ex: Exercise, blockers: list[str]) -> Grade:
    """Run exercise ``ex``'s grading command in the grading copy ``project`` -> its grade (skipped tests
    not counted; a test dying on a stub counts as blocked only for the ``blockers``)."""
    results, seconds, output = run_tests(project, ex.checks.args, GRADE_TIMEOUT_S)
    passed = sum(outcome == "passed" for _, outcome, _ in results)
    failing = [(test, classify(ex.id, report, blockers)) for test, outcome, report in results if outcome == "failed"]
    blocked = {test: by for test, by in failing if by}
    last = (output.strip().splitlines() or ["(no output)"])[-1][:120]
    problem = "" if results else f"FAIL (no test reported: {last})"
    return Grade(ex.id, ex.command, ex.depends, passed, len(failing) - len(blocked), blocked, seconds, problem)


def manifest_ids(path: Path) -> list[str]:
    """The exercise ids of a MANIFEST.json (the one the instructor's student_edition wrote); CourseError
    for anything else."""
    path = Path(path)
    not_one = f"{path} is not a manifest written by `course student-edition`"
    try:
        if path.stat().st_size > MAX_SOURCE_BYTES:
            raise CourseError(f"{not_one} (larger than {MAX_SOURCE_BYTES} bytes)")
        rows = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise CourseError(f"{not_one} ({exc})") from exc
    if not isinstance(rows, list) or not all(isinstance(row, dict) and "id" in row for row in rows):
        raise CourseError(f"{not_one} (it must be a list of exercises, each with an id)")
    bad = [row["id"] for row in rows if not isinstance(row["id"], str) or not EXERCISE_ID.match(row["id"])]
    if bad:
        raise CourseError(f"{path}: exercise id {bad[0]!r} is not a string such as \"3.1\"")
    return [row["id"] for row in rows]


def grade(submission: Path, root: Path | None = None, chapters=None, exercises=None,
          manifest_path: Path | None = None) -> list[Grade]:
    """Grade ``submission`` with the reference project ``root``'s tests (default: the checkout this
    kit runs from). Handed out: the exercises of the instructor's ``manifest_path`` (the MANIFEST.json
    that student_edition wrote), else every exercise of ``root``; graded: those of them in ``chapters``
    and ``exercises`` (none named: all). Only the bodies of the handed-out regions are read from the
    submission (``grading_copy``)."""
    from .project import project_root

    root, submission = project_root(root), Path(submission).resolve()
    if not (submission / "minillm").is_dir():
        raise CourseError(f"{submission} has no minillm/ folder: point grade at a student's copy of the project")
    known = find_exercises(root)
    if manifest_path is None:
        handed_out, among = known, ""
    else:
        handed_out = select(known, ids=manifest_ids(manifest_path), among=f" in {root}")
        among = f" in the manifest {manifest_path}"
    chosen = select(handed_out, chapters=chapters, ids=exercises, among=among)
    handed = {ex.id for ex in handed_out}
    with tempfile.TemporaryDirectory(prefix="minillm-grade-") as scratch:
        project, problems = grading_copy(root, submission, Path(scratch), handed_out)
        unsolved = unsolved_exercises(project, handed_out)
        return [Grade(ex.id, ex.command, ex.depends, 0, 0, {}, 0.0, problems[ex.id]) if problems[ex.id]
                else grade_exercise(project, ex, may_block(ex, handed, unsolved)) for ex in chosen]


def format_grades(grades: list[Grade]) -> str:
    """The score table: one row per exercise, then the totals. Blocked tests are not counted."""
    from ..notebook import format_table

    rows = [{"exercise": g.exercise, "tests passed": f"{g.passed}/{g.total}", "blocked": len(g.blocked),
             "result": g.result, "time s": round(g.seconds, 1), "also needs": ",".join(g.depends) or "-",
             "grade with": g.command} for g in grades]
    solved = sum(g.ok for g in grades)
    blocked = sum(g.result.startswith("BLOCKED") for g in grades)
    refused = sum(g.result.startswith(("REFUSED", "MISSING")) for g in grades)
    return (format_table(rows, columns=list(rows[0])) if rows else "(no exercises)") + (
        f"\n\n{solved}/{len(grades)} exercises pass, {blocked} blocked by unsolved exercises they run"
        + (f", {refused} refused or missing" if refused else ""))


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
