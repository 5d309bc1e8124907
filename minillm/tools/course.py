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
(markers, signature and docstring kept) and writes the manifest. ``grade(submission)`` copies the
submission's ``minillm/`` into a scratch copy of the reference project (its tests, its fixtures, its
exercises: never the submission's), runs each exercise's grading command there and says pass, FAIL,
or BLOCKED where a test dies on another exercise's stub. docs/instructors.md explains the rules;
tests/test_course.py enforces them.
"""

from __future__ import annotations

import ast
import fnmatch
import json
import os
import re
import shutil
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


def select(exercises: list[Exercise], chapters=None, ids=None) -> list[Exercise]:
    """The exercises of ``chapters`` ("3", "A1") and those named in ``ids`` ("3.1"); both None: all.
    CourseError naming an unknown chapter or exercise."""
    if chapters is None and ids is None:
        return exercises
    known = sorted({ex.chapter for ex in exercises}, key=lambda c: exercise_sort_key(c + ".0"))
    unknown = [c for c in chapters or () if c not in known]
    if unknown:
        raise CourseError(f"no exercises in chapter(s) {', '.join(unknown)}; chapters: {', '.join(known)}")
    unknown = [i for i in ids or () if i not in {ex.id for ex in exercises}]
    if unknown:
        raise CourseError(f"no exercise {', '.join(unknown)}; exercises: {', '.join(ex.id for ex in exercises)}")
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


def stub_source(text: str, exercises: list[Exercise], stubbed=None) -> str:
    """Replace the lines between each BEGIN and END marker by one ``raise NotImplementedError``, after
    a comment naming the exercises its grading tests also need (``depends``; of those, only the ones
    in ``stubbed`` when given: the others keep their reference code)."""
    lines = text.splitlines(keepends=True)
    for ex in sorted(exercises, key=lambda e: e.begin, reverse=True):
        indent = MARKER.match(lines[ex.begin - 1])["indent"]
        message = stub_message(ex.id, ex.task)
        needs = [d for d in ex.depends if stubbed is None or d in stubbed]
        note = [f"{indent}# {depends_note(needs)}\n"] if needs else []
        lines[ex.begin : ex.end - 1] = note + [f"{indent}raise NotImplementedError({json.dumps(message)})\n"]
    return "".join(lines)


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
# grading


GRADE_TIMEOUT_S = 900  # per exercise


@dataclass
class Grade:
    exercise: str
    command: str
    depends: list[str]  # exercises its grading tests also run
    passed: int  # grading tests that passed
    failed: int  # grading tests that failed for a reason of their own (the exercise's code, its own stub)
    blocked: dict[str, list[str]]  # test -> the other exercises whose stubs it died on
    seconds: float

    @property
    def total(self) -> int:
        """The tests the student could have made pass: blocked ones are not counted."""
        return self.passed + self.failed

    @property
    def blockers(self) -> list[str]:
        return sorted({b for ids in self.blocked.values() for b in ids}, key=exercise_sort_key)

    @property
    def ok(self) -> bool:
        return self.total > 0 and self.failed == 0 and not self.blocked

    @property
    def result(self) -> str:
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


def classify(exercise: str, failure: str) -> list[str]:
    """[] when a failing grading test of ``exercise`` is the student's to fix (its code, its own stub,
    or no stub at all), else the other exercises whose stubs it died on (it is blocked by them)."""
    raised = raised_exercises(failure)
    return [] if not raised or exercise in raised else raised


def run_tests(project: Path, args: list[str], timeout: float) -> tuple[list[tuple[str, str, str]], float, str]:
    """pytest ``args`` in ``project``, importing its minillm -> ([(test, "passed" | "failed" | "skipped",
    failure report)], seconds, output tail). Errors count as failures; past ``timeout`` what finished."""
    cases, seconds, output = run_pytest(project, args, timeout, env={"MPLBACKEND": "Agg"})
    return [(c.nodeid, c.outcome, c.report) for c in cases], seconds, output[-4000:]


def grade_exercise(project: Path, ex: Exercise) -> Grade:
    """Run exercise ``ex``'s grading command in ``project`` -> its grade (skipped tests not counted)."""
    results, seconds, _ = run_tests(project, ex.checks.args, GRADE_TIMEOUT_S)
    passed = sum(outcome == "passed" for _, outcome, _ in results)
    failing = [(test, classify(ex.id, report)) for test, outcome, report in results if outcome == "failed"]
    blocked = {test: by for test, by in failing if by}
    return Grade(ex.id, ex.command, ex.depends, passed, len(failing) - len(blocked), blocked, seconds)


def manifest_ids(path: Path) -> list[str]:
    """The exercise ids of a MANIFEST.json (the one the instructor's student_edition wrote)."""
    try:
        rows = json.loads(Path(path).read_text())
        return [row["id"] for row in rows]
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise CourseError(f"{path} is not a manifest written by `course student-edition` ({exc})") from exc


def grading_copy(root: Path, submission: Path, scratch: Path) -> Path:
    """A copy of the reference project ``root`` (its tests, fixtures and declarations) whose library
    is the submission's ``minillm/``: nothing else of the submission is read."""
    project = copy_project(root, Path(scratch) / "project")
    shutil.rmtree(project / "minillm")
    for rel in walk_files(submission, ["minillm"]):  # the student's files, committed or not; no links
        if not any(fnmatch.fnmatch(part, pattern) for part in rel.split("/") for pattern in IGNORED):
            (project / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(Path(submission) / rel, project / rel)
    return project


def grade(submission: Path, root: Path | None = None, chapters=None, exercises=None,
          manifest_path: Path | None = None) -> list[Grade]:
    """Grade ``submission`` with the reference project ``root``'s tests (default: the checkout this
    kit runs from): the exercises of the instructor's ``manifest_path`` (the MANIFEST.json that
    student_edition wrote), else of ``chapters`` and ``exercises``, else every exercise of ``root``.
    The submission's own tests and manifest are never read."""
    from .project import project_root

    root, submission = project_root(root), Path(submission).resolve()
    if not (submission / "minillm").is_dir():
        raise CourseError(f"{submission} has no minillm/ folder: point grade at a student's copy of the project")
    ids = manifest_ids(manifest_path) if manifest_path is not None else exercises
    chosen = select(find_exercises(root), chapters=chapters, ids=ids)
    if submission == root:
        return [grade_exercise(root, ex) for ex in chosen]
    with tempfile.TemporaryDirectory(prefix="minillm-grade-") as scratch:
        project = grading_copy(root, submission, Path(scratch))
        return [grade_exercise(project, ex) for ex in chosen]


def format_grades(grades: list[Grade]) -> str:
    """The score table: one row per exercise, then the totals. Blocked tests are not counted."""
    from ..notebook import format_table

    rows = [{"exercise": g.exercise, "tests passed": f"{g.passed}/{g.total}", "blocked": len(g.blocked),
             "result": g.result, "time s": round(g.seconds, 1), "also needs": ",".join(g.depends) or "-",
             "grade with": g.command} for g in grades]
    solved = sum(g.ok for g in grades)
    blocked = sum(g.result.startswith("BLOCKED") for g in grades)
    return (format_table(rows, columns=list(rows[0])) if rows else "(no exercises)") + (
        f"\n\n{solved}/{len(grades)} exercises pass, {blocked} blocked by unsolved exercises they run")


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
