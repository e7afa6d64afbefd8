# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG205 look-alikes: scaler state included (literal, added later, via a trainer), weights only."""
import torch

model = torch.nn.Linear(4, 4)
optimizer = torch.optim.AdamW(model.parameters())
scaler = torch.amp.GradScaler("cuda")
lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 10)


def with_scaler(path):
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict()}, path)


def added_later(path, args):
    checkpoint = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "lr_scheduler": lr_scheduler.state_dict(),
        "args": args,
    }
    if args.amp:
        checkpoint["scaler"] = scaler.state_dict()
    torch.save(checkpoint, path)


def weights_only(path):
    torch.save(model.state_dict(), path)


def via_trainer(path, trainer):
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "trainer": trainer.state_dict()}, path)


def handed_to_helper(path, add_amp_state):
    ckpt = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    add_amp_state(ckpt)
    torch.save(ckpt, path)

