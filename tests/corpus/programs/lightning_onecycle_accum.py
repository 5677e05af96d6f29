# Shape: Lightning's LightningModule.configure_optimizers docs (a dict of "optimizer" and
# an "lr_scheduler" config with "interval": "step", OneCycleLR's total_steps from
# self.trainer.estimated_stepping_batches) and its gradient accumulation docs
# (Trainer(accumulate_grad_batches=N)),
# https://lightning.ai/docs/pytorch/stable/common/lightning_module.html#configure-optimizers
# and https://lightning.ai/docs/pytorch/stable/common/optimization.html (Apache-2.0,
# Lightning AI, Lightning-AI/pytorch-lightning docs; read 2025). Written anew in those
# pages' shape, not copied: this project keeps third-party code out of its commits. Kept
# from them: a LightningModule with training_step returning the loss and self.log;
# configure_optimizers returning {"optimizer": SGD(momentum), "lr_scheduler":
# {"scheduler": OneCycleLR(max_lr, total_steps=self.trainer.estimated_stepping_batches),
# "interval": "step"}}; Trainer(accumulate_grad_batches=2, max_epochs=2).fit(model, loader).
# Changed: a small MLP classifier on 256 seeded 20-feature points made in code (a
# TensorDataset, batches of 16, shuffled); `import pytorch_lightning as pl`; the Trainer
# set for a quiet CPU run: accelerator="cpu", devices=1, logger=False,
# enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False.
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pytorch_lightning as pl


class LitClassifier(pl.LightningModule):
    def __init__(self, in_features=20, hidden=64, num_classes=4, max_lr=0.1):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.max_lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=self.hparams.max_lr, total_steps=self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


gen = torch.Generator().manual_seed(0)
centers = torch.randn(4, 20, generator=gen) * 2
y = torch.randint(0, 4, (256,), generator=gen)
x = centers[y] + torch.randn(256, 20, generator=gen)
train_loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)

model = LitClassifier()
trainer = pl.Trainer(max_epochs=2, accumulate_grad_batches=2, accelerator="cpu", devices=1,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False)
trainer.fit(model, train_loader)
print("steps", trainer.global_step, "lr", trainer.optimizers[0].param_groups[0]["lr"])
