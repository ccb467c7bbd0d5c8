"""Diffusion workloads of the step benchmark: SDXL's UNet and a Flux-dev-shaped transformer from
diffusers, random weights from the public configs, LoRA on the attention projections.

A step is one denoising-loss step as diffusers' LoRA training scripts run it, on inputs drawn once
from a seeded generator (every method sees the same latents, text embeddings, timesteps and
targets): the model's prediction against a random target by mean squared error in fp32
(epsilon-prediction for the UNet, flow matching's velocity for Flux; the noise schedule does not
change the cost). Throughput is images/s (``batch`` images a step); ``seq`` counts the latent
positions (and Flux's text tokens) a step attends over.
"""
from __future__ import annotations

import contextlib

ATTENTION = ["to_k", "to_q", "to_v", "to_out.0"]
JOINT_ATTENTION = ["attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
                   "attn.add_v_proj", "attn.to_add_out"]

# stabilityai/stable-diffusion-xl-base-1.0, unet/config.json; 1024x1024 images are 128x128 latents.
SDXL_UNET = dict(sample_size=128, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280),
                 down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                 up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                 transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), cross_attention_dim=2048,
                 use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
                 projection_class_embeddings_input_dim=2816)
TINY_UNET = dict(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 48),
                 down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
                 transformer_layers_per_block=(1, 2), attention_head_dim=(2, 4), cross_attention_dim=24, norm_num_groups=8,
                 use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
                 projection_class_embeddings_input_dim=6 * 8 + 20)
# black-forest-labs/FLUX.1-dev, transformer/config.json: 19 double-stream and 38 single-stream blocks.
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56))
TINY_FLUX = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
                 num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=20, guidance_embeds=True,
                 axes_dims_rope=(4, 6, 6))

CLASSES = {"unet": "UNet2DConditionModel", "flux": "FluxTransformer2DModel"}


@contextlib.contextmanager
def _default_dtype(dtype):
    """Parameters created inside are ``dtype``: the model is built in bf16 directly, never in fp32
    first (FLUX.1-dev is 24 GB in bf16)."""
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build(spec: dict, device, seed: int, rank: int):
    """The workload's diffusers model on ``device`` in its dtype, frozen, with a PEFT LoRA of
    ``rank`` (alpha = rank, Gaussian init, as diffusers' scripts) on ``spec["lora_targets"]``."""
    import diffusers
    import torch
    from peft import LoraConfig

    if spec["kind"] == "flux":
        # Every method of a Flux workload runs with SDPA's cuDNN backend off: with it, eager
        # diffusers + PEFT hit an illegal memory access, and its backward gave one Flux block an
        # input gradient 1000 times the other backends' (decision 016). loracc's graphs never take it.
        torch.backends.cuda.enable_cudnn_sdp(False)
    torch.manual_seed(seed)
    with torch.device(device), _default_dtype(getattr(torch, spec["dtype"])):
        model = getattr(diffusers, CLASSES[spec["kind"]])(**spec["config"])
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian",
                                 target_modules=spec["lora_targets"]))
    return model.train()


def inputs(spec: dict, batch: int, device, seed: int) -> dict:
    """One step's inputs and its regression ``target``, drawn from ``seed`` on the CPU."""
    import torch

    c, dtype = spec["config"], getattr(torch, spec["dtype"])
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    if spec["kind"] == "unet":
        side = spec["image_side"]
        latent = side // 8
        pooled = c["projection_class_embeddings_input_dim"] - 6 * c["addition_time_embed_dim"]
        time_ids = torch.tensor([side, side, 0, 0, side, side], dtype=dtype).expand(batch, 6).to(device)
        return dict(sample=rand(batch, c["in_channels"], latent, latent),
                    timestep=torch.randint(0, 1000, (batch,), generator=g).to(device),
                    encoder_hidden_states=rand(batch, spec["text_tokens"], c["cross_attention_dim"]),
                    added_cond_kwargs=dict(text_embeds=rand(batch, pooled), time_ids=time_ids),
                    target=rand(batch, c["out_channels"], latent, latent))
    grid = spec["image_side"] // 16  # latents at 1/8, packed 2x2: (side/16)^2 image tokens
    image_ids = torch.zeros(grid, grid, 3)
    image_ids[..., 1] = torch.arange(grid)[:, None]
    image_ids[..., 2] = torch.arange(grid)[None, :]
    return dict(hidden_states=rand(batch, grid * grid, c["in_channels"]),
                encoder_hidden_states=rand(batch, spec["text_tokens"], c["joint_attention_dim"]),
                pooled_projections=rand(batch, c["pooled_projection_dim"]),
                timestep=torch.rand(batch, generator=g).to(device, dtype),
                img_ids=image_ids.view(-1, 3).to(device), txt_ids=torch.zeros(spec["text_tokens"], 3, device=device),
                guidance=torch.full((batch,), 3.5, device=device) if c.get("guidance_embeds") else None,
                target=rand(batch, grid * grid, c["in_channels"]))


def loss(model, step_inputs: dict):
    """Mean squared error of the model's prediction against ``target``, in fp32."""
    import torch.nn.functional as F

    kwargs = {k: v for k, v in step_inputs.items() if k != "target"}
    prediction = model(**kwargs).sample
    return F.mse_loss(prediction.float(), step_inputs["target"].float())


def positions(spec: dict) -> int:
    """Latent positions a step's image has (plus Flux's text tokens): the workload's ``seq``."""
    if spec["kind"] == "unet":
        return (spec["image_side"] // 8) ** 2
    return (spec["image_side"] // 16) ** 2 + spec["text_tokens"]


def counted_flops(spec: dict, batch: int, build_fn) -> float:
    """FLOPs of one training step (forward and backward of the LoRA model, frozen weights getting no
    gradient), counted by ``torch.utils.flop_counter`` on the meta device (no memory, no compute):
    ``build_fn("meta")`` builds the model. Attention counts as its matrix products."""
    from torch.utils.flop_counter import FlopCounterMode

    model = build_fn("meta")
    step_inputs = inputs(spec, batch, "meta", 0)
    with FlopCounterMode(display=False) as counter:
        loss(model, step_inputs).backward()
    return float(counter.get_total_flops())
