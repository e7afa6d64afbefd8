# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""Correct code in the style of the torch "AMP examples" page: must give zero findings."""
import torch
from torch.amp import GradScaler, autocast


def typical(model, optimizer, loss_fn, data, epochs):
    scaler = GradScaler()
    for epoch in range(epochs):
        for input, target in data:
            optimizer.zero_grad()
            with autocast(device_type="cuda", dtype=torch.float16):
                output = model(input)
                loss = loss_fn(output, target)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()


def gradient_penalty(model, optimizer, loss_fn, data):
    scaler = GradScaler()
    for input, target in data:
        optimizer.zero_grad()
        with autocast(device_type="cuda", dtype=torch.float16):
            output = model(input)
            loss = loss_fn(output, target)
        scaled_grad_params = torch.autograd.grad(outputs=scaler.scale(loss),
                                                 inputs=model.parameters(), create_graph=True)
        inv_scale = 1.0 / scaler.get_scale()
        grad_params = [p * inv_scale for p in scaled_grad_params]
        with autocast(device_type="cuda", dtype=torch.float16):
            grad_norm = 0
            for grad in grad_params:
                grad_norm += grad.pow(2).sum()
            grad_norm = grad_norm.sqrt()
            loss = loss + grad_norm
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def multiple_models(model0, model1, optimizer0, optimizer1, loss_fn, data, epochs):
    scaler = torch.amp.GradScaler()
    for epoch in range(epochs):
        for input, target in data:
            optimizer0.zero_grad()
            optimizer1.zero_grad()
            with autocast(device_type="cuda", dtype=torch.float16):
                output0 = model0(input)
                output1 = model1(input)
                loss0 = loss_fn(2 * output0 + 3 * output1, target)
                loss1 = loss_fn(3 * output0 - 5 * output1, target)
            scaler.scale(loss0).backward(retain_graph=True)
            scaler.scale(loss1).backward()
            scaler.unscale_(optimizer0)
            scaler.step(optimizer0)
            scaler.step(optimizer1)
            scaler.update()


def accumulation(model, optimizer, loss_fn, data, epochs, iters_to_accumulate):
    scaler = GradScaler()
    for epoch in range(epochs):
        for i, (input, target) in enumerate(data):
            with autocast(device_type="cuda", dtype=torch.float16):
                output = model(input)
                loss = loss_fn(output, target)
                loss = loss / iters_to_accumulate
            scaler.scale(loss).backward()
            if (i + 1) % iters_to_accumulate == 0:
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()


class MyModel(torch.nn.Module):
    @autocast(device_type="cuda")
    def forward(self, input):
        return input


class MyMM(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a.mm(b)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return grad.mm(b.t()), a.t().mm(grad)


def cpu_bf16(model, optimizer, loss_fn, data):
    for input, target in data:
        optimizer.zero_grad()
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            output = model(input)
            loss = loss_fn(output, target)
        loss.backward()
        optimizer.step()
