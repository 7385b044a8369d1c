"""`make report` writes under build/report/ and leaves the committed results alone unless asked
(REFRESH=1): both of its steps take the same directory."""
import subprocess

from tests.conftest import ROOT


def _commands(*args):
    out = subprocess.run(["make", "-n", "report", *args], cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout


def test_report_writes_under_build_by_default():
    text = _commands()
    assert text.count("--out build/report") == 2 and "bench/results" not in text


def test_refresh_rewrites_the_committed_copy():
    assert _commands("REFRESH=1").count("--out bench/results/h100") == 2
