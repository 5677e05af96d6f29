# Shape: Lightning's "Lightning in 15 minutes" (LitAutoEncoder),
# https://lightning.ai/docs/pytorch/stable/starter/introduction.html (Apache-2.0,
# Lightning AI, Lightning-AI/pytorch-lightning docs; read 2025). Written anew in that
# page's shape, not copied: this project keeps third-party code out of its commits. Kept
# from it: module-level encoder and decoder nn.Sequential (784-64-3 and back); a
# LitAutoEncoder(LightningModule) taking both, its training_step flattening x, encoding,
# decoding, mse_loss against x and self.log("train_loss", loss); configure_optimizers
# returning Adam(lr=1e-3); a DataLoader with its default batch size (1); a
# Trainer(limit_train_batches=100, max_epochs=1) and trainer.fit(model=, train_dataloaders=).
# Changed: MNIST swapped for 256 seeded 1x28x28 images made in code (a TensorDataset of
# blob patterns plus noise, with labels); `import pytorch_lightning as pl` (the package
# installed; the page's `import lightning as L` is its newer name); the Trainer set for a
# quiet CPU run: accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
# enable_progress_bar=False, enable_model_summary=False.
import torch
from torch import nn, optim, utils

import pytorch_lightning as pl

# define any number of nn.Modules (or use your current ones)
encoder = nn.Sequential(nn.Linear(28 * 28, 64), nn.ReLU(), nn.Linear(64, 3))
decoder = nn.Sequential(nn.Linear(3, 64), nn.ReLU(), nn.Linear(64, 28 * 28))


# define the LightningModule
class LitAutoEncoder(pl.LightningModule):
    def __init__(self, encoder, decoder):
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder

    def training_step(self, batch, batch_idx):
        # training_step defines the train loop; it is independent of forward
        x, _ = batch
        x = x.view(x.size(0), -1)
        z = self.encoder(x)
        x_hat = self.decoder(z)
        loss = nn.functional.mse_loss(x_hat, x)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = optim.Adam(self.parameters(), lr=1e-3)
        return optimizer


# init the autoencoder
autoencoder = LitAutoEncoder(encoder, decoder)

# setup data: the stand-in for MNIST(os.getcwd(), download=True, transform=ToTensor())
gen = torch.Generator().manual_seed(0)
labels = torch.randint(0, 10, (256,), generator=gen)
patterns = (torch.rand(10, 1, 28, 28, generator=gen) > 0.7).float()
images = (0.7 * patterns[labels] + 0.3 * torch.rand(256, 1, 28, 28, generator=gen)).clamp(0, 1)
dataset = utils.data.TensorDataset(images, labels)
train_loader = utils.data.DataLoader(dataset)

# train the model
trainer = pl.Trainer(limit_train_batches=100, max_epochs=1, accelerator="cpu", devices=1,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False)
trainer.fit(model=autoencoder, train_dataloaders=train_loader)
