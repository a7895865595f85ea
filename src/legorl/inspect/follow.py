"""Follow growing JSONL files like ``tail -f``: each ``poll`` returns the records of the whole
lines appended since the last one, validated by ``legorl.records`` (alerts and the trainer's
log-probs included).

A line without its newline yet is held back until the writer finishes it, so a file being
written is never reported as truncated. A file that shrinks or is replaced is read again from
the start; a file that does not exist yet is waited for.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from legorl.records import FieldError, RecordError, from_dict

#: Bytes read per poll at most, so a huge file loads over several polls and the UI stays live.
CHUNK_BYTES = 8 * 1024 * 1024


@dataclass(slots=True)
class Line:
    """One parsed line: a ``legorl.records`` record or the error it raised."""

    lineno: int
    record: Any | None
    error: RecordError | None = None


class FileFollower:
    def __init__(self, path: str | os.PathLike[str], chunk_bytes: int = CHUNK_BYTES) -> None:
        self.path = Path(path)
        self.chunk_bytes = chunk_bytes
        self.offset = 0
        self.lineno = 0
        self.resets = 0  # times the file shrank or was replaced and was read again
        self._partial = b""
        self._inode: int | None = None

    @property
    def pending(self) -> bool:
        """Bytes on disk not read yet (more than one chunk was appended)."""
        try:
            return os.stat(self.path).st_size > self.offset
        except FileNotFoundError:
            return False

    def poll(self) -> list[Line]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return []
        if self._inode is not None and (st.st_ino != self._inode or st.st_size < self.offset):
            self.offset, self.lineno, self._partial = 0, 0, b""
            self.resets += 1
        self._inode = st.st_ino
        if st.st_size == self.offset:
            return []
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            data = fh.read(min(st.st_size - self.offset, self.chunk_bytes))
        self.offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        out = []
        for raw in lines:
            self.lineno += 1
            if raw.strip():
                out.append(self._parse(raw, self.lineno))
        return out

    def _parse(self, raw: bytes, lineno: int) -> Line:
        name = str(self.path)
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            return Line(lineno, None, RecordError(name, lineno, f"malformed JSON: {exc}"))
        try:
            return Line(lineno, from_dict(data))
        except FieldError as exc:
            return Line(lineno, None, RecordError(name, lineno, str(exc), exc.field_name))


def jsonl_files(folders: Sequence[Path]) -> list[Path]:
    """Every ``*.jsonl`` under the folders, in path order (a trajectory file sorts before its
    ``….turns/`` folder, so finished runs' turns are not shown as running)."""
    return sorted(p for folder in folders for p in folder.rglob("*.jsonl") if p.is_file())


def expand(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """Files as given, folders replaced by the ``*.jsonl`` files under them."""
    out: list[Path] = []
    for p in map(Path, paths):
        out.extend(jsonl_files([p]) if p.is_dir() else [p])
    return out
