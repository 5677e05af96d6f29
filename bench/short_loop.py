"""What a watch costs a short loop, on a machine's first run: a 0.2 s loop as written,
under nt.watch(optimize=False) and under nt.watch(), whole.

    python bench/short_loop.py [--rounds 15] [--steps 20]

Each measurement is a fresh process with an empty $NBTRAIN_HOME (nothing cached: no bf16
gain, no FLOP count, no peak), which times the loop alone (imports and the data made
before the clock starts): the MNIST example's CNN (dropout) over a DataLoader of
synthetic 28x28 batches, Adam, `--steps` steps. The ways are interleaved, the order
rotating (bench/rounds.py). Printed: each way's median seconds and spread, and the paired
median ratio to the loop as written with its quartiles. Target (issue 38): at most 1.05x.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from rounds import interleaved   # noqa: E402

PROGRAM = r"""
import json, sys, time
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
way, steps = sys.argv[1], int(sys.argv[2])
import nbtrain as nt

class Net(nn.Module):   # pytorch/examples mnist/main.py's
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 32, 3, 1), nn.Conv2d(32, 64, 3, 1)
        self.dropout1, self.dropout2 = nn.Dropout(0.25), nn.Dropout(0.5)
        self.fc1, self.fc2 = nn.Linear(9216, 128), nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = torch.flatten(self.dropout1(x), 1)
        return F.log_softmax(self.fc2(self.dropout2(F.relu(self.fc1(x)))), dim=1)

torch.manual_seed(0)
loader = DataLoader(TensorDataset(torch.randn(steps * 2, 1, 28, 28), torch.randint(0, 10, (steps * 2,))),
                    batch_size=2, shuffle=True)
model = Net()
opt = torch.optim.Adam(model.parameters(), 1e-3)

def loop():
    model.train()
    for data, target in loader:
        opt.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        opt.step()

start = time.perf_counter()
if way == "as written":
    loop()
else:
    with nt.watch(optimize=way == "nt.watch()", progress=False) as run:
        loop()
print(json.dumps({"s": time.perf_counter() - start}))
"""
WAYS = ("as written", "nt.watch(optimize=False)", "nt.watch()")


def one_run(way: str, steps: int) -> float:
    with tempfile.TemporaryDirectory() as home:   # a machine's first run: nothing cached
        env = {**os.environ, "NBTRAIN_HOME": home}
        out = subprocess.run([sys.executable, "-c", PROGRAM, way, str(steps)], env=env,
                             capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["s"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    from nbtrain.machine import machine_line
    times = interleaved(list(WAYS), args.rounds, lambda way: one_run(way, args.steps))
    base = times["as written"]
    print(machine_line())
    print(f"{'way':<26}{'median s':>10}{'spread':>9}{'x as written':>14}{'quartiles':>16}")
    for way in WAYS:
        ratios = sorted(t / b for t, b in zip(times[way], base))
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        spread = (max(times[way]) - min(times[way])) / statistics.median(times[way])
        print(f"{way:<26}{statistics.median(times[way]):>10.3f}{spread:>9.0%}"
              f"{statistics.median(ratios):>13.3f}x{q[0]:>8.3f}-{q[2]:.3f}")


if __name__ == "__main__":
    main()
