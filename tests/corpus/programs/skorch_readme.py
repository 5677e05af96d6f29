# Shape: skorch's README example, https://github.com/skorch-dev/skorch/blob/master/README.rst
# (BSD-3-Clause, skorch-dev; read 2025). Written anew in that example's shape, not copied:
# this project keeps third-party code out of its commits. Kept from it: sklearn's
# make_classification(1000, 20, n_informative=10, random_state=0) cast to float32/int64;
# MyModule(num_units=10, nonlin=nn.ReLU()) of dense0, dropout 0.5, dense1, output and
# softmax; NeuralNetClassifier(MyModule, max_epochs=10, lr=0.1,
# iterator_train__shuffle=True); net.fit(X, y); net.predict_proba(X).
# Changed: nothing but the end: the README's Pipeline and GridSearchCV parts left out.
import numpy as np
from sklearn.datasets import make_classification
from torch import nn
from skorch import NeuralNetClassifier

X, y = make_classification(1000, 20, n_informative=10, random_state=0)
X = X.astype(np.float32)
y = y.astype(np.int64)


class MyModule(nn.Module):
    def __init__(self, num_units=10, nonlin=nn.ReLU()):
        super().__init__()

        self.dense0 = nn.Linear(20, num_units)
        self.nonlin = nonlin
        self.dropout = nn.Dropout(0.5)
        self.dense1 = nn.Linear(num_units, num_units)
        self.output = nn.Linear(num_units, 2)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, X, **kwargs):
        X = self.nonlin(self.dense0(X))
        X = self.dropout(X)
        X = self.nonlin(self.dense1(X))
        X = self.softmax(self.output(X))
        return X


net = NeuralNetClassifier(
    MyModule,
    max_epochs=10,
    lr=0.1,
    # Shuffle training data on each epoch
    iterator_train__shuffle=True,
)

net.fit(X, y)
y_proba = net.predict_proba(X)
