# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG214 through a same-file autocast helper (diffusion training style): the helper forwards
``**kwargs`` to torch.amp.autocast; a backward under the enabled region fires, one under
``enabled=False`` passed through the helper (the fp32 VAE loss) does not."""
import torch


def amp_autocast(**kwargs):
    return torch.amp.autocast("cuda", dtype=torch.float16, **kwargs)


def train_step(unet, vae, optimizer, scaler, batch, noise_scheduler):
    with amp_autocast():
        latents = vae.encode(batch["pixels"]).latent_dist.sample() * 0.18215
        noise = torch.randn_like(latents)
        noisy = noise_scheduler.add_noise(latents, noise, batch["t"])
        loss = torch.nn.functional.mse_loss(unet(noisy, batch["t"]).float(), noise.float())
        scaler.scale(loss).backward()  # expect: AG214
    with amp_autocast(enabled=False):
        recon = vae.decode(latents.detach().float()).sample
        rec_loss = torch.nn.functional.l1_loss(recon, batch["pixels"].float())
        rec_loss.backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
