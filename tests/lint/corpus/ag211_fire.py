# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG211 fires: the model is cast to fp16 while a GradScaler is used."""
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)


model = Net().cuda().half()  # expect: AG211
net = Net()
net.to("cuda", dtype=torch.float16)  # expect: AG211
scaler = torch.amp.GradScaler("cuda")
