"""The command line: `nbtrain --version`, `nbtrain demo --help`."""
import pytest

import nbtrain
from nbtrain.cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"nbtrain {nbtrain.__version__}"


def test_demo_help_gives_every_options_help_and_default(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--epochs EPOCHS passes over the digits data, each run (default: 8)" in out
    assert "--no-progress hide the progress bars (default: False)" in out
