"""tools/gpu_suite.py: its parts cover every GPU test file once, and its summary reads the JUnit
files pytest writes (made here by running pytest on a throwaway test file), refuses parts of
different trees and files it cannot read, and names GPU test files no part ran."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_scripts import _load_script

TOOL = Path(__file__).resolve().parents[1] / "tools" / "gpu_suite.py"


@pytest.fixture(scope="module")
def suite():
    return _load_script(TOOL)


def test_parts_cover_every_gpu_test_file_once(suite):
    named = [f for files, *_ in suite.PARTS.values() for f in files]
    assert len(named) == len(set(named)), "a file in two parts"
    assert set(named) == suite.gpu_test_files(), "a GPU test file in no part, or a part naming a missing file"


def _junit(tmp_path: Path, part: str, state: str) -> Path:
    """A JUnit file written by pytest itself, as a part's run writes it."""
    tests = tmp_path / f"src_{part}"
    tests.mkdir()
    (tests / "test_fake_gpu.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert 1 == 2, 'wrong answer'\n"
        "@pytest.mark.skip(reason='no FA4')\n"
        "def test_skipped(): pass\n")
    xml = tmp_path / f"gpu_suite_{part}.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests),
                    f"--junitxml={xml}", "-o", f"junit_suite_name=gpu_suite:{part}:{state}",
                    "-o", "junit_family=xunit1"], cwd=tmp_path, capture_output=True)
    assert xml.is_file()
    return xml


def test_summary_counts_each_file_and_lists_failures_and_files_not_run(suite, tmp_path):
    xml = _junit(tmp_path, "kernels", "abc1234")
    table = suite.summarize([xml], {"test_fake_gpu.py", "test_never_gpu.py"})
    assert "GPU suite at abc1234: kernels" in table
    assert "| test_fake_gpu.py | kernels | 1 | 1 | 0 | 1 |" in table
    assert "Not run by any part: test_never_gpu.py" in table
    assert "FAILED test_fake_gpu.py::test_bad" in table and "wrong answer" in table


def test_summary_refuses_parts_of_different_trees(suite, tmp_path):
    a = _junit(tmp_path, "kernels", "abc1234")
    b = _junit(tmp_path, "graphs", "abc1234+dirty")
    with pytest.raises(SystemExit, match="different trees: kernels at abc1234, graphs at abc1234\\+dirty"):
        suite.summarize([a, b], set())


def test_summary_refuses_a_cut_or_foreign_file(suite, tmp_path):
    xml = _junit(tmp_path, "runs", "abc1234")
    cut = tmp_path / "cut.xml"
    cut.write_text(xml.read_text()[:200])
    with pytest.raises(SystemExit, match="not a JUnit file pytest wrote"):
        suite.summarize([cut], set())
    foreign = tmp_path / "foreign.xml"
    foreign.write_text(xml.read_text().replace("gpu_suite:runs:abc1234", "pytest"))
    with pytest.raises(SystemExit, match="is not 'gpu_suite:<part>:<commit>'"):
        suite.summarize([foreign], set())
