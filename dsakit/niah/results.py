"""Append-only JSONL result files: one row per finished cell, written whole, safe to resume.

Guarantees:

* A row is serialized first and written with one ``os.write`` on an ``O_APPEND`` descriptor (looping only
  if the kernel accepts part of it), then flushed with ``fsync``. A Ctrl-C cannot split it: signals are
  delivered to Python between system calls, never inside one.
* A run killed by the OS in the middle of a write can leave a last line without its newline. Opening the
  store cuts such a tail (and reports it), so the file is again a list of complete rows.
* One writer per file: an exclusive ``flock`` on ``<file>.lock`` is held while the store is open, so two
  ``--resume`` runs on the same directory cannot both write a cell.
* Rows carry a ``cell`` key. Loading keeps the first row of a cell and counts any later duplicate.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path


class StoreLockedError(RuntimeError):
    """Another process holds the result file."""


class ResultStore:
    """Open with ``with ResultStore(path) as store``; ``store.rows`` holds the rows already on disk."""

    def __init__(self, path: "str | Path", fsync: bool = True):
        self.path = Path(path)
        self.fsync = fsync
        self.rows: dict[str, dict] = {}
        self.duplicates = 0
        self.repaired_bytes = 0
        self._fd: int | None = None
        self._lock_fd: int | None = None

    # -- open/close ---------------------------------------------------------------------------------
    def __enter__(self) -> "ResultStore":
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock_path = self.path.with_name(self.path.name + ".lock")
        self._lock_fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise StoreLockedError(f"{self.path} is in use by another dsakit niah run") from None
        try:
            self._repair_tail()
            self.rows, self.duplicates = read_rows(self.path)
            self._fd = os.open(self.path, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o644)
        except BaseException:
            # a malformed file must not leave the lock held: the caller fixes the line and opens again
            self.close()
            raise

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    def _repair_tail(self) -> None:
        """Cut a last line that has no newline (a write interrupted by a kill)."""
        if not self.path.exists():
            return
        with open(self.path, "rb+") as fh:
            data = fh.read()
            if not data or data.endswith(b"\n"):
                return
            keep = data.rfind(b"\n") + 1
            fh.truncate(keep)
            self.repaired_bytes = len(data) - keep

    # -- rows ---------------------------------------------------------------------------------------
    def __contains__(self, cell: str) -> bool:
        return cell in self.rows

    def append(self, row: dict) -> None:
        """Write one row (needs a 'cell' key not yet in the store) as one line."""
        if self._fd is None:
            raise RuntimeError("ResultStore is not open")
        cell = row.get("cell")
        if not isinstance(cell, str) or not cell:
            raise ValueError(f"a result row needs a non-empty string 'cell', got {cell!r}")
        if cell in self.rows:
            raise ValueError(f"cell {cell!r} already has a row in {self.path}; rows are never duplicated")
        data = (json.dumps(row, sort_keys=True, ensure_ascii=False) + "\n").encode()
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        if self.fsync:
            os.fsync(self._fd)
        self.rows[cell] = row


def read_rows(path: "str | Path") -> tuple[dict[str, dict], int]:
    """Rows of a result file keyed by cell (first row of a cell wins) and the number of duplicates.

    A last line without a newline (interrupted write) is ignored; a malformed complete line raises
    ValueError naming the line, since that is not something a crash produces.
    """
    path = Path(path)
    rows: dict[str, dict] = {}
    duplicates = 0
    if not path.exists():
        return rows, 0
    data = path.read_bytes()
    lines = data.split(b"\n")
    complete = lines[:-1]  # the piece after the last newline is empty or an interrupted write
    for number, line in enumerate(complete, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as exc:  # RecursionError: nested deeper than json reads
            reason = exc if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
            raise ValueError(f"{path}:{number} is not a JSON row ({reason}); fix or remove that line") from None
        cell = row.get("cell") if isinstance(row, dict) else None
        if not isinstance(cell, str):
            raise ValueError(f"{path}:{number} has no 'cell' key")
        if cell in rows:
            duplicates += 1
            continue
        rows[cell] = row
    return rows, duplicates
