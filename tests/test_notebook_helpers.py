"""What a notebook page uses beside the chapters (``minillm.notebook``): a cell of a student edition that
runs into an unsolved exercise prints one line, and the page goes on.

The guard rewrites each cell (IPython's AST transformers); these tests run cells through a real IPython
shell, as Jupyter does, and check what a student sees: one line naming the exercise, no traceback, the
next cells still run, a later cell that needs the skipped cell's result says so, any other error is
still an error, and the value of a cell's last expression is still displayed.
"""

import pytest

from minillm.notebook import UNSOLVED, skip_unsolved_exercises, stub_message

pytestmark = pytest.mark.host_only
InteractiveShell = pytest.importorskip("IPython.core.interactiveshell").InteractiveShell

STUB = "def attend():\n    raise NotImplementedError({!r})\n".format(stub_message("3.1", "append the new keys/values"))


@pytest.fixture
def shell():
    sh = InteractiveShell.instance()
    sh.ast_transformers[:] = []
    skip_unsolved_exercises(sh)
    yield sh
    sh.ast_transformers[:] = []
    InteractiveShell.clear_instance()


def run(shell, capsys, source):
    """-> (the cell's result, what it printed)."""
    result = shell.run_cell(source, store_history=True)
    return result, capsys.readouterr().out


def test_a_cell_that_needs_an_unsolved_exercise_prints_one_line_and_succeeds(shell, capsys):
    result, out = run(shell, capsys, STUB + "cache = attend()\nprint('after the stub')")
    assert result.success and result.error_in_exec is None
    assert out.strip().splitlines() == ["this cell needs exercise 3.1 (append the new keys/values): solve it, "
                                        "then run the cell again"]
    result, out = run(shell, capsys, "print('the next cell runs')")
    assert result.success and out == "the next cell runs\n"


def test_a_later_cell_that_needs_the_skipped_result_says_which_exercise(shell, capsys):
    run(shell, capsys, STUB + "cache = attend()")
    result, out = run(shell, capsys, "len(cache)")
    assert result.success
    assert "needs exercise 3.1" in out and "'cache' is not defined" in out and len(out.splitlines()) == 1


def test_other_errors_stay_errors(shell, capsys):
    """Only a stub's message is softened: a bug of the student's own is a traceback, as always."""
    for source, error in [("raise NotImplementedError('not an exercise stub')", NotImplementedError),
                          ("1 / 0", ZeroDivisionError), ("undefined_name", NameError)]:
        result, _ = run(shell, capsys, source)
        assert isinstance(result.error_in_exec, error), source


def test_the_last_expression_is_still_the_cells_value(shell, capsys):
    result, _ = run(shell, capsys, "x = 20\nx + 22")
    assert result.success and result.result == 42
    result, _ = run(shell, capsys, "y = 1")
    assert result.result is None


def test_stub_messages_are_what_the_guard_reads():
    """The course kit's stubs and the guard share one message format (minillm.notebook.stub_message)."""
    m = UNSOLVED.match(stub_message("A1.2", "the LayerNorm backward"))
    assert m and m["id"] == "A1.2" and m["task"] == "the LayerNorm backward"


def test_outside_ipython_it_does_nothing():
    assert skip_unsolved_exercises() is None  # pytest is not an IPython shell
