# Shape: pytorch/examples gcn/main.py, https://github.com/pytorch/examples/blob/main/gcn/main.py
# (BSD-3-Clause, pytorch/examples; read at 77f55b9). Written anew in that program's shape,
# not copied: this project keeps third-party code out of its commits. Kept from it: a
# script whose work is under `if __name__ == '__main__'`, GraphConv layers with an
# nn.Parameter kernel (xavier_normal_) and torch.spmm on a sparse normalized adjacency,
# a two-layer GCN with dropout and log_softmax, load_cora() reading cora.content and
# cora.cites with np.genfromtxt (features row-normalized by a sparse diagonal, then made
# sparse; self-loops added; D^-1/2 A D^-1/2), a random permutation split into test, val
# and train node indices, Adam with weight decay, NLLLoss on the train nodes, and
# train_iter(): one full-batch step an epoch (model(*input) on every node), then test() of
# the train and val nodes under model.eval() and torch.no_grad() with .item(), every epoch.
# Changed: the download is left out; cora/ is the harness's stand-in in Cora's layout (400
# papers, 64 words, 7 classes, 1200 citations), so the split is 100 test, 50 val, 250
# train nodes (for 1000/500/1208); 100 epochs for 200; printed every 20.
import argparse
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import Adam


class GraphConv(nn.Module):
    """H' = A_hat H W: each node's features mixed with its neighbours' (Kipf & Welling)."""

    def __init__(self, input_dim, output_dim, use_bias=False):
        super().__init__()
        self.kernel = nn.Parameter(torch.Tensor(input_dim, output_dim))
        nn.init.xavier_normal_(self.kernel)
        self.bias = None
        if use_bias:
            self.bias = nn.Parameter(torch.Tensor(output_dim))
            nn.init.zeros_(self.bias)

    def forward(self, input_tensor, adj_mat):
        support = torch.mm(input_tensor, self.kernel)
        output = torch.spmm(adj_mat, support)
        if self.bias is not None:
            output = output + self.bias
        return output


class GCN(nn.Module):
    def __init__(self, input_dim, hidden_dim, output_dim, use_bias=True, dropout_p=0.1):
        super().__init__()
        self.gc1 = GraphConv(input_dim, hidden_dim, use_bias=use_bias)
        self.gc2 = GraphConv(hidden_dim, output_dim, use_bias=use_bias)
        self.dropout = nn.Dropout(dropout_p)

    def forward(self, input_tensor, adj_mat):
        x = self.gc1(input_tensor, adj_mat)
        x = F.relu(x)
        x = self.dropout(x)
        x = self.gc2(x, adj_mat)
        return F.log_softmax(x, dim=1)


def load_cora(path="./cora", device="cpu"):
    content_tensor = np.genfromtxt(os.path.join(path, "cora.content"), dtype=np.dtype(str))
    cites_tensor = np.genfromtxt(os.path.join(path, "cora.cites"), dtype=np.int32)

    features = torch.FloatTensor(content_tensor[:, 1:-1].astype(np.int32))
    scale_vector = torch.sum(features, dim=1)
    scale_vector = 1 / scale_vector
    scale_vector[scale_vector == float("inf")] = 0
    scale_vector = torch.diag(scale_vector).to_sparse()
    features = scale_vector @ features

    classes, labels = np.unique(content_tensor[:, -1], return_inverse=True)
    labels = torch.LongTensor(labels)

    idx = content_tensor[:, 0].astype(np.int32)
    idx_map = {id: pos for pos, id in enumerate(idx)}
    edges = np.array(list(map(lambda edge: [idx_map[edge[0]], idx_map[edge[1]]], cites_tensor)),
                     dtype=np.int32)
    V, E = len(idx), edges.shape[0]
    adj_mat = torch.sparse_coo_tensor(edges.T, torch.ones(E), (V, V), dtype=torch.int64)
    adj_mat = torch.eye(V) + adj_mat   # self-loops

    degree_mat = torch.sum(adj_mat, dim=1)
    degree_mat = torch.sqrt(1 / degree_mat)
    degree_mat[degree_mat == float("inf")] = 0
    degree_mat = torch.diag(degree_mat).to_sparse()
    adj_mat = degree_mat @ adj_mat @ degree_mat   # the renormalization trick
    return features.to_sparse().to(device), labels.to(device), adj_mat.to_sparse().to(device)


def train_iter(epoch, model, optimizer, criterion, input, target, mask_train, mask_val, print_every=10):
    start_t = time.time()
    model.train()
    optimizer.zero_grad()
    output = model(*input)
    loss = criterion(output[mask_train], target[mask_train])   # the train nodes only
    loss.backward()
    optimizer.step()
    loss_train, acc_train = test(model, criterion, input, target, mask_train)
    loss_val, acc_val = test(model, criterion, input, target, mask_val)
    if epoch % print_every == 0:
        print(f"Epoch: {epoch:04d} ({(time.time() - start_t):.4f}s) loss_train: {loss_train:.4f} "
              f"acc_train: {acc_train:.4f} loss_val: {loss_val:.4f} acc_val: {acc_val:.4f}")


def test(model, criterion, input, target, mask):
    model.eval()
    with torch.no_grad():
        output = model(*input)
        output, target = output[mask], target[mask]
        loss = criterion(output, target)
        acc = (output.argmax(dim=1) == target).float().sum() / len(target)
    return loss.item(), acc.item()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="PyTorch Graph Convolutional Network")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--l2", type=float, default=5e-4)
    parser.add_argument("--dropout-p", type=float, default=0.5)
    parser.add_argument("--hidden-dim", type=int, default=16)
    parser.add_argument("--val-every", type=int, default=20)
    parser.add_argument("--include-bias", action="store_true")
    parser.add_argument("--no-accel", action="store_true")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--seed", type=int, default=42, metavar="S")
    args = parser.parse_args()
    use_accel = not args.no_accel and torch.accelerator.is_available()
    torch.manual_seed(args.seed)
    device = torch.accelerator.current_accelerator() if use_accel else torch.device("cpu")
    print(f"Using {device} device")

    print("Loading dataset...")   # cora/ written by the harness (no download)
    features, labels, adj_mat = load_cora(device=device)
    idx = torch.randperm(len(labels)).to(device)
    idx_test, idx_val, idx_train = idx[:100], idx[100:150], idx[150:]

    gcn = GCN(features.shape[1], args.hidden_dim, labels.max().item() + 1, args.include_bias,
              args.dropout_p).to(device)
    optimizer = Adam(gcn.parameters(), lr=args.lr, weight_decay=args.l2)
    criterion = nn.NLLLoss()
    for epoch in range(args.epochs):
        train_iter(epoch + 1, gcn, optimizer, criterion, (features, adj_mat), labels, idx_train,
                   idx_val, args.val_every)
        if args.dry_run:
            break
    loss_test, acc_test = test(gcn, criterion, (features, adj_mat), labels, idx_test)
    print(f"Test set results: loss {loss_test:.4f} accuracy {acc_test:.4f}")
