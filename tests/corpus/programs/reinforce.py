# Shape: pytorch/examples reinforcement_learning/reinforce.py,
# https://github.com/pytorch/examples/blob/main/reinforcement_learning/reinforce.py
# (BSD-3-Clause, pytorch/examples; read at 77f55b9). Written anew in that program's shape,
# not copied: this project keeps third-party code out of its commits. Kept from it:
# module-level argparse, environment, Policy and Adam(lr=1e-2), main() looping
# `for i_episode in count(1)`, per environment step select_action(): a forward of one
# state (batch 1) with gradients on, Categorical(probs).sample(), the log_prob kept on the
# policy, action.item(); no DataLoader; finish_episode(): discounted returns normalized,
# `-log_prob * R` summed, zero_grad, backward, step, the lists cleared; the running reward
# and the stop once it passes the environment's reward_threshold.
# Changed: gymnasium is not installed here, so CartPole-v1 is a stand-in written below:
# gymnasium's CartPole dynamics (its equations, Euler steps of 0.02 s, reward 1 a step,
# terminated when the pole passes 12 degrees or the cart 2.4), reset from a numpy
# Generator seeded once by reset(seed=...), and a time limit of 100 steps with
# reward_threshold 40 (for 500 and 475), so the loop ends after a few dozen episodes; no
# rendering (--render is parsed and left unused).
import argparse
from collections import deque
from itertools import count
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.distributions import Categorical


class CartPole:
    """The stand-in for gym.make('CartPole-v1'): gymnasium's dynamics, a shorter limit."""

    def __init__(self, max_episode_steps=100, reward_threshold=40.0):
        self.gravity, self.masscart, self.masspole, self.length = 9.8, 1.0, 0.1, 0.5
        self.total_mass = self.masspole + self.masscart
        self.polemass_length = self.masspole * self.length
        self.force_mag, self.tau = 10.0, 0.02
        self.theta_threshold_radians, self.x_threshold = 12 * 2 * np.pi / 360, 2.4
        self.spec = SimpleNamespace(max_episode_steps=max_episode_steps,
                                    reward_threshold=reward_threshold)
        self.np_random = np.random.default_rng()
        self.state, self.elapsed = None, 0

    def reset(self, seed=None):
        if seed is not None:
            self.np_random = np.random.default_rng(seed)
        self.state = self.np_random.uniform(low=-0.05, high=0.05, size=(4,))
        self.elapsed = 0
        return np.array(self.state, dtype=np.float32), {}

    def step(self, action):
        x, x_dot, theta, theta_dot = self.state
        force = self.force_mag if action == 1 else -self.force_mag
        costheta, sintheta = np.cos(theta), np.sin(theta)
        temp = (force + self.polemass_length * theta_dot ** 2 * sintheta) / self.total_mass
        thetaacc = (self.gravity * sintheta - costheta * temp) / (
            self.length * (4.0 / 3.0 - self.masspole * costheta ** 2 / self.total_mass))
        xacc = temp - self.polemass_length * thetaacc * costheta / self.total_mass
        x, x_dot = x + self.tau * x_dot, x_dot + self.tau * xacc
        theta, theta_dot = theta + self.tau * theta_dot, theta_dot + self.tau * thetaacc
        self.state = (x, x_dot, theta, theta_dot)
        self.elapsed += 1
        terminated = bool(x < -self.x_threshold or x > self.x_threshold
                          or theta < -self.theta_threshold_radians
                          or theta > self.theta_threshold_radians)
        truncated = self.elapsed >= self.spec.max_episode_steps
        return np.array(self.state, dtype=np.float32), 1.0, terminated, truncated, {}


parser = argparse.ArgumentParser(description="PyTorch REINFORCE example")
parser.add_argument("--gamma", type=float, default=0.99, metavar="G")
parser.add_argument("--seed", type=int, default=543, metavar="N")
parser.add_argument("--render", action="store_true")
parser.add_argument("--log-interval", type=int, default=10, metavar="N")
args = parser.parse_args()

env = CartPole()   # gym.make('CartPole-v1', render_mode=render_mode)
env.reset(seed=args.seed)
torch.manual_seed(args.seed)


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.affine1 = nn.Linear(4, 128)
        self.dropout = nn.Dropout(p=0.6)
        self.affine2 = nn.Linear(128, 2)
        self.saved_log_probs = []
        self.rewards = []

    def forward(self, x):
        x = self.affine1(x)
        x = self.dropout(x)
        x = F.relu(x)
        action_scores = self.affine2(x)
        return F.softmax(action_scores, dim=1)


policy = Policy()
optimizer = optim.Adam(policy.parameters(), lr=1e-2)
eps = np.finfo(np.float32).eps.item()


def select_action(state):
    state = torch.from_numpy(state).float().unsqueeze(0)
    probs = policy(state)
    m = Categorical(probs)
    action = m.sample()
    policy.saved_log_probs.append(m.log_prob(action))
    return action.item()


def finish_episode():
    R = 0
    policy_loss = []
    returns = deque()
    for r in policy.rewards[::-1]:
        R = r + args.gamma * R
        returns.appendleft(R)
    returns = torch.tensor(returns)
    returns = (returns - returns.mean()) / (returns.std() + eps)
    for log_prob, R in zip(policy.saved_log_probs, returns):
        policy_loss.append(-log_prob * R)
    optimizer.zero_grad()
    policy_loss = torch.cat(policy_loss).sum()
    policy_loss.backward()
    optimizer.step()
    del policy.rewards[:]
    del policy.saved_log_probs[:]


def main():
    running_reward = 10
    for i_episode in count(1):
        state, _ = env.reset()
        ep_reward = 0
        for t in range(1, 10000):   # don't loop forever while learning
            action = select_action(state)
            state, reward, terminated, truncated, _ = env.step(action)
            policy.rewards.append(reward)
            ep_reward += reward
            if terminated or truncated:
                break
        running_reward = 0.05 * ep_reward + (1 - 0.05) * running_reward
        finish_episode()
        if i_episode % args.log_interval == 0:
            print(f"Episode {i_episode}\tLast reward: {ep_reward:.2f}\tAverage reward: {running_reward:.2f}")
        if running_reward > env.spec.reward_threshold:
            print(f"Solved! Running reward is now {running_reward} and the last episode runs to {t} time steps!")
            break


if __name__ == "__main__":
    main()
