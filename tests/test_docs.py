"""The docs name every setting: the README's table of toggles is checked against the
declarations in config.py (the magic's help and the panel are generated from them)."""
import re
from pathlib import Path

from nbtrain.config import FIELD_NAMES, SETTINGS

README = Path(__file__).resolve().parents[1] / "README.md"


def toggles_table() -> str:
    text = README.read_text()
    section = text.split("## The toggles", 1)[1].split("\n## ", 1)[0]
    return "\n".join(line for line in section.splitlines() if line.startswith("|"))


def test_readme_table_of_toggles_names_every_setting():
    named = set(re.findall(r"`(\w+)[`=]", toggles_table()))   # `name` or `name=value`
    missing = [name for name in FIELD_NAMES if name not in named]
    assert not missing, f"README's table of toggles misses {missing}"


def test_readme_table_names_no_setting_that_does_not_exist():
    first_column = re.findall(r"^\| ([^|]+) \|", toggles_table(), flags=re.M)
    named = {n for cell in first_column for n in re.findall(r"`(\w+)`", cell)}
    assert named <= set(SETTINGS), named - set(SETTINGS)


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
