"""Append-only results files, so long runs can be interrupted and resumed without losing finished work.

Each finished unit (a method × length × document of perplexity, one passkey trial, ...) is one JSON line,
flushed to disk the moment it is known. Re-opening the file skips what is done. A line cut short by a crash
is dropped on open, so the file is always a consistent prefix of the run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def record_key(record: Mapping[str, Any], key_fields: Sequence[str]) -> tuple[str, ...]:
    """The identity of a record: its ``key_fields`` values, JSON-encoded (so dicts and lists compare by value)."""
    return tuple(json.dumps(record.get(field), sort_keys=True) for field in key_fields)


class ResultStore:
    """A JSON-lines file of records, indexed by ``key_fields`` so a rerun can skip finished work."""

    def __init__(self, path: str | os.PathLike, key_fields: Sequence[str]):
        self.path = Path(path)
        self.key_fields = tuple(key_fields)
        self._records: list[dict] = []
        self._keys: set[tuple[str, ...]] = set()
        if self.path.exists():
            self._load()

    def _load(self) -> None:
        good_bytes = 0
        with open(self.path, "rb") as f:
            for raw in f:
                if not raw.endswith(b"\n"):
                    break  # a line cut short by an interruption
                try:
                    record = json.loads(raw)
                except json.JSONDecodeError:
                    break
                good_bytes += len(raw)
                self._remember(record)
        if good_bytes != self.path.stat().st_size:
            with open(self.path, "r+b") as f:
                f.truncate(good_bytes)

    def key(self, record: Mapping[str, Any]) -> tuple[str, ...]:
        return record_key(record, self.key_fields)

    def _remember(self, record: dict) -> None:
        key = self.key(record)
        if key not in self._keys:
            self._keys.add(key)
            self._records.append(record)

    def __contains__(self, record: dict) -> bool:
        return self.key(record) in self._keys

    def __len__(self) -> int:
        return len(self._records)

    def append(self, record: dict) -> None:
        """Write one finished record at once (flushed and synced); a duplicate key is ignored."""
        if record in self:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps(record, sort_keys=True) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self._remember(record)

    def records(self) -> list[dict]:
        return list(self._records)

    def by_key(self) -> dict[tuple[str, ...], dict]:
        """Every stored record under its key: what a rerun skips."""
        return {self.key(r): r for r in self._records}
