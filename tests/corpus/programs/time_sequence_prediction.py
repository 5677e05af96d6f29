# Shape: pytorch/examples time_sequence_prediction/train.py (with generate_sine_wave.py),
# https://github.com/pytorch/examples/blob/main/time_sequence_prediction/train.py
# (BSD-3-Clause, pytorch/examples; read at 77f55b9). Written anew in that program's shape,
# not copied: this project keeps third-party code out of its commits. Kept from it: a
# script whose work is under `if __name__ == '__main__'`, a Sequence of two LSTMCells and
# a Linear unrolled by hand over the time steps (and `future` steps fed its own output),
# the model in float64 (`seq.double()`), the whole training set as one batch, LBFGS(lr=0.8)
# stepped with `optimizer.step(closure)` where the closure calls zero_grad, forward,
# `loss.item()` (printed) and backward and returns the loss, so each step evaluates it
# several times; after each step a prediction of `future` steps under torch.no_grad() and
# a figure of it saved.
# Changed: traindata.pt is the harness's (generate_sine_wave.py's recipe, 11 waves of 50
# points for 100 of 1000), so 8 training waves and 3 test waves; 2 steps (--steps), future
# 50, a small figure saved as png; hidden size 51 kept. torch.load(weights_only=False):
# the file is a numpy array, which torch 2.6's default refuses.
import argparse

import matplotlib
import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


class Sequence(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm1 = nn.LSTMCell(1, 51)
        self.lstm2 = nn.LSTMCell(51, 51)
        self.linear = nn.Linear(51, 1)

    def forward(self, input, future=0):
        outputs = []
        h_t = torch.zeros(input.size(0), 51, dtype=torch.double)
        c_t = torch.zeros(input.size(0), 51, dtype=torch.double)
        h_t2 = torch.zeros(input.size(0), 51, dtype=torch.double)
        c_t2 = torch.zeros(input.size(0), 51, dtype=torch.double)
        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        for _ in range(future):   # predict the future from its own output
            h_t, c_t = self.lstm1(output, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        return torch.cat(outputs, dim=1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2, help="steps to run")
    opt = parser.parse_args()
    np.random.seed(0)
    torch.manual_seed(0)
    data = torch.load("traindata.pt", weights_only=False)
    input = torch.from_numpy(data[3:, :-1])
    target = torch.from_numpy(data[3:, 1:])
    test_input = torch.from_numpy(data[:3, :-1])
    test_target = torch.from_numpy(data[:3, 1:])
    seq = Sequence()
    seq.double()
    criterion = nn.MSELoss()
    # LBFGS: the whole data set fits in one batch
    optimizer = optim.LBFGS(seq.parameters(), lr=0.8)
    for i in range(opt.steps):
        print("STEP: ", i)

        def closure():
            optimizer.zero_grad()
            out = seq(input)
            loss = criterion(out, target)
            print("loss:", loss.item())
            loss.backward()
            return loss
        optimizer.step(closure)
        with torch.no_grad():   # predict; no gradient needed
            future = 50
            pred = seq(test_input, future=future)
            loss = criterion(pred[:, :-future], test_target)
            print("test loss:", loss.item())
            y = pred.detach().numpy()
        plt.figure(figsize=(6, 2))
        plt.title("Predict future values for time sequences\n(Dashlines are predicted values)")

        def draw(yi, color):
            plt.plot(np.arange(input.size(1)), yi[:input.size(1)], color, linewidth=2.0)
            plt.plot(np.arange(input.size(1), input.size(1) + future), yi[input.size(1):],
                     color + ":", linewidth=2.0)
        draw(y[0], "r")
        draw(y[1], "g")
        draw(y[2], "b")
        plt.savefig("predict%d.png" % i)
        plt.close()
