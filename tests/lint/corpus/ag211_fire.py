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


def fit(loader):
    scaler = torch.amp.GradScaler("cuda")
    for x in loader:
        scaler.scale(model(x).sum()).backward()


def train(loader):
    student_model = Net()
    student_model.half()  # expect: AG211
    grad_scaler = torch.amp.GradScaler("cuda")
    for x in loader:
        grad_scaler.scale(student_model(x).sum()).backward()



def train_half_then_cuda(loader):
    teacher_model = Net().half().cuda()  # expect: AG211
    scaler = torch.amp.GradScaler("cuda")
    for x in loader:
        scaler.scale(teacher_model(x).sum()).backward()
