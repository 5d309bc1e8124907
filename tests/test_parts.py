"""python -m minillm parts: a file split into checked parts joins back byte for byte; a missing or corrupt part,
or a file that exists, is one line of error and leaves nothing behind."""

import numpy as np
import pytest

from minillm.tools import cli
from minillm.tools.parts import MANIFEST, PartsError, join, split

pytestmark = pytest.mark.host_only


@pytest.fixture
def carried(tmp_path):
    data = np.random.default_rng(0).bytes(2_500_000)
    (tmp_path / "model.whl").write_bytes(data)
    split(tmp_path / "model.whl", tmp_path / "carry", part_mb=1)
    return tmp_path, data


def test_split_then_join_is_the_same_file(carried):
    tmp_path, data = carried
    assert sorted(p.name for p in (tmp_path / "carry").iterdir()) == [
        MANIFEST, "model.whl.part000", "model.whl.part001", "model.whl.part002"]
    (tmp_path / "there").mkdir()
    assert join(tmp_path / "carry", tmp_path / "there").read_bytes() == data


@pytest.mark.parametrize("damage, message", [
    (lambda part: part.write_bytes(part.read_bytes()[:-1] + b"x"), "corrupt"),
    (lambda part: part.unlink(), "missing"),
])
def test_a_bad_part_is_refused_and_leaves_nothing(carried, damage, message):
    tmp_path, _ = carried
    damage(tmp_path / "carry" / "model.whl.part001")
    with pytest.raises(PartsError, match=message):
        join(tmp_path / "carry", tmp_path / "joined.whl")
    assert not list(tmp_path.glob("joined.whl*"))


def test_nothing_is_overwritten(carried, capsys):
    tmp_path, data = carried
    assert cli.main(["parts", "join", str(tmp_path / "carry"), str(tmp_path / "model.whl")]) == 1
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'model.whl'} exists: not overwritten"
    assert (tmp_path / "model.whl").read_bytes() == data
    with pytest.raises(PartsError, match="empty folder"):
        split(tmp_path / "model.whl", tmp_path / "carry", part_mb=1)
