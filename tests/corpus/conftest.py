"""The corpus's harness on sys.path, torchvision importable, and its times printed."""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for folder in (HERE, HERE / "programs"):   # harness.py, torchvision_ops.py; the programs' classes
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from torchvision_ops import declare_missing_ops  # noqa: E402

declare_missing_ops()   # at collection, before any test (tests/test_hf.py too) imports torchvision


def pytest_terminal_summary(terminalreporter):
    from harness import TIMES
    if not TIMES:
        return
    ways = ["as written", "watched", "defaults"]
    names = list(dict.fromkeys(n for n, _ in TIMES))
    width = max(22, *(len(n) + 1 for n in names))
    terminalreporter.write_sep("-", "corpus: seconds per program and way")
    terminalreporter.write_line(f"{'program':<{width}}" + "".join(f"{w:>12}" for w in ways))
    for name in names:
        terminalreporter.write_line(f"{name:<{width}}" + "".join(
            f"{TIMES[(name, w)]:>12.2f}" if (name, w) in TIMES else f"{'-':>12}" for w in ways))
    terminalreporter.write_line(f"{'total':<{width}}{sum(TIMES.values()):>12.2f}")
