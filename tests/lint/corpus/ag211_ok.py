# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG211 look-alikes: inputs cast to half, a model halved for evaluation/export or in the branch
that has no scaler."""
import torch
import torch.nn as nn

model = nn.Linear(4, 4)


def train_step(inputs, targets):
    inputs = inputs.half()
    targets = targets.to(torch.float16)
    return inputs, targets


def evaluate(net):
    net.half()
    return net


def export(use_fp16):
    if use_fp16:
        model.half()
    return model


def setup(pure_fp16):
    if pure_fp16:
        model.half()
        return None
    else:
        return torch.amp.GradScaler("cuda")


def state_dict_in_half(net, half=False):
    if half:
        net.half()
    return net.state_dict()


def train_pure_fp16_fsdp(fsdp_model, loader):
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    fsdp_model.half()
    scaler = ShardedGradScaler()
    for x in loader:
        scaler.scale(fsdp_model(x).sum()).backward()


def train_round_trip(loader):
    # a checkpoint stored in fp16 is loaded, then the model goes straight back to fp32
    student_model = torch.nn.Linear(4, 4).half().float()
    ema_model = torch.nn.Linear(4, 4).half().to(torch.float32)
    amp_scaler = torch.amp.GradScaler("cuda")
    for x in loader:
        amp_scaler.scale(student_model(x).sum() + ema_model(x).sum()).backward()
