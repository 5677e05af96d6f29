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
    assert "--epochs EPOCHS passes over the digits data, each run (default: 4)" in out
    assert "--repeats REPEATS runs of each case, interleaved; the table gives their median " \
        "(default: 3)" in out
    assert "--progress show a progress bar per run (default: False)" in out


def test_demo_adds_one_toggle_per_row_and_ends_at_the_defaults(capsys, monkeypatch):
    from nbtrain import demo
    monkeypatch.setattr(demo.os, "getloadavg", lambda: (99.0, 99.0, 99.0))
    configs = demo.demo_configs(nbtrain.TrainConfig())
    assert list(configs)[0] == "plain loop" and list(configs.values())[-1] == nbtrain.TrainConfig()
    changed = [{k for k, v in b.to_dict().items() if a.to_dict()[k] != v}
               for a, b in zip(list(configs.values()), list(configs.values())[1:])]
    assert changed[1] == {"num_threads"} and changed[2] == {"optimizer_impl"}
    assert changed[3] == {"amp"}
    runs = demo.run_demo(epochs=1, repeats=2)
    out = capsys.readouterr().out
    assert all(len(rs) == 2 for rs in runs.values())
    assert "+ fused optimizer" in out and "(min-max)" in out and "the machine is busy" in out
