"""The docs say what the code does.

- The guide's table of toggles (docs/guide/toggles.md) names every setting declared in
  config.py, and no setting that does not exist (the magic's help and the panel are
  generated from the same declarations).
- Every ```python example on the README and on the pages of docs/ runs: each block in a
  fresh namespace, in a fresh temporary folder (examples that write files write there).
  A block with `# doc: not run (reason)` in it is skipped with that reason: for what a CI
  machine cannot do (a GPU, a Ray cluster, a long run, files it does not have); one with
  `# doc: needs pkg, other` skips where one of them is not installed (the frameworks). Blocks
  with IPython magics (`%load_ext`, `%%fasttrain`) are notebook cells: a page's cells run
  in order in one InteractiveShell, as a notebook runs them.
- The README's own-loop example watches every step of the loop.
"""
import re
from pathlib import Path

import pytest
from IPython.core.interactiveshell import InteractiveShell

from nbtrain.config import FIELD_NAMES, SETTINGS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TOGGLES = ROOT / "docs" / "guide" / "toggles.md"
PAGES = [README] + sorted(path for path in (ROOT / "docs").rglob("*.md")
                          if "hooks" not in path.parts)

FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
NOT_RUN = re.compile(r"^\s*# doc: not run \((.+)\)\s*$", re.M)
NEEDS = re.compile(r"^\s*# doc: needs ([\w, ]+)$", re.M)   # optional packages: skipped without


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _blocks(page: Path):
    return FENCE.findall(page.read_text())


def _is_cell(code: str) -> bool:
    """A notebook cell with an IPython magic, not plain Python."""
    return any(line.startswith("%") for line in code.splitlines())


PYTHON = [pytest.param(page, code, id=f"{_name(page)}:{n}")
          for page in PAGES for n, code in enumerate(_blocks(page), 1) if not _is_cell(code)]
CELLS = [pytest.param(page, id=_name(page))
         for page in PAGES if any(_is_cell(code) for code in _blocks(page))]


# -- the table of toggles --------------------------------------------------------------------
def toggles_table() -> str:
    text = TOGGLES.read_text()
    section = text.split("## Every setting", 1)[1].split("\n## ", 1)[0]
    return "\n".join(line for line in section.splitlines() if line.startswith("|"))


def test_the_table_of_toggles_names_every_setting():
    named = set(re.findall(r"`(\w+)[`=]", toggles_table()))   # `name` or `name=value`
    missing = [name for name in FIELD_NAMES if name not in named]
    assert not missing, f"the table of toggles in {_name(TOGGLES)} misses {missing}"


def test_the_table_of_toggles_names_no_setting_that_does_not_exist():
    first_column = re.findall(r"^\| ([^|]+) \|", toggles_table(), flags=re.M)
    named = {n for cell in first_column for n in re.findall(r"`(\w+)`", cell)}
    assert named <= set(SETTINGS), named - set(SETTINGS)


# -- every example runs ------------------------------------------------------------------------
def test_the_pages_have_examples():
    assert len(PYTHON) >= 10 and CELLS, (len(PYTHON), CELLS)   # the collection found them
    assert README in PAGES and TOGGLES in PAGES


@pytest.mark.parametrize("page, code", PYTHON)
def test_example_runs(page, code, tmp_path, monkeypatch):
    reason = NOT_RUN.search(code)
    if reason:
        pytest.skip(f"{_name(page)}: {reason.group(1)}")
    needs = NEEDS.search(code)
    for package in needs.group(1).split(", ") if needs else ():
        pytest.importorskip(package, reason=f"{_name(page)}: needs {package}")
    monkeypatch.chdir(tmp_path)
    exec(compile(code, _name(page), "exec"), {"__name__": "__doc_example__"})


@pytest.fixture
def shell():
    ip = InteractiveShell.instance()
    yield ip
    from nbtrain.ui import magic
    if "nbtrain" in ip.extension_manager.loaded:
        ip.run_line_magic("unload_ext", "nbtrain")
    magic.unload_ipython_extension(ip)
    for name in set(ip.user_ns) - set(ip.user_ns_hidden):   # what the cells defined
        if not name.startswith("__"):
            del ip.user_ns[name]


@pytest.mark.parametrize("page", CELLS)
def test_notebook_cells_run(page, shell, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for code in _blocks(page):
        if not _is_cell(code) or NOT_RUN.search(code):
            continue
        result = shell.run_cell(code)
        error = result.error_before_exec or result.error_in_exec
        if error is not None:
            raise AssertionError(f"{_name(page)}: this cell failed:\n{code}") from error
    assert "run" in shell.user_ns, "a %%fasttrain cell leaves its Run in `run`"
    assert shell.user_ns["run"].state == "finished", shell.user_ns["run"]


# -- the README's own loop -----------------------------------------------------------------------
def _example_under(heading: str) -> str:
    """The first ```python block after `heading` in the README."""
    text = README.read_text().split(heading, 1)[1]
    return text.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_readmes_own_loop_example_runs_and_watches_every_step(capsys):
    namespace = {}
    exec(compile(_example_under("## Your own loop"), "README.md", "exec"), namespace)
    run = namespace["run"]
    assert run.state == "finished" and run.step == 3 * len(namespace["loader"])
    assert "batched_fetch" in capsys.readouterr().out
