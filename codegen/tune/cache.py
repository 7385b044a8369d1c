"""Persistent measurement cache: one JSON line per measurement, keyed by a hash of the
instance name, its rendered source, the compiler, torch, arch, device and shape. Editing one
candidate changes only its key; an interrupted tune resumes from the lines already written."""
from __future__ import annotations

import fcntl
import hashlib
import json
from pathlib import Path


def key(name: str, source: str, compiler: str, torch_version: str, arch: str, device: str, shape: dict) -> str:
    text = json.dumps([name, hashlib.sha256(source.encode()).hexdigest(), compiler, torch_version, arch, device,
                       sorted(shape.items())])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class Cache:
    def __init__(self, path: Path):
        self.path = path
        self.entries: dict[str, dict] = {}
        if path.is_file():
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by an interruption
                self.entries[row["key"]] = row

    def get(self, k: str) -> dict | None:
        return self.entries.get(k)

    def put(self, k: str, value: dict) -> None:
        row = {"key": k, **value}
        self.entries[k] = row
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)  # several GPU workers append to one file
            fh.write(json.dumps(row) + "\n")
