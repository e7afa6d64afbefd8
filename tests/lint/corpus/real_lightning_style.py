# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""Correct code in the style of a Lightning module and Trainer: zero findings."""
import torch
import torch.nn.functional as F


class LitModel:  # stands in for lightning.LightningModule
    def __init__(self):
        self.layer = torch.nn.Linear(32, 2)

    def log(self, name, value):
        pass

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.layer(x)
        loss = F.cross_entropy(logits, y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.layer(x), y)
        self.log("val_loss", loss.item())

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.layer.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=100)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def main(trainer_cls, datamodule):
    model = LitModel()
    trainer = trainer_cls(accelerator="gpu", devices=1, precision="bf16-mixed", max_epochs=3,
                          gradient_clip_val=1.0)
    trainer.fit(model, datamodule=datamodule)
    ckpt = torch.load("last.ckpt", map_location="cpu")
    return ckpt
