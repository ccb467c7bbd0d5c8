"""Train a LoRA on a diffusion model (SDXL's UNet, Flux or SD3.5) under loracc, on precomputed latents.

A training step as diffusers' DreamBooth LoRA scripts take it, without the VAE and text encoders:
the latents and text embeddings are inputs (here random tensors shaped like the real ones: a VAE
latent of the resolution, the text encoders' token and pooled embeddings). SDXL trains by
epsilon-prediction (DDPM's scaled-linear noise schedule); Flux and SD3 by flow matching (the noisy
latent (1 − σ)·x + σ·ε with σ drawn logit-normal, the target ε − x). LoRA goes where those
scripts put it (``model.add_adapter(LoraConfig(..., init_lora_weights="gaussian"))``), then
``loracc.compile(model)``. The model is a local diffusers directory (``--model-dir``: a pipeline
folder with a ``unet/`` or ``transformer/`` subfolder, or the component's own folder) or, without
one, random weights from the public config of SDXL base 1.0, FLUX.1-dev or SD3.5 Medium (``--tiny``:
the same structure at toy size, for a CPU). The adapter is saved as diffusers' training scripts
save it (``pytorch_lora_weights.safetensors``): ``pipeline.load_lora_weights(output_dir)`` reads it.

    python examples/finetune_diffusion_lora.py --model flux --tiny                 # CPU, under a minute
    python examples/finetune_diffusion_lora.py --model sdxl --batch-size 4         # GPU, 1024×1024, bf16
    python examples/finetune_diffusion_lora.py --model flux --memory-budget 30GB   # GPU, full-depth Flux-dev shape
    python examples/finetune_diffusion_lora.py --model-dir path/to/FLUX.1-dev --output-dir flux-lora
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

try:
    import diffusers  # noqa: E402
except ImportError:  # pragma: no cover - the message is the point
    raise SystemExit("this example needs diffusers: pip install 'loracc[diffusers]'") from None
from peft import LoraConfig  # noqa: E402
from peft.utils import get_peft_model_state_dict  # noqa: E402

import loracc  # noqa: E402
from common import TrainingMeter, memory_budget, pick_device  # noqa: E402

ATTENTION = ["attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0"]
JOINT = ATTENTION + ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out"]


@dataclass
class Kind:
    """A model family: its diffusers class, the pipeline whose ``save_lora_weights`` names its keys,
    the modules diffusers' DreamBooth LoRA script targets, how it trains, and its configs."""
    cls: str
    pipeline: str
    prefix: str  # the component in the pipeline and in the LoRA file's keys: "unet" / "transformer"
    targets: list
    objective: str  # "epsilon" or "flow"
    config: dict  # the public checkpoint's numbers
    tiny: dict
    text_tokens: tuple  # (real, tiny)


KINDS = {
    "sdxl": Kind(
        "UNet2DConditionModel", "StableDiffusionXLPipeline", "unet", ["to_k", "to_q", "to_v", "to_out.0"], "epsilon",
        # stabilityai/stable-diffusion-xl-base-1.0, unet/config.json
        dict(sample_size=128, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280),
             down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
             up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
             transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), cross_attention_dim=2048,
             use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
             projection_class_embeddings_input_dim=2816),
        dict(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 48),
             down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
             transformer_layers_per_block=(1, 2), attention_head_dim=(2, 4), cross_attention_dim=24, norm_num_groups=8,
             use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
             projection_class_embeddings_input_dim=6 * 8 + 20),
        (77, 7),
    ),
    "flux": Kind(
        "FluxTransformer2DModel", "FluxPipeline", "transformer",
        JOINT + ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"], "flow",
        # black-forest-labs/FLUX.1-dev, transformer/config.json
        dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
             num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
             axes_dims_rope=(16, 56, 56)),
        dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
             joint_attention_dim=24, pooled_projection_dim=20, guidance_embeds=True, axes_dims_rope=(4, 6, 6)),
        (512, 7),
    ),
    "sd3": Kind(
        "SD3Transformer2DModel", "StableDiffusion3Pipeline", "transformer", JOINT, "flow",
        # stabilityai/stable-diffusion-3.5-medium, transformer/config.json
        dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64,
             num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048,
             pos_embed_max_size=384, qk_norm="rms_norm", dual_attention_layers=tuple(range(13))),
        dict(sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=3, attention_head_dim=8,
             num_attention_heads=2, joint_attention_dim=24, caption_projection_dim=16, pooled_projection_dim=20,
             pos_embed_max_size=16, qk_norm="rms_norm", dual_attention_layers=(0,)),
        (77 + 256, 7),  # CLIP's 77 tokens and T5's 256, concatenated as the SD3 pipeline does
    ),
}
CLASSES = {kind.cls: name for name, kind in KINDS.items()}
# Per device: dtype, batch, resolution (pixels; tiny models get 48×80), steps.
DEFAULTS = {"cpu": ("float32", 2, 1024, 20), "cuda": ("bfloat16", 1, 1024, 20)}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(KINDS), default="sdxl", help="the model family (with --model-dir: read from its config)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--tiny", action="store_true", help="a toy-size model of the family's structure, random weights (CPU)")
    source.add_argument("--model-dir", help="a local diffusers directory: a pipeline's (with unet/ or transformer/) or the model's own")
    parser.add_argument("--memory-budget", help='loracc memory budget: a fraction ("0.5") or a size ("16GB"); default: the fastest plan')
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="dtype of the model and its LoRA weights")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--resolution", type=int, help="image side in pixels (the latents are 1/8 of it)")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--samples", type=int, default=16, help="how many precomputed (random) latents to cycle through")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (lora_alpha = rank, as diffusers' scripts default)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", help="save the LoRA here as pytorch_lora_weights.safetensors")
    parser.add_argument("--no-compile", action="store_true", help="train the eager diffusers + PEFT model, for comparison")
    return parser.parse_args(argv)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Parameters created inside are ``dtype`` (a random-weight model is built in bf16 directly,
    never in fp32 first: FLUX.1-dev is 24 GB in bf16)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(args, device: torch.device, dtype: torch.dtype):
    """(model, kind, name): the diffusers model on ``device`` in ``dtype``, frozen."""
    if args.model_dir:
        root, subfolder = Path(args.model_dir), None
        if (root / "model_index.json").is_file():
            subfolder = next((s for s in ("transformer", "unet") if (root / s / "config.json").is_file()), None)
            if subfolder is None:
                raise SystemExit(f"{root}: a pipeline directory without a transformer/ or unet/ config.json")
        class_name = json.loads((root / (subfolder or "") / "config.json").read_text()).get("_class_name")
        if class_name not in CLASSES:
            raise SystemExit(f"{root}: a {class_name}; this example trains {', '.join(CLASSES)}")
        kind = KINDS[CLASSES[class_name]]
        model = getattr(diffusers, kind.cls).from_pretrained(root, subfolder=subfolder, torch_dtype=dtype).to(device)
        name = str(root)
    else:
        kind = KINDS[args.model]
        with torch.device(device), default_dtype(dtype):
            model = getattr(diffusers, kind.cls)(**(kind.tiny if args.tiny else kind.config))
        name = f"{args.model}{' (tiny)' if args.tiny else ''}, random weights"
    return model.requires_grad_(False), kind, name


def precomputed(model, kind: Kind, tiny: bool, samples: int, resolution: int, device, dtype):
    """Random stand-ins for what a data-preparation pass would store: per sample, the VAE latent of
    the image and the text encoders' embeddings, shaped from the model's config."""
    c = model.config
    tokens = kind.text_tokens[1 if tiny else 0]
    side = (48, 80) if tiny else (resolution, resolution)
    h, w = side[0] // 8, side[1] // 8
    g = torch.Generator().manual_seed(1)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    if kind.objective == "epsilon":  # SDXL: CLIP-L + CLIP-G tokens, CLIP-G pooled, size/crop ids
        pooled = c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim
        time_ids = torch.tensor([side[0], side[1], 0, 0, side[0], side[1]], dtype=dtype, device=device)
        return dict(latents=rand(samples, c.in_channels, h, w), text=rand(samples, tokens, c.cross_attention_dim),
                    text_embeds=rand(samples, pooled), time_ids=time_ids.expand(samples, 6))
    if kind.cls == "FluxTransformer2DModel":  # latents packed 2×2: (h/2 · w/2) tokens of 4·16 channels
        return dict(latents=rand(samples, (h // 2) * (w // 2), c.in_channels), text=rand(samples, tokens, c.joint_attention_dim),
                    pooled=rand(samples, c.pooled_projection_dim), grid=(h // 2, w // 2))
    return dict(latents=rand(samples, c.in_channels, h, w), text=rand(samples, tokens, c.joint_attention_dim),
                pooled=rand(samples, c.pooled_projection_dim))


def training_loss(model, kind: Kind, data: dict, index: torch.Tensor, scheduler) -> torch.Tensor:
    """One batch's loss: epsilon-prediction for the UNet, flow matching for the transformers."""
    x = data["latents"][index]
    noise = torch.randn_like(x)
    batch = x.shape[0]
    if kind.objective == "epsilon":
        t = torch.randint(0, scheduler.config.num_train_timesteps, (batch,), device=x.device)
        noisy = scheduler.add_noise(x, noise, t)
        added = {"text_embeds": data["text_embeds"][index], "time_ids": data["time_ids"][index]}
        pred = model(noisy, t, encoder_hidden_states=data["text"][index], added_cond_kwargs=added).sample
        return F.mse_loss(pred.float(), noise.float())
    sigma = torch.sigmoid(torch.randn(batch, device=x.device))  # logit-normal(0, 1), SD3's default weighting
    s = sigma.view(-1, *[1] * (x.dim() - 1)).to(x.dtype)
    noisy = (1 - s) * x + s * noise
    common = dict(hidden_states=noisy, encoder_hidden_states=data["text"][index], pooled_projections=data["pooled"][index])
    if kind.cls == "FluxTransformer2DModel":
        h, w = data["grid"]
        image_ids = torch.zeros(h, w, 3, device=x.device)
        image_ids[..., 1] = torch.arange(h, device=x.device)[:, None]
        image_ids[..., 2] = torch.arange(w, device=x.device)[None, :]
        text_ids = torch.zeros(data["text"].shape[1], 3, device=x.device)
        guidance = torch.full((batch,), 3.5, device=x.device) if model.config.guidance_embeds else None
        pred = model(**common, timestep=sigma.to(x.dtype), img_ids=image_ids.view(-1, 3), txt_ids=text_ids,
                     guidance=guidance).sample  # Flux's embedding scales σ by 1000 itself
    else:
        pred = model(**common, timestep=(sigma * 1000).to(x.dtype)).sample
    return F.mse_loss(pred.float(), (noise - x).float())


def save_lora(model, kind: Kind, directory) -> Path:
    """The LoRA as diffusers' training scripts save it: PEFT's state dict through the pipeline's
    ``save_lora_weights``, with the LoRA config as metadata (so a rank ≠ alpha reloads right)."""
    getattr(diffusers, kind.pipeline).save_lora_weights(
        directory, **{f"{kind.prefix}_lora_layers": get_peft_model_state_dict(model),
                      f"{kind.prefix}_lora_adapter_metadata": model.peft_config["default"].to_dict()})
    return Path(directory) / "pytorch_lora_weights.safetensors"


def main(argv=None):
    """Run the training; returns the trained model."""
    args = parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    device = pick_device(args.device)
    dtype_name, batch_size, resolution, steps = DEFAULTS["cuda" if device.type == "cuda" else "cpu"]
    dtype = getattr(torch, args.dtype or dtype_name)
    batch_size, resolution, steps = args.batch_size or batch_size, args.resolution or resolution, args.steps or steps
    torch.manual_seed(args.seed)

    model, kind, name = build_model(args, device, dtype)
    model.add_adapter(LoraConfig(r=args.rank, lora_alpha=args.rank, init_lora_weights="gaussian", target_modules=kind.targets))
    model.train()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    data = precomputed(model, kind, args.tiny, args.samples, resolution, device, dtype)
    print(f"model: {name} ({kind.cls}), {dtype}, {frozen:,} frozen + {trainable:,} LoRA parameters; "
          f"{kind.objective} objective, batch {batch_size}, latents {tuple(data['latents'].shape[1:])} on {device}")
    if not args.no_compile:
        try:
            model = loracc.compile(model, memory_budget=memory_budget(args.memory_budget))
        except loracc.LoraccError as exc:
            raise SystemExit(f"loracc.compile: {exc}") from None
    elif args.memory_budget is not None:
        raise SystemExit("--memory-budget needs loracc: drop --no-compile")

    scheduler = diffusers.DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    meter = TrainingMeter(steps, device, "training" + (" (eager)" if args.no_compile else " (loracc)"), unit="images")
    for _ in range(steps):
        index = torch.randint(0, args.samples, (batch_size,))
        loss = training_loss(model, kind, data, index.to(device), scheduler)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        meter.step(loss.item(), batch_size)
    print(meter.summary())
    if not args.no_compile:
        report = loracc.explain(model)
        compiled = [r for r in report.regions if r.calls]
        print(f"loracc: {len(compiled)} region(s) compiled in {sum(r.compile_seconds for r in report.regions):.1f} s "
              f"(included above), {len(report.fallbacks)} fallback(s) to eager")
    if args.output_dir:
        path = save_lora(model, kind, args.output_dir)
        print(f"LoRA saved to {path} (diffusers format: pipeline.load_lora_weights({str(args.output_dir)!r}))")
    return model


if __name__ == "__main__":
    main()
