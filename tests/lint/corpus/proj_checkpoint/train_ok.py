# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG205 look-alikes in project mode: the scaler is in the dict a sibling saver writes, or the
sibling builds the dict with the scaler itself."""
import torch

import utils

model = torch.nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loss_scaler = torch.amp.GradScaler("cuda")


def main(args, loader):
    for epoch in range(args.epochs):
        for x in loader:
            loss_scaler.scale(model(x).sum()).backward()
            loss_scaler.step(optimizer)
            loss_scaler.update()
        checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        checkpoint["scaler"] = loss_scaler.state_dict()
        utils.save_on_master(checkpoint, f"{args.output_dir}/checkpoint.pth")
        utils.save_model(args, epoch, model, optimizer, loss_scaler)
