"""The course kit (minillm.tools.course): well-formed markers, the student edition and the rules it keeps.

The rule (docs/instructors.md): in the student edition every exercise raises NotImplementedError, and
the tests that fail are exactly the ones the manifest names (each exercise's tests marked
``exercise(id)`` or ``uses_exercise(id)``, and its chapter's notebook); each exercise, stubbed
alone, fails its own grading command with its own NotImplementedError. The reference passes
everything (the rest of this suite). Grading takes only the bodies of a submission's exercise
regions (refusing those that reach for the test machinery, the process or files), writes them into a
fresh copy of the reference that imports no other minillm, and says BLOCKED only where a test dies on
the stub of a handed-out dependency the submission left unsolved; each known way to fool it is planted
below.

The second half of the rule is read off the same run as the first, not from one run per exercise
(a minute and a half more here): a test whose only NotImplementedError is exercise e's met e's stub
before any other stub (the first one raised ends the test), so with e alone stubbed it takes the
same path and fails the same way.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from project_copy import patched, run_pytest

from minillm.tools import course, project

ROOT = Path(__file__).resolve().parents[1]
# The kit's own logic: its pytest runs check the manifest against the NumPy run's outcomes; no array here.
pytestmark = pytest.mark.host_only


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "minillm", *args], capture_output=True, text=True, timeout=300)


# ---- markers and declarations ---------------------------------------------------------------------


def test_reference_markers_are_well_formed():
    """Unique ids, balanced BEGIN/END, every exercise claimed by one test file, 2-4 per chapter
    (find_exercises raises otherwise), and every grading selection names a test file that exists."""
    exercises = course.find_exercises(ROOT)
    assert {"1", "2", "3", "4", "5", "6", "A1"} <= {ex.chapter for ex in exercises}
    for ex in exercises:
        assert (ROOT / ex.tests).is_file() and ex.graded_by and ex.function and ex.task, ex
        assert ex.also_fails and ex.also_fails[-1].tests.startswith(course.NOTEBOOK_TEST + "::")  # its notebook
        assert ex.command == f"python -m pytest {ex.tests} --exercise {ex.id}"


def test_grading_marks_read_from_the_source_are_what_pytest_runs():
    """The kit reads the marks without importing the tests; pytest's --exercise (tests/conftest.py)
    runs exactly the marked tests: here exercise 3.1, whose mark sits on one parameter of one test."""
    ex = next(e for e in course.find_exercises(ROOT) if e.id == "3.1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                        *ex.checks.args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    collected = [line.split("::")[1] for line in r.stdout.splitlines() if line.startswith(ex.tests + "::")]
    assert {name.split("[")[0] for name in collected} == set(ex.graded_by), r.stdout[-2000:]
    assert not [n for n in collected if "Growing" in n] and any("-KVCache]" in n for n in collected)


@pytest.mark.parametrize(
    "source,message",
    [
        ("    # EXERCISE 1.1 BEGIN: do it\n    x = 1\n", "has no END"),
        ("    # EXERCISE 1.1 BEGIN: do it\n    x = 1\n    # EXERCISE 1.2 END\n", "does not close"),
        ("    # EXERCISE 1.1 BEGIN: a\n    # EXERCISE 1.2 BEGIN: b\n", "inside EXERCISE 1.1"),
        ("    # EXERCISE 1.1 BEGIN:\n    x = 1\n    # EXERCISE 1.1 END\n", "needs ': <what to implement>'"),
        ("    # EXERCISE 1.1 BEGIN: a\n    # EXERCISE 1.1 END\n", "empty region"),
        ("    # EXERCISE one BEGIN: a\n", "not of the form"),
    ],
)
def test_malformed_markers_are_refused(tmp_path, source, message):
    with pytest.raises(course.CourseError, match=message):
        course.parse_markers("def f():\n" + source, "m.py")


def test_duplicate_ids_and_unclaimed_exercises_are_refused(tmp_path):
    (tmp_path / "minillm").mkdir()
    (tmp_path / "tests").mkdir()
    region = "def {0}():\n    # EXERCISE 1.1 BEGIN: a\n    return 1\n    # EXERCISE 1.1 END\n"
    (tmp_path / "minillm" / "a.py").write_text(region.format("f"))
    with pytest.raises(course.CourseError, match="graded by no test"):
        course.find_exercises(tmp_path)
    (tmp_path / "minillm" / "b.py").write_text(region.format("g"))
    with pytest.raises(course.CourseError, match="marked twice"):
        course.find_exercises(tmp_path)


def test_stub_keeps_signature_docstring_markers_and_the_rest_of_the_body():
    source = (
        "def f(x):\n"
        '    """Doc."""\n'
        "    y = x + 1\n"
        "    # EXERCISE 9.1 BEGIN: double y\n"
        "    y = 2 * y\n"
        "    # EXERCISE 9.1 END\n"
        "    return y\n"
    )
    [ex] = course.parse_markers(source, "m.py")
    assert (ex.id, ex.chapter, ex.function, ex.task) == ("9.1", "9", "f", "double y")
    stubbed = course.stub_source(source, [ex])
    assert stubbed.splitlines() == [
        "def f(x):", '    """Doc."""', "    y = x + 1", "    # EXERCISE 9.1 BEGIN: double y",
        '    raise NotImplementedError("Exercise 9.1: double y")', "    # EXERCISE 9.1 END", "    return y",
    ]
    namespace = {}
    exec(stubbed, namespace)
    with pytest.raises(NotImplementedError, match="Exercise 9.1: double y"):
        namespace["f"](1)


def test_every_notebook_lists_its_exercises_with_the_manifest_commands():
    """Each chapter notebook's last cell has an '## Exercises' section naming every exercise of the
    chapter, its file, its function and exactly the manifest's pytest command."""
    nbformat = pytest.importorskip("nbformat")
    chapters = {}
    for ex in course.find_exercises(ROOT):
        chapters.setdefault(ex.chapter, []).append(ex)
    for chapter, exercises in chapters.items():
        notebook = course.chapter_notebook(ROOT, chapter)
        assert notebook is not None, f"chapter {chapter} has no notebook"
        last = nbformat.read(notebook, as_version=4).cells[-1]
        assert last.cell_type == "markdown" and "## Exercises" in last.source, notebook.name
        section = last.source.split("## Exercises", 1)[1]
        for ex in exercises:
            for text in (ex.id, ex.file, ex.function.split(".")[-1], ex.command):
                assert text in section, f"{notebook.name}: exercise {ex.id} does not name {text!r}"


def test_marks_and_the_depends_table_are_read_checked_and_written_to_the_stub_and_the_manifest(tmp_path):
    """Marks on tests (on a decorator or a parameter) say what grades and what uses an exercise;
    EXERCISE_DEPENDS in tests/conftest.py says what its grading tests also run: the manifest lists
    them, the stub names them in a comment. Unknown ids, a mark whose ids are not literals, an
    exercise graded in two files, a file grading two chapters, a self-dependency, and a grading test
    that runs an exercise the table does not name for it are refused."""
    (tmp_path / "minillm").mkdir()
    (tmp_path / "tests").mkdir()
    region = "def {0}():\n    # EXERCISE {1} BEGIN: a\n    return 1\n    # EXERCISE {1} END\n"
    ids = ("1.1", "1.2", "2.1", "2.2")
    (tmp_path / "minillm" / "a.py").write_text("".join(region.format(f"f{n}", i) for n, i in enumerate(ids)))
    one = ('import pytest\n\n@pytest.mark.exercise("1.1", "1.2")\ndef test_a(): pass\n\n'
           '@pytest.mark.parametrize("x", [1, pytest.param(2, marks=pytest.mark.exercise("1.2"))])\n'
           'def test_b(x): pass\n')
    two = ('import pytest\n\n@pytest.mark.exercise("2.1")\n@pytest.mark.uses_exercise("1.1")\n'
           'def test_c(): pass\n\n@pytest.mark.exercise("2.2")\ndef test_d(): pass\n')
    (tmp_path / "tests" / "test_one.py").write_text(one)
    (tmp_path / "tests" / "test_two.py").write_text(two)
    conftest = tmp_path / "tests" / "conftest.py"
    conftest.write_text('EXERCISE_DEPENDS = {"2.1": "1.1, 1.2", "1.1": "1.2", "1.2": "1.1"}\n')
    ex = {e.id: e for e in course.find_exercises(tmp_path)}
    assert ex["1.2"].graded_by == ["test_a", "test_b"] and ex["2.1"].tests == "tests/test_two.py"
    assert ex["2.1"].depends == ["1.1", "1.2"] and ex["1.2"].depends == ["1.1"] and ex["2.2"].depends == []
    assert [s.command for s in ex["1.1"].also_fails] == ["python -m pytest tests/test_two.py --uses-exercise 1.1"]
    stub = course.stub_source((tmp_path / "minillm" / "a.py").read_text(), [ex["2.1"]])
    assert "    # its grading tests also run exercise(s) 1.1, 1.2: solve those too\n" in stub
    assert "# its grading" not in course.stub_source((tmp_path / "minillm" / "a.py").read_text(), [ex["2.1"]],
                                                     stubbed={"2.1"})  # the others keep their reference code
    assert course.manifest([ex["2.1"]])[0]["depends"] == ["1.1", "1.2"]
    row = "| a | 1.1, 1.2 | `python -m pytest tests/test_two.py --exercise 2.1` |"
    assert row in course.manifest_markdown([ex["2.1"]])
    for name, text, message in [
        ("conftest.py", 'EXERCISE_DEPENDS = {"2.1": "1.9"}\n', "no source file marks"),
        ("conftest.py", 'EXERCISE_DEPENDS = {"2.1": "2.1"}\n', "the exercise itself"),
        ("conftest.py", 'EXERCISE_DEPENDS = {"1.1": "1.2", "1.2": "1.1"}\n', "test_c grades 2.1 and runs 1.1"),
        ("test_two.py", two.replace('exercise("2.2")', 'exercise("9.9")'), "no source file marks"),
        ("test_two.py", two.replace('exercise("2.2")', "exercise(ID)"), "string literals"),
        ("test_two.py", two.replace('exercise("2.2")', 'exercise("1.1")'), "graded by tests in two files"),
        ("test_one.py", one.replace('exercise("1.2"))', 'exercise("2.2"))'), "one chapter a file"),
    ]:
        original = (tmp_path / "tests" / name).read_text()
        (tmp_path / "tests" / name).write_text(text)
        with pytest.raises(course.CourseError, match=message):
            course.find_exercises(tmp_path)
        (tmp_path / "tests" / name).write_text(original)


@pytest.fixture(scope="module")
def reference_copy(tmp_path_factory):
    return course.copy_project(ROOT, tmp_path_factory.mktemp("solved") / "project", leave_out=course.INSTRUCTORS_ONLY)


# Each run is a pytest process over one exercise's grading tests (from 5 s to over a minute, chapter
# 5's chi-square tests being the slowest): by default only 3.3, whose dependencies (3.1 of its own
# chapter, 1.1 and 1.2 of chapter 1) are the first a student meets; MINILLM_KIT_ALL=1 checks every
# exercise (35 runs, about 3 minutes with -n 2 on 2 cores). EXERCISE_DEPENDS was found this way.
EXERCISES_BY_ID = {ex.id: ex for ex in course.find_exercises(ROOT)}
SOLVED_ALONE = list(EXERCISES_BY_ID) if os.environ.get("MINILLM_KIT_ALL") == "1" else ["3.3"]


@pytest.mark.parametrize("ex_id", SOLVED_ALONE)
def test_exercise_passes_with_only_its_declared_dependencies_solved(reference_copy, ex_id):
    """Every other exercise stubbed, those of its own chapter too: the exercise's grading command
    passes, so EXERCISE_DEPENDS (the manifest's ``depends``, the stub's comment) names everything a
    student must solve first."""
    ex = EXERCISES_BY_ID[ex_id]
    others = [e for e in EXERCISES_BY_ID.values() if e.id != ex.id and e.id not in ex.depends]
    with patched(reference_copy, course.stubbed_sources(ROOT, others)):
        r = run_pytest(reference_copy, "--tb=line", *ex.checks.args)
    solved = f"only {ex.id} and {ex.depends} solved"
    assert r.returncode == 0, f"{ex.command} fails with {solved}:\n" + r.stdout[-2000:]


# ---- the student edition -------------------------------------------------------------------------


def test_cli_refuses_a_non_empty_folder(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    r = run_cli("course", "student-edition", str(tmp_path))
    assert r.returncode == 1
    assert "not an empty folder" in r.stderr and "Traceback" not in r.stderr
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_cli_refuses_a_folder_inside_the_project():
    """An edition inside the project would copy itself without end: refused before anything is written."""
    out = ROOT / "docs" / "student-edition-test"
    r = run_cli("course", "student-edition", str(out))
    assert r.returncode == 1
    assert "is inside the project" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


def test_chapters_selects_what_is_stubbed(tmp_path):
    exercises = course.student_edition(ROOT, tmp_path / "ed", chapters=["1", "A1"])
    assert sorted({ex.chapter for ex in exercises}) == ["1", "A1"]
    for ex in course.find_exercises(ROOT):
        stubbed = f'raise NotImplementedError("Exercise {ex.id}: ' in (tmp_path / "ed" / ex.file).read_text()
        assert stubbed == (ex.chapter in ("1", "A1")), ex.id
    rows = json.loads((tmp_path / "ed" / course.MANIFEST_JSON).read_text())
    assert [r["id"] for r in rows] == [ex.id for ex in exercises]
    with pytest.raises(course.CourseError, match="no exercises in chapter"):
        course.student_edition(ROOT, tmp_path / "ed2", chapters=["14"])


def test_exercises_hands_out_single_exercises(tmp_path):
    """--exercises 3.3,5.2: only those two regions stubbed (the rest of chapters 3 and 5 keep their
    reference code), the manifest lists exactly them, and a stub names only the dependencies that
    the edition stubs (3.3's 1.1, 1.2 and 3.1 are solved here)."""
    out = tmp_path / "ed"
    r = run_cli("course", "student-edition", str(out), "--exercises", "3.3,5.2")
    assert r.returncode == 0, r.stderr
    for ex in course.find_exercises(ROOT):
        stubbed = f'raise NotImplementedError("Exercise {ex.id}: ' in (out / ex.file).read_text()
        assert stubbed == (ex.id in ("3.3", "5.2")), ex.id
    rows = json.loads((out / course.MANIFEST_JSON).read_text())
    assert [r["id"] for r in rows] == ["3.3", "5.2"] and all(r["depends"] == [] for r in rows)
    assert "# its grading tests" not in (out / "minillm" / "generate.py").read_text()
    with pytest.raises(course.CourseError, match="no exercise 3.9"):
        course.student_edition(ROOT, tmp_path / "ed2", exercises=["3.9"])
    r = run_cli("course", "student-edition", str(tmp_path / "ed3"), "--exercises", "three")
    assert r.returncode == 2 and "name exercises as 3.1,5.2" in r.stderr


def git(folder, *args):
    subprocess.run(["git", "-C", str(folder), *args], check=True, capture_output=True,
                   env=dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
                            GIT_COMMITTER_EMAIL="t@t"))


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_copies_take_only_the_projects_files_and_follow_no_link(tmp_path):
    """From a git checkout: what git tracks, never an untracked .env, venv/ or model file beside it;
    elsewhere: the project's own folders and files (PROJECT_FILES). Never a symbolic link: a
    ``loop -> .`` would copy the project into itself without end."""
    root = tmp_path / "project"
    for rel, text in {"pyproject.toml": "", "README.md": "hi", "minillm/__init__.py": "", "minillm/a.py": "x = 1",
                      "tests/test_a.py": "def test_a(): pass", "notebooks/01_x.ipynb": "{}"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    git(root, "init", "-q")
    git(root, "add", ".")
    git(root, "commit", "-q", "-m", "project")
    (root / ".env").write_text("TOKEN=secret")
    (root / "venv" / "lib").mkdir(parents=True)
    (root / "venv" / "lib" / "site.py").write_text("")
    (root / "model.gguf").write_bytes(b"GGUF" * 1000)
    (root / "minillm" / "untracked.py").write_text("")
    (root / "loop").symlink_to(".")
    (root / "minillm" / "link").symlink_to("..")
    (root / "minillm" / "secret.py").symlink_to(root / ".env")
    tracked = {"pyproject.toml", "README.md", "minillm/__init__.py", "minillm/a.py", "tests/test_a.py",
               "notebooks/01_x.ipynb"}
    assert set(course.project_files(root)) == tracked
    course.student_edition(root, tmp_path / "edition")
    copied = {p.relative_to(tmp_path / "edition").as_posix() for p in (tmp_path / "edition").rglob("*")
              if p.is_file() or p.is_symlink()}
    assert copied == tracked | {course.MANIFEST_JSON, course.MANIFEST_MD}
    shutil.rmtree(root / ".git")  # an unpacked copy: the project's folders, less links and untracked extras
    assert set(course.project_files(root)) == tracked | {"minillm/untracked.py"}


def test_leak_check_finds_a_copied_solution_line(tmp_path):
    """The check below can fail: a file holding one line of exercise 3.2's solution is a leak."""
    ex = next(e for e in course.find_exercises(ROOT) if e.id == "3.2")
    line = sorted(course.solution_lines(ROOT, ex))[0]
    (tmp_path / "helper.py").write_text(f"def check(self, n):\n    {line}\n")
    assert course.leaked_solutions(ROOT, tmp_path, [ex]) == [("3.2", "helper.py", line)]


def test_pytest_outcomes_counts_each_test_of_a_project(tmp_path):
    """The runner behind `course grade` and gpu_check: one outcome per test, errors count as failures."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        "import pytest\n\ndef test_a(): pass\n\ndef test_b(): assert False\n\n"
        "@pytest.mark.skip\ndef test_c(): pass\n\n@pytest.fixture\ndef broken(): raise RuntimeError\n\n"
        "def test_d(broken): pass\n"
    )
    outcomes, seconds, output = project.pytest_outcomes(tmp_path, ["tests"], timeout=120)
    assert sorted(outcomes) == [("test_x.py", "failed"), ("test_x.py", "failed"), ("test_x.py", "passed"),
                                ("test_x.py", "skipped")]
    assert seconds > 0 and "1 passed" in output
    errors = output.split("\n\n")[0].splitlines()  # the first error of each failure comes first
    assert errors == ["first error of each failing test:", "tests/test_x.py::test_b: assert False",
                      "tests/test_x.py::test_d: failed on setup with \"RuntimeError\""], output


def test_project_root_is_found_or_named(tmp_path, monkeypatch):
    """The checkout is found beside the package (minillm/tools/project.py -> two folders up) from any
    working directory, or named; a folder that is not one is refused."""
    assert project.project_root() == ROOT and project.project_root(ROOT) == ROOT
    monkeypatch.chdir(tmp_path)
    assert project.project_root() == ROOT
    with pytest.raises(project.ProjectRootError, match="is not a minillm project"):
        project.project_root(tmp_path)


@pytest.fixture(scope="session")
def edition(tmp_path_factory):
    """The full student edition, built once per test run through the CLI and shared (read only) by
    the tests below, across pytest-xdist's workers too: the first one builds it, the others wait."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    # xdist's workers share the folder of their run; a run without xdist builds in a folder of its own
    temp = tmp_path_factory.getbasetemp()
    base = temp.parent / f"edition-{run}" if run else temp / "shared-edition"
    out, done = base / "edition", base / "built"
    try:
        base.mkdir(parents=True, exist_ok=False)  # atomic: this worker builds
    except FileExistsError:
        deadline = time.monotonic() + 600
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert done.read_text() == "ok", done.read_text()
        return out
    r = run_cli("course", "student-edition", str(out))
    done.write_text("ok" if r.returncode == 0 else r.stderr or "failed")
    assert r.returncode == 0, r.stderr
    return out


def test_student_edition_contents(edition):
    """Every region stubbed, the manifest, the shipped models; no .git, caches, training state or
    instructors' files (the bug zoo holds reference lines)."""
    rows = json.loads((edition / course.MANIFEST_JSON).read_text())
    assert [r["id"] for r in rows] == [ex.id for ex in course.find_exercises(ROOT)]
    for r in rows:
        text = (edition / r["file"]).read_text()
        assert f'raise NotImplementedError("Exercise {r["id"]}: ' in text
        assert r["command"] == f"python -m pytest {r['tests']} --exercise {r['id']}"
    assert (edition / "minillm" / "models" / "target.npz").is_file()
    assert (edition / "MANIFEST.md").read_text().count("| ") > len(rows)
    opening = (edition / "MANIFEST.md").read_text().split("## What to write")[0]
    assert "pip install -r requirements.txt" in opening and course.LAB_COMMAND in opening
    assert {p.relative_to(edition).as_posix() for p in edition.rglob("*") if p.is_file()} == (
        set(course.project_files(ROOT)) - set(course.INSTRUCTORS_ONLY) | {course.MANIFEST_JSON, course.MANIFEST_MD})
    present = {p.relative_to(edition).as_posix() for p in edition.rglob("*")}
    assert not [p for p in present if p.endswith(".train.npz") or "__pycache__" in p or p.startswith(".git/")]
    assert not set(course.INSTRUCTORS_ONLY) & present
    compiled = subprocess.run([sys.executable, "-m", "compileall", "-q", "minillm", "tests"], cwd=edition,
                              capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stdout


def test_student_edition_gives_no_answer_away(edition):
    """No file of the student edition (code, tests, notebooks with their outputs, docs) holds a
    non-trivial line of any exercise's reference solution."""
    leaks = course.leaked_solutions(ROOT, edition, course.find_exercises(ROOT))
    assert not leaks, "solution lines in the student edition:\n" + "\n".join(map(str, leaks))


def test_grade_prints_a_score_table(edition):
    """`course grade` passes the reference and fails the student edition, exercise by exercise."""
    r = run_cli("course", "grade", str(ROOT), "--exercises", "1.1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1/1 exercises pass" in r.stdout and "FAIL" not in r.stdout
    r = run_cli("course", "grade", str(edition), "--chapters", "1")
    assert r.returncode == 1
    lines = [line.split() for line in r.stdout.splitlines()]
    rows = {cells[0]: cells[1:4] for cells in lines if cells and cells[0] in ("1.1", "1.2")}
    passed = [tuple(map(int, c[0].split("/"))) for c in rows.values()]
    assert rows.keys() == {"1.1", "1.2"} and all(c[2] == "FAIL" for c in rows.values())
    assert all(n < total for n, total in passed), r.stdout
    assert "0/2 exercises pass" in r.stdout


# ---- grading: only the regions' bodies, checked, in a fresh copy of the reference ------------------

HANDED_OUT = ["1.1", "3.1", "3.2"]  # cheap grading runs: a few seconds each


@pytest.fixture(scope="module")
def small_edition(tmp_path_factory):
    """A student edition of three exercises and the instructor's MANIFEST.json, built once for the tests below."""
    out = tmp_path_factory.mktemp("small") / "edition"
    course.student_edition(ROOT, out, exercises=HANDED_OUT)
    return out


def make_submission(edition, folder, bodies=(), files=()):
    """A copy of the edition's minillm/ with the regions of ``bodies`` {exercise: code (unindented), or
    "reference" for the reference solution} written in, and ``files`` {relative path: text} beside them."""
    shutil.copytree(edition / "minillm", folder / "minillm")
    by_id = {ex.id: ex for ex in course.find_exercises(ROOT)}
    for ex_id, code in dict(bodies).items():
        ex = by_id[ex_id]
        path = folder / ex.file
        text = path.read_text()
        region = next(r for r in course.parse_markers(text, ex.file) if r.id == ex_id)
        if code == "reference":
            lines = (ROOT / ex.file).read_text().splitlines(keepends=True)[ex.begin : ex.end - 1]
        else:
            indent = text.splitlines()[region.begin - 1].split("#")[0]
            lines = [indent + line + "\n" for line in code.splitlines()]
        path.write_text(course.with_bodies(text, [(region.begin, region.end, lines)]))
    for rel, text in dict(files).items():
        (folder / rel).write_text(text)
    return folder


def results(grades):
    return {g.exercise: g.result for g in grades}


CHEAT_RUNTEST = ("import sys\nif 'pytest' in sys.modules:\n    import _pytest.python\n"
                 "    _pytest.python.Function.runtest = lambda self: None\n")
CHEAT_JUNIT = ("import atexit, re, sys\n"
               "def _clean():\n"
               "    for arg in sys.argv:\n"
               "        if arg.startswith('--junitxml='):\n"
               "            path = arg.split('=', 1)[1]\n"
               "            text = open(path).read()\n"
               "            open(path, 'w').write(re.sub(r'<failure.*?</failure>', '', text, flags=re.S))\n"
               "atexit.register(_clean)\n")


def test_grading_runs_nothing_of_the_submission_but_its_region_bodies(small_edition, tmp_path):
    """Planted in minillm/__init__.py, a pytest patch that skips every test's body and an atexit hook
    that deletes the failures from the JUnit report change nothing: that file is not taken. Planted in
    a region, they are refused and earn nothing (no test is run for them)."""
    init = (small_edition / "minillm" / "__init__.py").read_text()
    sub = make_submission(small_edition, tmp_path / "sub", bodies={
        "3.1": "import _pytest.python\n_pytest.python.Function.runtest = lambda self: None\nreturn None",
        "3.2": "import atexit\natexit.register(print)\nself.length = n",
    }, files={"minillm/__init__.py": CHEAT_RUNTEST + CHEAT_JUNIT + init})
    grades = {g.exercise: g for g in course.grade(sub, manifest_path=small_edition / course.MANIFEST_JSON,
                                                    exercises=["1.1", "3.1", "3.2"])}
    assert grades["1.1"].result == "FAIL" and grades["1.1"].failed > 0, grades["1.1"]  # the stub, run and failing
    assert grades["3.1"].result == "REFUSED (imports _pytest: the test machinery)"
    assert grades["3.2"].result == "REFUSED (imports atexit: the interpreter or the process)"
    assert not any(g.ok for g in grades.values()) and grades["3.1"].seconds == 0
    assert "2 refused or missing" in course.format_grades(list(grades.values()))


CHEAT_TESTING = ("import functools\nimport numpy as np\n"
                 "fake = type('T', (), {'assert_allclose': staticmethod(lambda *a, **k: None),\n"
                 "                      'assert_array_equal': staticmethod(lambda *a, **k: None)})\n"
                 "functools.update_wrapper(np, type('F', (), {'testing': fake}), assigned=(), updated=('__dict__',))\n"
                 "return attention(q, k, v, causal=True)")


def test_a_region_that_replaces_numpys_assertions_earns_nothing(small_edition, tmp_path):
    """A wrong 3.1 (attending over the new keys only) whose body swaps np.testing for assertions that
    pass everything, by functools.update_wrapper and a class made with type(): refused, not 8/8."""
    sub = make_submission(small_edition, tmp_path / "sub", bodies={"3.1": CHEAT_TESTING})
    [g] = course.grade(sub, manifest_path=small_edition / course.MANIFEST_JSON, exercises=["3.1"])
    assert g.result.startswith("REFUSED (") and g.passed == 0, g


def test_a_missing_file_an_empty_library_or_a_link_to_the_reference_earns_nothing(small_edition, tmp_path):
    """Grading reads a region from the submission's own file or not at all: minillm/kv_cache.py deleted,
    an empty minillm/, kv_cache.py or minillm/ itself a link to the reference: MISSING or REFUSED."""
    manifest = small_edition / course.MANIFEST_JSON
    graded = ["3.1", "3.2"]
    deleted = make_submission(small_edition, tmp_path / "deleted")
    (deleted / "minillm" / "kv_cache.py").unlink()
    assert set(results(course.grade(deleted, manifest_path=manifest, exercises=graded)).values()) == {
        "MISSING (no minillm/kv_cache.py)"}
    empty = tmp_path / "empty"
    (empty / "minillm").mkdir(parents=True)
    assert {r.split()[0] for r in results(course.grade(empty, manifest_path=manifest)).values()} == {"MISSING"}
    linked = make_submission(small_edition, tmp_path / "linked")
    (linked / "minillm" / "kv_cache.py").unlink()
    (linked / "minillm" / "kv_cache.py").symlink_to(ROOT / "minillm" / "kv_cache.py")
    assert set(results(course.grade(linked, manifest_path=manifest, exercises=graded)).values()) == {
        "REFUSED (minillm/kv_cache.py is a symbolic link)"}
    folder = tmp_path / "folder-link"
    folder.mkdir()
    (folder / "minillm").symlink_to(ROOT / "minillm")
    assert set(results(course.grade(folder, manifest_path=manifest, exercises=graded)).values()) == {
        "REFUSED (minillm is a symbolic link)"}


def test_the_grading_run_imports_minillm_from_the_grading_copy_only(small_edition, tmp_path):
    """This environment has the reference installed (editable: its finder supplies any minillm module
    a folder lacks). With the grading copy's kv_cache.py deleted, the grading run fails to import it
    instead of running the reference's: no test is reported, the grade is a FAIL."""
    exercises = {ex.id: ex for ex in course.find_exercises(ROOT)}
    handed = [exercises[i] for i in HANDED_OUT]
    copy, problems = course.grading_copy(ROOT, make_submission(small_edition, tmp_path / "sub", bodies={
        "1.1": "reference"}), tmp_path / "scratch", handed)
    assert problems == dict.fromkeys(HANDED_OUT, "") and course.unsolved_exercises(copy, handed) == {"3.1", "3.2"}
    (copy / "minillm" / "kv_cache.py").unlink()
    g = course.grade_exercise(copy, exercises["1.1"], [])
    assert not g.ok and g.passed == 0 and "No module named 'minillm.kv_cache'" in g.result, g


def test_blocked_only_by_a_handed_out_declared_dependency_that_is_still_unsolved(small_edition, tmp_path):
    """3.2's truncate tests run the model through 3.1's attend: with 3.2 solved and 3.1 not, 3.2 is
    BLOCKED (by 3.1) and its blocked tests are not counted. A stub message raised from the student's
    own code blocks nothing: 1.1 raising exercise 8.2's (not in this edition, not a dependency of
    1.1) is a FAIL; so is 3.2 raising 3.1's once 3.1 is solved."""
    manifest = small_edition / course.MANIFEST_JSON
    sub = make_submission(small_edition, tmp_path / "a", bodies={
        "3.2": "reference", "1.1": 'raise NotImplementedError("Exercise 8.2: divide x by its root mean square")'})
    grades = {g.exercise: g for g in course.grade(sub, manifest_path=manifest, exercises=["1.1", "3.2"])}
    g = grades["3.2"]
    assert g.result == "BLOCKED (by 3.1)" and g.failed == 0 and g.total == g.passed and len(g.blocked) > 0, g
    assert grades["1.1"].result == "FAIL" and not grades["1.1"].blocked, grades["1.1"]
    table = course.format_grades(list(grades.values()))
    assert "BLOCKED (by 3.1)" in table and "0/2 exercises pass, 1 blocked" in table
    task = next(ex.task for ex in course.find_exercises(ROOT) if ex.id == "3.1")
    sub = make_submission(small_edition, tmp_path / "b", bodies={
        "3.1": "reference", "3.2": f'raise NotImplementedError("Exercise 3.1: {task}")'})
    [g] = course.grade(sub, manifest_path=manifest, exercises=["3.2"])
    assert g.result == "FAIL" and not g.blocked and g.failed > 0, g


def test_what_may_block_an_exercise():
    """The rule itself: a dependency declared in EXERCISE_DEPENDS, handed out, and unsolved; a failure
    that names any other stub, or the exercise's own, is the student's."""
    ex = {e.id: e for e in course.find_exercises(ROOT)}
    assert course.may_block(ex["3.2"], {"3.1", "3.2"}, {"3.1", "3.2"}) == ["3.1"]
    assert course.may_block(ex["3.2"], {"3.2"}, {"3.1", "3.2"}) == []  # 3.1 not handed out
    assert course.may_block(ex["3.2"], {"3.1", "3.2"}, {"3.2"}) == []  # 3.1 solved
    assert course.may_block(ex["11.3"], {"8.2", "11.3"}, {"8.2", "11.3"}) == []  # 8.2 not a dependency of 11.3
    assert course.classify("3.2", "E  NotImplementedError: Exercise 3.1: write k, v", ["3.1"]) == ["3.1"]
    assert course.classify("3.2", "E  NotImplementedError: Exercise 3.1: write k, v", []) == []
    assert course.classify("3.2", "NotImplementedError: Exercise 3.2: roll back\nNotImplementedError: Exercise "
                                  "3.1: x", ["3.1"]) == []
    assert course.classify("3.2", "NotImplementedError: Exercise 8.2: x", ["3.1"]) == []
    assert course.classify("3.2", "assert 3 == 4", ["3.1"]) == []


REGION_SOURCE = ("import numpy as np\n\nTABLE = {}\n\n\nclass C:\n    def f(self, x):\n"
                 "        # EXERCISE 9.1 BEGIN: do it\n        return x\n        # EXERCISE 9.1 END\n")


@pytest.mark.parametrize("body,why", [
    ("import pytest", "imports pytest: the test machinery"),
    ("from _pytest import python", "imports _pytest: the test machinery"),
    ("import numpy.testing", "imports testing: the test machinery"),
    ("np.testing.assert_allclose(x, x)", "uses testing: the test machinery"),
    ("import sys\nsys.modules.clear()", "imports sys: the interpreter or the process"),
    ("import atexit", "imports atexit: the interpreter or the process"),
    ("return __builtins__", "uses __builtins__: the interpreter's internals"),
    ("import os\nos.environ['X'] = '1'", "imports os: the interpreter or the process"),
    ("open('out.txt', 'w').write('x')", "uses open: files or the network"),
    ("np.save('x.npy', x)", "uses save: files or the network"),
    ("import socket", "imports socket: files or the network"),
    ("__import__('os')", "uses __import__: code made or looked up at run time"),
    ("import importlib", "imports importlib: code made or looked up at run time"),
    ("import subprocess", "imports subprocess: code made or looked up at run time"),
    ("exec('y = 1')", "uses exec: code made or looked up at run time"),
    ("return eval('x')", "uses eval: code made or looked up at run time"),
    ("return globals()", "uses globals: code made or looked up at run time"),
    ("setattr(np, 'allclose', print)", "uses setattr: code made or looked up at run time"),
    ("return getattr(np, 'lo' + 'ad')", "uses getattr: code made or looked up at run time"),
    ("raise KeyboardInterrupt", "uses KeyboardInterrupt: the interpreter or the process"),
    ("np.allclose = print", "assigns np.allclose: state outside the function"),
    ("TABLE['x'] = 1", "assigns TABLE['x']: state outside the function"),
    ("m = np\nm.allclose = print", "assigns m.allclose: only a parameter's own attributes"),
    ("self.a.b = 1", "assigns self.a.b: only a parameter's own attributes"),
    ("def g(self):\n    self.x = 1\ng(np)", "assigns self.x: only a parameter's own attributes"),
    ("global TABLE", "declares global TABLE: state outside the function"),
    ("return x.__class__", "uses __class__: the interpreter's internals"),
    ("return np._core", "uses np._core: a private name of another module"),
    ("import zipfile", "imports zipfile: a solution imports only numpy"),
    ("from ..tools import project", "imports tools: the interpreter or the process"),
    ("import functools\nfunctools.update_wrapper(np, x)", "uses update_wrapper: attributes set on another object"),
    ("from functools import wraps", "imports wraps: attributes set on another object"),
    ("return np.ma.masked_all(3)", "uses ma: masked arrays, whose masked entries every comparison skips"),
    ("from numpy import ma", "imports ma: masked arrays"),
    ("class A(np.ndarray):\n    def all(self):\n        return True", "defines class A: a class made"),
    ("return x.view(type('A', (np.ndarray,), {}))", "uses type(name, bases, namespace): a class made"),
    ("t = type\nreturn t('A', (), {})", "uses type(name, bases, namespace): a class made"),
    ("return {'__array_ufunc__': None}", "names __array_ufunc__: the interpreter's internals"),
    ("return (", "does not parse"),
])
def test_a_region_body_that_reaches_outside_its_function_is_refused(body, why):
    """Each entry of course.REFUSED's kinds, and the structural rules, with the reason the grade shows."""
    [ex] = course.parse_markers(REGION_SOURCE, "m.py")
    lines = [f"        {line}\n" for line in body.splitlines()]
    assert course.refused_in_body(REGION_SOURCE, ex, lines).startswith(why)


def test_ordinary_solutions_and_every_reference_solution_are_accepted():
    [ex] = course.parse_markers(REGION_SOURCE, "m.py")
    body = ("from .kv_cache import KVCache\nimport math\nout = np.zeros(3)\nout[0] = math.sqrt(2)\n"
            "self.length = len(out)\nx.shape = (-1,)\nassert type(x) is np.ndarray, '__x__ of ' + 'ma'\n"
            "return [r for r in out if r.__len__]")
    assert course.refused_in_body(REGION_SOURCE, ex, [f"        {line}\n" for line in body.splitlines()]) == ""
    for ex in course.find_exercises(ROOT):
        text = (ROOT / ex.file).read_text()
        assert course.refused_in_body(text, ex, text.splitlines(keepends=True)[ex.begin : ex.end - 1]) == "", ex.id


def test_a_manifest_with_an_id_that_is_not_a_string_or_a_selection_outside_it_is_one_line(small_edition, tmp_path):
    """--exercises and --chapters pick among the manifest's exercises; an id or chapter it does not hand
    out, or a manifest whose ids are not strings, is refused with one line (CourseError, exit 1)."""
    bad = tmp_path / "MANIFEST.json"
    bad.write_text('[{"id": 3}]')
    with pytest.raises(course.CourseError, match="exercise id 3 is not a string"):
        course.manifest_ids(bad)
    deep = tmp_path / "deep.json"
    deep.write_text('[{"id": "3.1", "notes": ' + "[" * 100_000 + "]" * 100_000 + "}]")
    with pytest.raises(course.CourseError, match="deep.json is not a manifest written by `course student-edition`"):
        course.manifest_ids(deep)
    manifest = small_edition / course.MANIFEST_JSON
    empty = tmp_path / "empty"
    (empty / "minillm").mkdir(parents=True)
    assert [g.exercise for g in course.grade(empty, manifest_path=manifest, chapters=["3"])] == ["3.1", "3.2"]
    with pytest.raises(course.CourseError, match="no exercise 2.1 in the manifest"):
        course.grade(empty, manifest_path=manifest, exercises=["2.1"])
    with pytest.raises(course.CourseError, match=r"no exercises in chapter\(s\) 2 in the manifest"):
        course.grade(empty, manifest_path=manifest, chapters=["2"])
    r = run_cli("course", "grade", str(empty), "--manifest", str(bad))
    assert r.returncode == 1 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_grading_uses_the_instructors_tests_and_manifest_not_the_submissions(small_edition, tmp_path):
    """A submission whose MANIFEST.json drops its stubbed exercise and whose grading test file is
    edited to pass gets no credit: grade runs the reference's tests, for the exercises of the
    instructor's manifest that --exercises names."""
    sub = make_submission(small_edition, tmp_path / "submission")
    (sub / "tests").mkdir()
    (sub / course.MANIFEST_JSON).write_text("[]\n")
    (sub / "tests" / "test_sampling.py").write_text(
        'import pytest\n\n\n@pytest.mark.exercise("1.1")\ndef test_top_k():\n    assert True\n')
    r = run_cli("course", "grade", str(sub), "--manifest", str(small_edition / course.MANIFEST_JSON),
                "--exercises", "1.1")
    assert r.returncode == 1, r.stdout + r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line.split()[:1] in (["1.1"], ["3.1"])]
    assert len(rows) == 1 and rows[0][3] == "FAIL", r.stdout
    assert "0/1 exercises pass" in r.stdout


@pytest.fixture(scope="module")
def chapter12_edition(tmp_path_factory):
    """An edition with chapter 12's exercises stubbed (the others solved), for the notebook tests below."""
    out = tmp_path_factory.mktemp("chapter12") / "edition"
    course.student_edition(ROOT, out, chapters=["12"])
    return out


def execute_notebook(page, edition, out_dir, *jupyter):
    """Execute notebook ``page`` (in its own folder) with ``jupyter ... nbconvert`` started in ``edition``
    from a student's shell (no PYTHONPATH), writing to ``out_dir`` -> the executed notebook, or the
    error's tail."""
    nbformat = pytest.importorskip("nbformat")
    out = Path(out_dir) / ("executed_" + Path(page).name)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([*jupyter, "nbconvert", "--to", "notebook", "--execute", "--output-dir", str(out.parent),
                        "--output", out.name, str(page)],
                       cwd=edition, env=dict(env, MPLBACKEND="Agg"), capture_output=True, text=True, timeout=600)
    return nbformat.read(out, as_version=4) if r.returncode == 0 else r.stderr[-300:]


def printed(notebook) -> list[str]:
    return ["".join(o.get("text", "") for o in cell.get("outputs", [])).strip() for cell in notebook.cells
            if cell.cell_type == "code"]


LAB = (sys.executable, "-m", "minillm", "course", "lab")


def test_edition_notebooks_run_the_editions_code_with_the_reference_installed(chapter12_edition, tmp_path):
    """Opened as MANIFEST.md says (``python -m minillm course lab`` in the edition), a notebook
    imports the edition's minillm, even though this environment has the reference installed; opened
    by plain Jupyter, it would not. (A kernel runs in its notebook's folder, which holds no minillm:
    the edition's notebooks/, or here a folder beside it.)"""
    pytest.importorskip("nbclient")
    nbformat = pytest.importorskip("nbformat")
    page = tmp_path / "where_is_minillm.ipynb"
    cell = nbformat.v4.new_code_cell("import minillm\nprint(minillm.__file__)")
    nbformat.write(nbformat.v4.new_notebook(cells=[cell]), page)
    via_lab = execute_notebook(page, chapter12_edition, tmp_path, *LAB)
    assert Path(printed(via_lab)[0]).resolve().is_relative_to(chapter12_edition.resolve()), via_lab
    plain = execute_notebook(page, chapter12_edition, tmp_path, sys.executable, "-m", "jupyter")
    assert not Path(printed(plain)[0]).resolve().is_relative_to(chapter12_edition.resolve()), plain


@pytest.mark.slow
def test_notebook_12_of_an_edition_runs_the_students_fused_code(chapter12_edition, tmp_path):
    """Notebook 12 executed through ``course lab`` in an edition with chapter 12 stubbed: a cell that
    calls the edition's ``fused.decode_attention`` or ``fused.qkv_to_cache`` meets the stub and says so
    ("this cell needs exercise 12.2 ..."), so the page shows the student's code, not the reference's
    outputs. The rest of the page runs (its other chapters are solved)."""
    pytest.importorskip("nbclient")
    page = course.chapter_notebook(chapter12_edition, "12")
    executed = execute_notebook(page, chapter12_edition, tmp_path, *LAB)
    assert not isinstance(executed, str), executed
    needs = [text for text in printed(executed) if text.startswith("this cell needs exercise")]
    assert needs and all(text.startswith(("this cell needs exercise 12.1", "this cell needs exercise 12.2"))
                         for text in needs), needs


@pytest.mark.slow
def test_notebook_12s_test_fails_in_an_edition_until_its_exercises_are_solved(chapter12_edition):
    """The manifest lists notebook 12's execution test under "also fails" for 12.1 and 12.2. Run from a
    student's shell in the edition (no PYTHONPATH; the reference installed in this environment), it
    fails, naming the stub a cell met: the kernel ran the edition's code, and a skipped cell is no pass."""
    test = next(s for s in course.find_exercises(ROOT) if s.id == "12.2").also_fails[-1].tests
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test], cwd=chapter12_edition,
                       env=dict(env, PYTHONDONTWRITEBYTECODE="1", MPLBACKEND="Agg"), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 1 and "cells skipped, the first: this cell needs exercise 12." in r.stdout, r.stdout[-2000:]


# Of the tests no exercise names, the edition's run below takes one in SAMPLE_ONE_IN (MINILLM_KIT_ALL=1: all)
SAMPLE_ONE_IN = 1 if os.environ.get("MINILLM_KIT_ALL") == "1" else 16


@pytest.mark.slow
def test_student_edition_fails_exactly_the_named_tests(edition, tmp_path):
    """All exercises stubbed: every test the manifest names fails, each exercise's grading selection
    has a test that fails with that exercise's NotImplementedError alone, and the tests run beside
    them that no exercise names pass.

    What runs: every test the manifest names (the ``exercise`` and ``uses_exercise`` marks), and of the
    others one in SAMPLE_ONE_IN that is not marked slow, the same ones each time (a hash of the node
    id: course_plugin's MINILLM_KIT_SAMPLE). The others are covered by MINILLM_KIT_ALL=1, which runs
    every test of the edition (a few minutes on two cores; run it before handing out an edition after
    the tests changed); a test there that fails without being named runs exercise code and needs a
    ``uses_exercise`` mark. Not run either way: tests/test_site.py (it renders the committed notebooks
    and runs no library code), the notebooks (minutes each; named by their chapter's exercises; a
    notebook of an edition is executed in the next test) and the Hugging Face oracles (tests named
    *transformers* / *huggingface*: they check what the float64 references of test_model and
    test_llama also cover)."""
    edition = shutil.copytree(edition, tmp_path / "edition")  # the run writes caches: a copy of its own
    files = sorted(p.relative_to(edition).as_posix() for p in (edition / "tests").glob("test_*.py")
                   if p.name != "test_site.py")  # builds pages from the committed notebooks: no exercise code runs
    halves = [files[0::2], files[1::2]]  # two pytest processes, one per core

    def run(i):
        report = tmp_path / f"report{i}.json"
        r = run_pytest(edition, "--tb=line", *halves[i], "-k", "not transformers and not huggingface",
                       "--deselect", "tests/test_notebooks.py::test_notebook_executes", report=report,
                       sample=SAMPLE_ONE_IN)
        assert r.returncode in (0, 1), r.stdout[-3000:] + r.stderr[-3000:]
        return json.loads(report.read_text())

    with ThreadPoolExecutor(2) as pool:
        tests = {t: e for part in pool.map(run, range(2)) for t, e in part.items()}
    failed = {t for t, e in tests.items() if e["failed"]}
    named = {t for t, e in tests.items() if e["named_by"]}
    ran = {t for t, e in tests.items() if not e["skipped"]}  # a device's test skips on a CPU: it passes nothing
    assert len(tests) - len(named) >= 10, "the sample of the tests no exercise names is empty"
    assert not failed - named, f"tests that break but no exercise names: {sorted(failed - named)}"
    assert not named & ran - failed, f"tests named by an exercise that still pass: {sorted(named & ran - failed)}"
    lacking = [ex.command for ex in course.find_exercises(ROOT)
               if not any(ex.id in e["named_by"] and t.startswith(ex.checks.tests + "::") and e["raised"] == [ex.id]
                          for t, e in tests.items())]
    assert not lacking, f"no test fails with only the exercise's own NotImplementedError: {lacking}"


def test_instructors_guide_lists_every_exercise_with_its_grading_command():
    """docs/instructors.md's exercise table says what the manifest says: file, function and the exact
    grading command of every exercise (so the guide cannot drift from the tests)."""
    guide = (ROOT / "docs" / "instructors.md").read_text()
    exercises = course.find_exercises(ROOT)
    for ex in exercises:
        row = f"| {ex.id} | `{ex.file}` | `{ex.function}` | `{ex.command}` |"
        assert row in guide, f"docs/instructors.md lacks (or has a stale) row: {row}"
    assert f"every one of the {len(exercises)} exercises" in guide, "the guide's count of exercises is stale"


def test_notebooks_show_library_source_without_exercise_solutions():
    """minillm.show / source_without_solutions: a function's source as the chapters print it, each
    exercise region's body replaced by one line naming the exercise, the rest verbatim."""
    from minillm import sampling
    from minillm.notebook import source_without_solutions

    text = source_without_solutions(sampling.top_k_filter)
    assert "def top_k_filter(logits, k):" in text and "# EXERCISE 1.1 END" in text
    assert "...  (exercise 1.1: the solution is yours to write)" in text
    assert "np.sort" not in text and "np.where" not in text  # the two solution lines
