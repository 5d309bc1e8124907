"""python -m minillm parts: a file split into checked parts joins back byte for byte; a missing or corrupt part,
a manifest that does not add up, a name that is not a plain file name, or a file that exists, is one line of
error and leaves nothing behind; a join reads only its parts folder and writes only its output folder."""

import json

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
    (tmp_path / "there").mkdir()
    return tmp_path, data


def files(folder) -> list:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))


def edit_manifest(tmp_path, edit) -> None:
    path = tmp_path / "carry" / MANIFEST
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def test_split_then_join_is_the_same_file(carried):
    tmp_path, data = carried
    assert files(tmp_path / "carry") == [MANIFEST, "model.whl.part000", "model.whl.part001", "model.whl.part002"]
    manifest = json.loads((tmp_path / "carry" / MANIFEST).read_text())
    assert (manifest["bytes"], manifest["part_count"]) == (len(data), 3)
    assert join(tmp_path / "carry", tmp_path / "there").read_bytes() == data
    assert files(tmp_path / "there") == ["model.whl"]


@pytest.mark.parametrize("damage, message", [
    (lambda part: part.write_bytes(part.read_bytes()[:-1] + b"x"), "corrupt"),
    (lambda part: part.write_bytes(part.read_bytes() + b"x"), "corrupt"),
    (lambda part: part.unlink(), "missing"),
])
def test_a_bad_part_is_refused_and_leaves_nothing(carried, damage, message):
    tmp_path, _ = carried
    damage(tmp_path / "carry" / "model.whl.part001")
    with pytest.raises(PartsError, match=message):
        join(tmp_path / "carry", tmp_path / "there")
    assert files(tmp_path / "there") == []


def drop_last_part(m):
    m["parts"].pop()


def drop_last_part_everywhere(m):  # the count and the parts agree, the size does not
    m["parts"].pop()
    m["part_count"] = 2


@pytest.mark.parametrize("edit, message", [
    (drop_last_part, "lists 2 parts but the file was split into 3"),
    (drop_last_part_everywhere, "do not add up to the file's 2,500,000 bytes"),
    (lambda m: m.pop("part_count"), "'part_count' must be a whole number"),
    (lambda m: m.pop("sha256"), "'sha256' must be 64 lowercase hex digits"),
    (lambda m: m.update(bytes="2500000"), "'bytes' must be a whole number >= 0, got '2500000'"),
    (lambda m: m.update(bytes=True), "'bytes' must be a whole number"),
    (lambda m: m["parts"][0].update(bytes=-1), "part 0: 'bytes' must be a whole number >= 0, got -1"),
    (lambda m: m.update(parts={"a": 1}), "not a manifest"),
    (lambda m: m["parts"].__setitem__(1, "model.whl.part001"), "part 1 is not an object"),
])
def test_a_manifest_that_does_not_add_up_is_refused_before_anything_is_written(carried, edit, message):
    """A manifest with a part dropped joined a truncated file ("joined and checked"); a missing key or a wrong
    type was a traceback: each is one line naming the problem, and the output folder stays empty."""
    tmp_path, _ = carried
    edit_manifest(tmp_path, edit)
    with pytest.raises(PartsError, match=message):
        join(tmp_path / "carry", tmp_path / "there")
    assert files(tmp_path / "there") == []


@pytest.mark.parametrize("where, name", [
    ("file", "/abs/zz.pth"), ("file", "../zz.pth"), ("file", "sub/zz.pth"), ("file", ".."), ("file", ""),
    ("file", 7), ("part", "../victim/secret.txt"), ("part", "/etc/hostname"), ("part", "a\\b"),
])
def test_names_in_the_manifest_must_be_plain_file_names(carried, where, name):
    """A manifest named `<site-packages>/zz.pth` wrote a file whose code ran at the next `python`; a part named
    `../victim/secret.txt` read a file outside the parts folder: neither is a plain file name, so join refuses
    before it opens a file."""
    tmp_path, _ = carried
    if name == "/abs/zz.pth":
        name = str(tmp_path / "zz.pth")  # an absolute path that could be written
    edit_manifest(tmp_path, (lambda m: m.update(name=name)) if where == "file" else
                  (lambda m: m["parts"][0].update(name=name)))
    with pytest.raises(PartsError, match="is not a plain file name"):
        join(tmp_path / "carry", tmp_path / "there")
    assert files(tmp_path / "there") == [] and not (tmp_path / "zz.pth").exists()


def test_join_into_a_folder_that_does_not_exist_is_refused(carried, capsys):
    """`join carry/ wheels/` with no wheels/ wrote a file named wheels: the output must be an existing folder."""
    tmp_path, _ = carried
    assert cli.main(["parts", "join", str(tmp_path / "carry"), str(tmp_path / "wheels")]) == 1
    assert capsys.readouterr().err.strip() == (f"error: {tmp_path / 'wheels'}: no such folder (join writes "
                                               "model.whl into an existing folder)")
    assert not (tmp_path / "wheels").exists()


def test_nothing_is_overwritten(carried, capsys):
    tmp_path, data = carried
    assert cli.main(["parts", "join", str(tmp_path / "carry"), str(tmp_path)]) == 1
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'model.whl'} exists: not overwritten"
    assert (tmp_path / "model.whl").read_bytes() == data
    with pytest.raises(PartsError, match="empty folder"):
        split(tmp_path / "model.whl", tmp_path / "carry", part_mb=1)


def test_split_never_overwrites_a_stray_part(tmp_path):
    """A folder holding an earlier split's part but no manifest: split replaced the part. It refuses, and
    writes nothing."""
    (tmp_path / "model.whl").write_bytes(b"x" * 2_500_000)
    (tmp_path / "carry").mkdir()
    (tmp_path / "carry" / "model.whl.part002").write_bytes(b"mine")
    with pytest.raises(PartsError, match="model.whl.part002 exists: split into an empty folder"):
        split(tmp_path / "model.whl", tmp_path / "carry", part_mb=1)
    assert files(tmp_path / "carry") == ["model.whl.part002"]
    assert (tmp_path / "carry" / "model.whl.part002").read_bytes() == b"mine"


def test_a_part_size_out_of_range_is_a_usage_error(tmp_path, capsys):
    """`--part-mb 10**20` was a traceback (OverflowError): a usage error naming the option, exit 2."""
    (tmp_path / "f").write_bytes(b"abc")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["parts", "split", str(tmp_path / "f"), str(tmp_path / "c"), "--part-mb", str(10**20)])
    assert exit_.value.code == 2
    assert "argument --part-mb: must be <= 1000000" in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "c").exists()
