"""`import attngen` leaves torch._dynamo unimported (it took seconds), while the functions
torch.compile must treat as constants still carry torch's mark (attngen._ops.constant_result)."""
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from attngen import _ops

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_the_mark_is_torchs():
    """mark_constant leaves exactly what torch.compiler.assume_constant_result leaves (a torch
    that marks otherwise fails here)."""
    def ours():
        return 1

    def theirs():
        return 1
    assert vars(_ops.mark_constant(ours)) == vars(torch.compiler.assume_constant_result(theirs)) != {}


def test_import_leaves_dynamo_alone():
    done = _run("""
        import sys, attngen, attngen.delta_rule
        print(sorted(m for m in sys.modules if m.startswith("torch._dynamo")))
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"import attngen imported {done.stdout.strip()}"


def test_torch_compile_takes_a_marked_function_as_a_constant():
    """Marked before torch._dynamo is imported, a function that dynamo cannot trace (it breaks
    the graph) is run once at trace time and its result taken as a constant under fullgraph."""
    done = _run("""
        import sys, torch
        from attngen._ops import constant_result
        assert "torch._dynamo" not in sys.modules

        @constant_result
        def factor() -> int:
            torch._dynamo.graph_break()
            return 3

        def unmarked() -> int:
            torch._dynamo.graph_break()
            return 3

        got = torch.compile(lambda x: x * factor(), fullgraph=True, backend="eager")(torch.ones(2))
        assert got.tolist() == [3.0, 3.0], got
        try:
            torch.compile(lambda x: x * unmarked(), fullgraph=True, backend="eager")(torch.ones(2))
        except torch._dynamo.exc.Unsupported as exc:
            print("unmarked fails:", type(exc).__name__)
    """)
    assert done.returncode == 0, done.stderr
    assert "unmarked fails" in done.stdout, done.stdout
