"""The notebooks' runs are stored (nbtrain.store) in a folder of the test session's own,
never in ~/.nbtrain: the kernels nbval starts inherit $NBTRAIN_HOME (as in tests/conftest.py)."""
import os
import tempfile

if "NBTRAIN_SUITE_HOME" not in os.environ:
    os.environ["NBTRAIN_HOME"] = os.environ["NBTRAIN_SUITE_HOME"] = \
        tempfile.mkdtemp(prefix="nbtrain-home-")
