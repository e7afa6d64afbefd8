# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""Correct code in the style of a transformers/accelerate custom loop: zero findings."""
import math

import torch
from torch.utils.data import DataLoader


class Trainer:
    def __init__(self, model, args, train_dataset, lr_scheduler=None):
        self.model = model
        self.args = args
        self.train_dataset = train_dataset
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
        self.lr_scheduler = lr_scheduler
        self.use_amp = args.fp16
        self.amp_dtype = torch.float16 if args.fp16 else torch.bfloat16
        self.scaler = torch.amp.GradScaler("cuda", enabled=args.fp16)

    def compute_loss(self, inputs):
        with torch.autocast("cuda", dtype=self.amp_dtype, enabled=self.use_amp):
            outputs = self.model(**inputs)
        return outputs.loss

    def training_step(self, inputs):
        self.model.train()
        loss = self.compute_loss(inputs)
        if self.args.gradient_accumulation_steps > 1:
            loss = loss / self.args.gradient_accumulation_steps
        self.scaler.scale(loss).backward()
        return loss.detach()

    def _clip(self):
        if self.args.max_grad_norm and self.args.max_grad_norm > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.max_grad_norm)

    def train(self):
        loader = DataLoader(self.train_dataset, batch_size=self.args.per_device_train_batch_size)
        tr_loss = torch.tensor(0.0)
        global_step = 0
        for epoch in range(int(math.ceil(self.args.num_train_epochs))):
            for step, inputs in enumerate(loader):
                tr_loss += self.training_step(inputs)
                if (step + 1) % self.args.gradient_accumulation_steps != 0:
                    continue
                self._clip()
                scale_before = self.scaler.get_scale()
                self.scaler.step(self.optimizer)
                self.scaler.update()
                optimizer_was_run = scale_before <= self.scaler.get_scale()
                if optimizer_was_run and self.lr_scheduler is not None:
                    self.lr_scheduler.step()
                self.model.zero_grad()
                global_step += 1
                if global_step % self.args.logging_steps == 0:
                    print({"loss": tr_loss.item() / global_step, "epoch": epoch})
        return global_step

    def save(self, output_dir):
        torch.save(self.model.state_dict(), f"{output_dir}/pytorch_model.bin")
        torch.save(self.optimizer.state_dict(), f"{output_dir}/optimizer.pt")
        torch.save(self.scaler.state_dict(), f"{output_dir}/scaler.pt")
        if self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), f"{output_dir}/scheduler.pt")

    def load(self, output_dir):
        self.optimizer.load_state_dict(torch.load(f"{output_dir}/optimizer.pt", weights_only=True))
        self.scaler.load_state_dict(torch.load(f"{output_dir}/scaler.pt", weights_only=True))


def accelerate_loop(accelerator, model, optimizer, loader, lr_scheduler):
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:
        with accelerator.accumulate(model):
            with accelerator.autocast():
                loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
