"""%%fasttrain --processes N on a cell that trains: the cell as written, in N processes
(gloo on the CPU), made data-parallel by the watch in each; run as a notebook runs it
(`run_cell` in a real InteractiveShell).

The bar is data-parallel SGD: with shuffle off, two ranks at batch B give the weights of
one process at batch 2B; the notebook's own objects hold the result."""
import threading
import time

import pytest
import torch
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from nbtrain.ui import magic
from test_processes import own_children

SETUP = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
gen = torch.Generator().manual_seed(1)
X, Y = torch.randn(256, 6, generator=gen), torch.randn(256, 1, generator=gen)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 16), nn.Linear(16, 1)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))
"""

LOOP = """
for epoch in range(2):
    for x, y in loader:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
"""

# a bucket per parameter: every bucket is sent on its own, in the backward's order
ONE_PARAM_BUCKETS = "import nbtrain.watcher.buckets as b; b.FIRST_BUCKET_BYTES = b.BUCKET_BYTES = 1\n"


@pytest.fixture
def ip():
    shell = InteractiveShell.instance()
    magic.load_ipython_extension(shell)
    before = own_children()
    shell.run_cell(SETUP)
    yield shell
    magic.unload_ipython_extension(shell)
    for name in set(shell.user_ns) - set(shell.user_ns_hidden):
        if not name.startswith("__"):
            del shell.user_ns[name]
    assert own_children() <= before   # no rank left behind


def one_process(batch: int, accumulate: int = 1) -> nn.Module:
    """The same loop in this process, at `batch`, stepping every `accumulate` batches."""
    ns = {}
    exec(SETUP, ns)
    torch.manual_seed(3)
    model = ns["Net"]()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        for i, (x, y) in enumerate(DataLoader(TensorDataset(ns["X"], ns["Y"]), batch_size=batch)):
            (nn.functional.mse_loss(model(x), y) / accumulate).backward()
            if (i + 1) % accumulate == 0:
                opt.step()
                opt.zero_grad()
    return model


def same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.allclose(x, y, atol=1e-5)
               for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_an_inline_loop_on_two_processes_is_one_process_at_twice_the_batch(ip):
    ip.run_cell("torch.manual_seed(3)\nmodel = Net()\n"
                "opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)\n"
                "loader = DataLoader(TensorDataset(X, Y), batch_size=16)\n"
                "history = {'epochs': []}")
    model, opt, history = ip.user_ns["model"], ip.user_ns["opt"], ip.user_ns["history"]
    result = ip.run_cell("%%fasttrain --processes 2\n" + LOOP + "    history['epochs'].append(epoch)\n")
    assert result.error_in_exec is None
    run = ip.user_ns["run"]
    assert run.state == "finished", run.error
    assert run.step == 2 * 256 // 32 and run.summary()["samples"] == 2 * 256
    # the notebook's own objects hold the result, as if the cell had run here
    assert ip.user_ns["model"] is model and ip.user_ns["opt"] is opt
    # a dict it was given and changed in place holds rank 0's, in the notebook's object
    assert ip.user_ns["history"] is history and history == {"epochs": [0, 1]}
    assert same(model, one_process(batch=32))
    assert opt.state[next(model.parameters())]["momentum_buffer"] is not None
    assert run.resolved["processes"][0] == 2


def test_a_loop_inside_a_function_the_cell_calls_and_objects_the_cell_makes(ip):
    ip.run_cell("def train(model, opt, loader):\n"
                + "\n".join("    " + line for line in LOOP.strip().splitlines()))
    cell = ("%%fasttrain --processes 2\n"
            "torch.manual_seed(3)\nmodel = Net()\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)\n"
            "train(model, opt, DataLoader(TensorDataset(X, Y), batch_size=16))\n"
            "rank_seen = __import__('os').environ['RANK']\n")
    assert ip.run_cell(cell).error_in_exec is None
    ns = ip.user_ns
    assert ns["run"].state == "finished" and ns["run"].step == 16
    assert same(ns["model"], one_process(batch=32))
    # the optimizer that came back steps the notebook's model
    assert {id(p) for g in ns["opt"].param_groups for p in g["params"]} == \
        {id(p) for p in ns["model"].parameters()}
    assert ns["rank_seen"] == "0"   # rank 0's namespace, RANK set as torchrun sets it


def test_a_failing_rank_fails_the_cell_with_its_traceback_and_keeps_the_run(ip):
    """A cell that failed fails (Run all, nbval and papermill stop there), once every rank
    has ended; the rank's traceback, the line of the cell included, is in the error."""
    from nbtrain import TrainingError
    ip.run_cell("torch.manual_seed(3)\nmodel = Net()\n"
                "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                "loader = DataLoader(TensorDataset(X, Y), batch_size=16)")
    before = own_children()
    cell = ("%%fasttrain --processes 2\n"
            "import os\n"
            "for step, (x, y) in enumerate(loader):\n"
            "    if step == 3 and os.environ['RANK'] == '1':\n"
            "        raise ValueError('rank one broke')\n"
            "    opt.zero_grad(); nn.functional.mse_loss(model(x), y).backward(); opt.step()\n")
    error = ip.run_cell(cell).error_in_exec
    assert own_children() <= before   # every rank ended before the cell did
    run = ip.user_ns["run"]
    assert run.state == "failed" and isinstance(error, TrainingError) and error.run is run
    text = str(error)
    assert text.startswith("rank 1 of 2: Traceback (most recent call last):")
    assert "raise ValueError('rank one broke')" in text   # the cell's line, as IPython shows it
    assert "ValueError: rank one broke" in text and "_run_cell_rank" not in text
    assert text.endswith("The failed Run is in `run`.")
    assert "rank 1 of 2" in str(run.error) and "ValueError: rank one broke" in str(run.error)


def test_an_object_that_cannot_travel_is_named_before_any_process_starts(ip):
    ip.run_cell("import threading\nlock = threading.Lock()\nmodel = Net()\n"
                "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                "loader = DataLoader(TensorDataset(X, Y), batch_size=16)")
    with pytest.raises(UsageError, match=r"`lock` \(lock\) cannot be sent"):
        ip.run_cell("%%fasttrain --processes 2\nwith lock:\n" +
                    "\n".join("    " + line for line in LOOP.strip().splitlines())).raise_error()


def test_a_loop_without_a_dataloader_is_refused_not_trained_twice(ip):
    ip.run_cell("model = Net()\nopt = torch.optim.SGD(model.parameters(), lr=0.1)")
    cell = ("%%fasttrain --processes 2\n"
            "for i in range(0, 256, 32):\n"
            "    opt.zero_grad(); nn.functional.mse_loss(model(X[i:i+32]), Y[i:i+32]).backward()\n"
            "    opt.step()\n")
    before = [p.detach().clone() for p in ip.user_ns["model"].parameters()]
    ip.run_cell(cell)
    run = ip.user_ns["run"]
    assert run.state == "failed" and "comes from no DataLoader" in str(run.error)
    assert all(torch.equal(a, b) for a, b in zip(before, ip.user_ns["model"].parameters()))


def once_training(act) -> threading.Thread:
    """A thread that calls `act(run)` once the notebook's Run of the next cell (not an
    earlier test's) is past step 8."""
    from nbtrain import entry
    earlier = entry._last_run["ref"]

    def wait_and_act():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            ref = entry._last_run["ref"]
            run = ref() if ref is not earlier and ref else None
            if run is not None and run.state == "running" and run.step >= 8:
                act(run)
                return
            time.sleep(0.01)
    thread = threading.Thread(target=wait_and_act, daemon=True)
    thread.start()
    return thread


SLOW_LOOP = ("%%fasttrain --processes 2 --log-every 4\n"
             "import time\n"
             "for epoch in range(10):\n"
             "    for x, y in loader:\n"
             "        time.sleep(0.01)\n"
             "        opt.zero_grad(); nn.functional.mse_loss(model(x), y).backward(); opt.step()\n")


def test_stop_ends_every_rank_at_the_same_step(ip):
    """The notebook's Stop (run.stop(), as the Stop button calls it) while the ranks train:
    every rank ends at the same step, the Run stopped, the model as after that step."""
    ip.run_cell("torch.manual_seed(3)\nmodel = Net()\n"
                "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                "loader = DataLoader(TensorDataset(X, Y), batch_size=8)")
    once_training(lambda run: run.stop())
    assert ip.run_cell(SLOW_LOOP).error_in_exec is None   # a Stop is no error
    run = ip.user_ns["run"]
    assert run.state == "stopped", (run.state, run.error)
    assert 8 <= run.step < 10 * 16 and run.step % 4 == 0   # the ranks agree every log_every


def test_a_kernel_interrupt_stops_every_rank_at_a_step_boundary_without_an_error(ip):
    """The notebook's interrupt (a SIGINT to the kernel) is a Stop relayed to the ranks, as
    in one process: the cell ends without an error, the Run interrupted at an agreed step."""
    import os
    import signal
    ip.run_cell("torch.manual_seed(3)\nmodel = Net()\n"
                "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                "loader = DataLoader(TensorDataset(X, Y), batch_size=8)")
    once_training(lambda run: os.kill(os.getpid(), signal.SIGINT))
    assert ip.run_cell(SLOW_LOOP).error_in_exec is None
    run = ip.user_ns["run"]
    assert run.state == "interrupted", (run.state, run.error)
    assert 8 <= run.step < 10 * 16 and run.step % 4 == 0   # the ranks' state, not the start's


SCRIPT = '''
import argparse
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--out")
args = parser.parse_args()
gen = torch.Generator().manual_seed(1)
X, Y = torch.randn(256, 6, generator=gen), torch.randn(256, 1, generator=gen)
torch.manual_seed(3)
model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(2):
    for x, y in DataLoader(TensorDataset(X, Y), batch_size={batch}):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    print("epoch", epoch, "done")
torch.save(model.state_dict(), args.out)
model.load_state_dict(torch.load(args.out))
print("loaded back")
'''


def test_nbtrain_run_trains_a_script_as_written_on_two_processes(tmp_path):
    """`nbtrain run --processes 2 script.py args`: torchrun's job without the script's
    changes; its file saved once (rank 0's), the other rank's prints marked, and what a
    rank saved it can load back."""
    import subprocess
    import sys
    (tmp_path / "train.py").write_text(SCRIPT.format(batch=16))
    (tmp_path / "one.py").write_text(SCRIPT.format(batch=32))
    done = subprocess.run([sys.executable, "-m", "nbtrain", "run", "--processes", "2",
                           "train.py", "--out", "two.pt"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[rank 1] epoch 1 done" in done.stdout and "\nepoch 1 done" in done.stdout
    # rank 1 loads back what it saved, from a file of its own that is gone at its end
    assert "[rank 1] loaded back" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.py", "train.py", "two.pt"]
    subprocess.run([sys.executable, "one.py", "--out", "one.pt"], cwd=tmp_path, check=True,
                   timeout=300)
    two, one = torch.load(tmp_path / "two.pt"), torch.load(tmp_path / "one.pt")
    assert all(torch.allclose(two[k], one[k], atol=1e-5) for k in one)


LAUNCH = '''
import runpy, sys
from torchvision_ops import declare_missing_ops   # the CPU torch lacks torchvision's C++ ops
declare_missing_ops()
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


@pytest.mark.parametrize("program, args, steps", [
    ("quickstart", (), 2 * (640 // 2) // 64),          # 2 epochs, each rank 320 of 640
    ("mnist_cnn", (), 2 * (320 // 2) // 32),           # 2 epochs, each rank 160 of 320
    ("mingpt_adder", ("--trainer.max_iters=40", "--trainer.num_workers=0",
                      "--data.ndigit=1"), 40),        # an endless sampler, 40 iterations
])
def test_public_programs_run_verbatim_on_two_processes(program, args, steps, tmp_path):
    """Three of the corpus's programs, as written, through `nbtrain run --processes 2`:
    each rank takes half of every epoch (minGPT's endless sampler, read lazily)."""
    import pathlib
    import re
    import subprocess
    import sys
    corpus = pathlib.Path(__file__).parent / "corpus"
    (tmp_path / "launch.py").write_text(LAUNCH)
    env = {**__import__("os").environ, "PYTHONPATH": f"{corpus}:{corpus / 'programs'}"}
    done = subprocess.run([sys.executable, "-m", "nbtrain", "run", "--processes", "2",
                           "launch.py", str(corpus / "programs" / f"{program}.py"), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(rf"^state\s+finished$", done.stdout, re.M), done.stdout[-2000:]
    assert re.search(rf"^steps\s+{steps}$", done.stdout, re.M), done.stdout[-2000:]


def test_gradient_accumulation_on_two_processes_is_one_process_at_twice_the_batch(ip):
    """Each micro-batch's gradients are averaged as its backward runs (the average of an
    average plus the new part is the average of the sum)."""
    ip.run_cell("torch.manual_seed(3)\nmodel = Net()\n"
                "opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)\n"
                "loader = DataLoader(TensorDataset(X, Y), batch_size=8)")
    cell = ("%%fasttrain --processes 2\n" + ONE_PARAM_BUCKETS +
            "for epoch in range(2):\n"
            "    for i, (x, y) in enumerate(loader):\n"
            "        (nn.functional.mse_loss(model(x), y) / 2).backward()\n"
            "        if i % 2 == 1:\n"
            "            opt.step(); opt.zero_grad()\n")
    ip.run_cell(cell)
    assert ip.user_ns["run"].state == "finished", ip.user_ns["run"].error
    assert same(ip.user_ns["model"], one_process(batch=16, accumulate=2))


def test_hand_updates_from_autograd_grad_are_refused_not_trained_apart(ip):
    ip.run_cell("model = Net()\nloader = DataLoader(TensorDataset(X, Y), batch_size=16)")
    before = [p.detach().clone() for p in ip.user_ns["model"].parameters()]
    cell = ("%%fasttrain --processes 2\n"
            "for x, y in loader:\n"
            "    grads = torch.autograd.grad(nn.functional.mse_loss(model(x), y), list(model.parameters()))\n"
            "    with torch.no_grad():\n"
            "        for p, g in zip(model.parameters(), grads):\n"
            "            p -= 0.1 * g\n")
    ip.run_cell(cell)
    run = ip.user_ns["run"]
    assert run.state == "failed" and "torch.autograd.grad" in str(run.error)
    assert all(torch.equal(a, b) for a, b in zip(before, ip.user_ns["model"].parameters()))


def test_a_branch_that_leaves_a_gradient_none_on_one_rank_keeps_the_ranks_in_step(ip):
    """Rank 1's batches never reach the second head: its gradient is None there, zeros in
    the average; the collectives still match (rank 0's buckets are ready in the backward,
    rank 1's at its end) and both ranks end with the same weights."""
    ip.run_cell(
        "class Two(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.a, self.b = nn.Linear(6, 1), nn.Linear(6, 1)\n"
        "    def forward(self, x):\n"
        "        return self.b(x) if __import__('os').environ['RANK'] == '0' else self.a(x)\n"
        "model = Two(); opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "loader = DataLoader(TensorDataset(X, Y), batch_size=16)")
    cell = ("%%fasttrain --processes 2\n" + ONE_PARAM_BUCKETS +
            "for x, y in loader:\n"
            "    opt.zero_grad(); nn.functional.mse_loss(model(x), y).backward(); opt.step()\n")
    ip.run_cell(cell)
    run = ip.user_ns["run"]
    assert run.state == "finished", run.error
    assert run.step == 256 // 32


def test_an_evaluation_before_training_is_not_split_and_the_first_epoch_is(ip):
    ip.run_cell("torch.manual_seed(3)\nmodel = Net()\n"
                "opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)\n"
                "loader = DataLoader(TensorDataset(X, Y), batch_size=16)\n"
                "val = DataLoader(TensorDataset(X[:32], Y[:32]), batch_size=8)")
    cell = ("%%fasttrain --processes 2\n"
            "seen = []\n"
            "for epoch in range(2):\n"
            "    with torch.no_grad():\n"
            "        seen.append(sum(len(x) for x, _ in val))\n"
            "    for x, y in loader:\n"
            "        opt.zero_grad()\n"
            "        nn.functional.mse_loss(model(x), y).backward()\n"
            "        opt.step()\n")
    ip.run_cell(cell)
    assert ip.user_ns["run"].state == "finished", ip.user_ns["run"].error
    assert ip.user_ns["seen"] == [32, 32]   # every rank evaluates every sample
    assert same(ip.user_ns["model"], one_process(batch=32))


def test_a_script_that_ends_with_sys_exit_0_finished(tmp_path):
    import subprocess
    import sys
    (tmp_path / "train.py").write_text(SCRIPT.format(batch=16) + "\nimport sys\nsys.exit(0)\n")
    done = subprocess.run([sys.executable, "-m", "nbtrain", "run", "--processes", "2",
                           "train.py", "--out", "two.pt"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
