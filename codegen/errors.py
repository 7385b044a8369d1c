"""The one error type of the compiler: it always names where the problem is."""
from __future__ import annotations


class SpecError(Exception):
    """A spec problem, located at file:line, naming the field and what was expected.

    `make gen` prints it and exits with status 2, writing nothing.
    """

    def __init__(self, file: str, line: int | None, field: str, message: str):
        self.file = file
        self.line = line
        self.field = field
        self.message = message
        where = f"{file}:{line}" if line is not None else file
        super().__init__(f"{where}: {field}: {message}")
