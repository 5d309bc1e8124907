"""The course kit (minillm.tools.course): well-formed markers, the student edition and the rule it keeps.

The rule (docs/instructors.md): in the student edition every exercise raises NotImplementedError, and
the tests that fail are exactly the ones the manifest names (each exercise's grading selection plus
its ``also_fails``); each exercise, stubbed alone, fails its own grading command with its own
NotImplementedError. The reference passes everything (the rest of this suite).

The second half is read off the same run as the first, not from one run per exercise (a minute and
a half more here): a test whose only NotImplementedError is exercise e's met e's stub before any
other stub (the first one raised ends the test), so with e alone stubbed it takes the same path and
fails the same way.
"""

import json
import os
import subprocess
import sys
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
        assert (ROOT / ex.checks.tests).is_file() and ex.function and ex.task, ex
        assert ex.also_fails and ex.also_fails[-1].tests == course.NOTEBOOK_TEST  # the chapter's notebook


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
    with pytest.raises(course.CourseError, match="checked by no test file"):
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


def test_depends_are_read_checked_and_written_to_the_stub_and_the_manifest(tmp_path):
    """DEPENDS = {exercise: "ids"} beside EXERCISES: the manifest lists them, the stub names them in a
    comment; a dependency that is unknown, of the same chapter, or declared by another file is refused."""
    (tmp_path / "minillm").mkdir()
    (tmp_path / "tests").mkdir()
    region = "def {0}():\n    # EXERCISE {1} BEGIN: a\n    return 1\n    # EXERCISE {1} END\n"
    ids = ("1.1", "1.2", "2.1", "2.2")
    (tmp_path / "minillm" / "a.py").write_text("".join(region.format(f"f{n}", i) for n, i in enumerate(ids)))
    claims = 'EXERCISES = {"1.1": "a", "1.2": "b", "2.1": "c", "2.2": "d"}\n'
    test_file = tmp_path / "tests" / "test_a.py"
    test_file.write_text(claims + 'DEPENDS = {"2.1": "1.1, 1.2"}\n')
    ex = {e.id: e for e in course.find_exercises(tmp_path)}
    assert ex["2.1"].depends == ["1.1", "1.2"] and ex["2.2"].depends == []
    stub = course.stub_source((tmp_path / "minillm" / "a.py").read_text(), [ex["2.1"]])
    assert "    # its grading tests also run exercise(s) 1.1, 1.2: solve those too\n" in stub
    assert course.manifest([ex["2.1"]])[0]["depends"] == ["1.1", "1.2"]
    assert "| a | 1.1, 1.2 | `python -m pytest tests/test_a.py -k c` |" in course.manifest_markdown([ex["2.1"]])
    for depends, message in [('{"2.1": "1.9"}', "no source file marks"), ('{"2.1": "2.2"}', "same chapter"),
                             ('{"3.1": "1.1"}', "does not grade")]:
        test_file.write_text(claims + f"DEPENDS = {depends}\n")
        with pytest.raises(course.CourseError, match=message):
            course.find_exercises(tmp_path)


@pytest.fixture(scope="module")
def reference_copy(tmp_path_factory):
    return course.copy_project(ROOT, tmp_path_factory.mktemp("solved") / "project", leave_out=course.INSTRUCTORS_ONLY)


# Each run is a pytest process over one grading selection (from 10 s to over a minute, chapter 5's
# chi-square tests being the slowest): by default only 3.3, whose dependency on chapter 1 is the one
# a student meets first; MINILLM_KIT_ALL=1 checks every exercise (about 15 minutes on 2 cores).
EXERCISES_BY_ID = {ex.id: ex for ex in course.find_exercises(ROOT)}
SOLVED_ALONE = list(EXERCISES_BY_ID) if os.environ.get("MINILLM_KIT_ALL") == "1" else ["3.3"]


@pytest.mark.parametrize("ex_id", SOLVED_ALONE)
def test_exercise_passes_with_only_its_chapter_and_declared_dependencies_solved(reference_copy, ex_id):
    """Every other exercise stubbed: the exercise's grading command passes, so the manifest's
    ``depends`` (and the stub's comment) name everything a student must solve first."""
    ex = EXERCISES_BY_ID[ex_id]
    others = [e for e in EXERCISES_BY_ID.values() if e.chapter != ex.chapter and e.id not in ex.depends]
    with patched(reference_copy, course.stubbed_sources(ROOT, others)):
        r = run_pytest(reference_copy, "--tb=line", ex.checks.tests, "-k", ex.checks.keyword)
    solved = f"only chapter {ex.chapter} and {ex.depends} solved"
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
        course.student_edition(ROOT, tmp_path / "ed2", chapters=["11"])


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


def test_project_root_is_found_or_named(tmp_path):
    assert project.project_root() == ROOT and project.project_root(ROOT) == ROOT
    with pytest.raises(project.ProjectRootError, match="is not a minillm project"):
        project.project_root(tmp_path)


@pytest.fixture(scope="module")
def edition(tmp_path_factory):
    out = tmp_path_factory.mktemp("h9_student") / "edition"
    r = run_cli("course", "student-edition", str(out))
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
        assert r["command"].startswith(f"python -m pytest {r['checks']['tests']}")
    assert (edition / "minillm" / "models" / "target.npz").is_file()
    assert (edition / "MANIFEST.md").read_text().count("| ") > len(rows)
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
    r = run_cli("course", "grade", str(ROOT), "--chapters", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2/2 exercises pass" in r.stdout and "FAIL" not in r.stdout
    r = run_cli("course", "grade", str(edition), "--chapters", "1")
    assert r.returncode == 1
    lines = [line.split() for line in r.stdout.splitlines()]
    rows = {cells[0]: cells[1:3] for cells in lines if cells and cells[0] in ("1.1", "1.2")}
    assert rows.keys() == {"1.1", "1.2"} and all(c[0].startswith("0/") and c[1] == "FAIL" for c in rows.values())
    assert "0/2 exercises pass" in r.stdout


@pytest.mark.slow
def test_student_edition_fails_exactly_the_named_tests(edition, tmp_path):
    """All exercises stubbed: the failing tests == the union of the tests the manifest names, and each
    exercise's grading selection has a test that fails with that exercise's NotImplementedError alone.
    Not run here: the notebooks (minutes each; named by their chapter's exercises) and the Hugging
    Face oracles (tests named *transformers* / *huggingface*: seconds to a minute of loading torch and
    the weights; they check what the float64 references of test_model and test_llama also cover)."""
    files = sorted(p.relative_to(edition).as_posix() for p in (edition / "tests").glob("test_*.py"))
    halves = [files[0::2], files[1::2]]  # two pytest processes, one per core

    def run(i):
        report = tmp_path / f"report{i}.json"
        r = run_pytest(edition, "--tb=line", *halves[i], "-k", "not transformers and not huggingface",
                       "--deselect", "tests/test_notebooks.py::test_notebook_executes", report=report)
        assert r.returncode in (0, 1), r.stdout[-3000:] + r.stderr[-3000:]
        return json.loads(report.read_text())

    with ThreadPoolExecutor(2) as pool:
        tests = {t: e for part in pool.map(run, range(2)) for t, e in part.items()}
    failed = {t for t, e in tests.items() if e["failed"]}
    named = {t for t, e in tests.items() if e["named_by"]}
    assert not failed - named, f"tests that break but no exercise names: {sorted(failed - named)}"
    assert not named - failed, f"tests named by an exercise that still pass: {sorted(named - failed)}"
    lacking = [ex.command for ex in course.find_exercises(ROOT)
               if not any(ex.id in e["named_by"] and t.startswith(ex.checks.tests + "::") and e["raised"] == [ex.id]
                          for t, e in tests.items())]
    assert not lacking, f"no test fails with only the exercise's own NotImplementedError: {lacking}"


def test_instructors_guide_lists_every_exercise_with_its_grading_command():
    """docs/instructors.md's exercise table says what the manifest says: file, function and the exact
    grading command of every exercise (so the guide cannot drift from the tests)."""
    guide = (ROOT / "docs" / "instructors.md").read_text()
    for ex in course.find_exercises(ROOT):
        row = f"| {ex.id} | `{ex.file}` | `{ex.function}` | `{ex.command}` |"
        assert row in guide, f"docs/instructors.md lacks (or has a stale) row: {row}"


def test_notebooks_show_library_source_without_exercise_solutions():
    """minillm.show / source_without_solutions: a function's source as the chapters print it, each
    exercise region's body replaced by one line naming the exercise, the rest verbatim."""
    from minillm import sampling
    from minillm.notebook import source_without_solutions

    text = source_without_solutions(sampling.top_k_filter)
    assert "def top_k_filter(logits, k):" in text and "# EXERCISE 1.1 END" in text
    assert "...  (exercise 1.1: the solution is yours to write)" in text
    assert "np.sort" not in text and "np.where" not in text  # the two solution lines
