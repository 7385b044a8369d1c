"""Autotuning over spec grids: `python -m codegen tune SPEC` (make tune).

candidates -> build (a separate extension under build/tune/) -> measure (check against the
reference, then time; cached) -> select (winner per bucket, ties to the simpler) -> table
(tuned/<arch>/<spec>.yaml, which `make gen` turns into dispatch rules) -> report.
"""
