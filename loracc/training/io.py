"""Weights in and out: base weights from safetensors, PEFT adapters saved atomically and loaded back.

- ``load_base_weights(model, path)`` copies a local safetensors checkpoint (one file, or shards with
  ``model.safetensors.index.json``) into a model tensor by tensor, converting each to the dtype the
  model already has: the only extra memory is one tensor of the file, never a full fp32 copy.
  Weights stored quantized in bitsandbytes' NF4 layout (``weight``, ``weight.absmax``,
  ``weight.quant_map``, ``weight.nested_absmax``, ``weight.nested_quant_map``,
  ``weight.quant_state.bitsandbytes__nf4``) replace their linear layer by a ``loracc.quant.NF4Linear``;
  FP8 weights (float8_e4m3fn ``weight`` with a per-channel ``weight_scale`` or a 128×128-block
  ``weight_scale_inv``, as published FP8 checkpoints store them) by a ``loracc.quant.fp8.FP8Linear``
  (an ``input_scale`` is read past: activations stay in the compute dtype).
- ``save_adapter(model, directory)`` writes PEFT's format (``adapter_config.json`` +
  ``adapter_model.safetensors``) through a temporary directory swapped in at the end, so an
  interrupted save leaves the previous adapter whole.
- ``load_adapter(model, directory)`` loads a PEFT adapter into the LoRA weights a model already has
  (compiled or not), after checking that it was made for a model of this shape and LoRA config.
- ``last_complete_checkpoint(output_dir)``: the newest Trainer checkpoint that was fully written.

Every failure a user can meet (a missing, corrupt or mismatched file) raises ``LoraccError`` naming
the file and the tensor, and saying what to do.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..errors import LoraccError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# LoRA settings that change what an adapter computes: loading across a difference would be silently wrong.
ADAPTER_SETTINGS = ("r", "lora_alpha", "use_rslora", "use_dora", "fan_in_fan_out", "bias", "rank_pattern", "alpha_pattern")
SHOWN = 5  # names listed in an error before "and N more"


@dataclass
class LoadReport:
    """What ``load_base_weights`` did: tensors copied, model tensors the checkpoint lacks, and
    checkpoint tensors the model has no place for (both empty unless ``strict=False``)."""

    loaded: int = 0
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def load_base_weights(model: nn.Module, path, *, strict: bool = True) -> LoadReport:
    """Copy the base weights of a local safetensors checkpoint into ``model``, in place.

    ``path``: a ``.safetensors`` file, a ``model.safetensors.index.json``, or a directory holding
    either. ``model`` must already exist on its device in the dtype it will train in (e.g. built with
    ``AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)``); each tensor of the file is
    read, converted and copied on its own. LoRA weights are not touched, so the model may already be
    wrapped by PEFT. Checkpoint names may carry or lack the model's ``base_model_prefix``
    (``model.``/``bert.``); tied weights are filled from whichever name the file has.

    With ``strict`` (the default) a model tensor missing from the file, or a file tensor the model
    has no place for, is an error; ``strict=False`` reports them instead (e.g. a new classifier head).
    A shape mismatch is always an error. Names and shapes are checked against the files' headers
    before anything is copied, so a mismatched checkpoint leaves the model as it was.
    """
    files = _checkpoint_files(Path(path))
    root = model.get_base_model() if hasattr(model, "get_base_model") else model
    targets = _base_tensors(root)
    if any(t.is_meta for ts in targets.values() for t in ts):
        raise LoraccError(
            "load_base_weights: the model has tensors on the meta device; create it on a real device in "
            "its training dtype first, e.g. AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)"
        )
    with _open_all(files) as handles:
        file_keys = {key: handle for handle in handles for key in handle.keys()}
        fp8 = _fp8_weights(file_keys)
        quantized = _quantized_weights(file_keys) + list(fp8)
        parts = {part for key in quantized for part in _quant_parts(key, file_keys)}
        plain_keys = [k for k in file_keys if k not in parts and k not in quantized]
        rename = _key_mapping(plain_keys + list(quantized), targets, getattr(root, "base_model_prefix", ""))
        report = LoadReport(unexpected=[k for k in plain_keys + list(quantized) if rename(k) not in targets])
        plan = [(key, file_keys[key], rename(key)) for key in plain_keys if rename(key) in targets]
        # Quantized weights: read and checked against their quant state and their layer before anything changes.
        swaps = [_fp8_layer(root, key, rename(key), fp8[key], file_keys) if key in fp8 else
                 _quantized_layer(root, key, rename(key), file_keys) for key in quantized if rename(key) in targets]
        covered = {id(t) for _, _, name in plan for t in targets[name]}
        covered |= {id(t) for name in (rename(k) for k in quantized) if name in targets for t in targets[name]}
        report.missing = [n for n, ts in targets.items() if not all(id(t) in covered for t in ts)]
        if strict and (report.missing or report.unexpected):
            raise LoraccError(
                f"load_base_weights: the checkpoint at {path} does not match the model: "
                f"missing from the file: {_names(report.missing)}; in the file but not in the model: "
                f"{_names(report.unexpected)}. Check that it is the checkpoint of this architecture and config, "
                "or pass strict=False to keep the model's own values where the file has none"
            )
        for key, handle, name in plan:  # shapes from the headers, before anything is copied
            shape = list(handle.file.get_slice(key).get_shape())
            if shape != list(targets[name][0].shape):
                raise LoraccError(
                    f"load_base_weights: {key} in {handle.path} has shape {shape} but the model's {name} has "
                    f"{list(targets[name][0].shape)}: the checkpoint is for another model or config"
                )
        for parent, attr, layer in swaps:
            setattr(parent, attr, layer)
            report.loaded += 1
        for key, handle, name in plan:
            tensor = _read(handle, key)
            with torch.no_grad():
                for target in targets[name]:
                    target.copy_(tensor)
            report.loaded += 1
    return report


def _quantized_weights(file_keys) -> list[str]:
    """The checkpoint's weights stored quantized: the names ``X`` with an ``X.quant_state.bitsandbytes__*``."""
    marker = ".quant_state.bitsandbytes__"
    return [k.split(marker)[0] for k in file_keys if marker in k]


def _fp8_weights(file_keys) -> dict[str, str]:
    """The checkpoint's FP8 weights: ``X.weight`` → its scale's name (``X.weight_scale_inv``: 128×128
    blocks; ``X.weight_scale``: per channel)."""
    found = {}
    for key in file_keys:
        for suffix in (".weight_scale_inv", ".weight_scale"):
            if key.endswith(suffix) and f"{key.removesuffix(suffix)}.weight" in file_keys:
                found[f"{key.removesuffix(suffix)}.weight"] = key
    return found


def _quant_parts(key: str, file_keys) -> list[str]:
    """The tensors stored beside the quantized weight ``key`` (its quant state, or its FP8 scales)."""
    names = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
    module = key.removesuffix(".weight")
    return [f"{key}.{n}" for n in names if f"{key}.{n}" in file_keys] + [
        k for k in file_keys if k.startswith(f"{key}.quant_state.")] + [
        f"{module}.{n}" for n in ("weight_scale", "weight_scale_inv", "input_scale") if f"{module}.{n}" in file_keys]


def _fp8_layer(root: nn.Module, key: str, name: str, scale_key: str, file_keys):
    """``(parent, attribute, FP8Linear)`` for the checkpoint's FP8 ``key``, checked against its scale and layer."""
    from ..quant.fp8 import BLOCK, FP8, FP8Linear, FP8Weight, check_scale

    data, scale = _read(file_keys[key], key), _read(file_keys[scale_key], scale_key)
    if data.dtype != FP8 or data.dim() != 2:
        raise LoraccError(f"load_base_weights: {key} has a scale ({scale_key}) but is {data.dtype} of shape "
                          f"{list(data.shape)}; loracc reads FP8 weights as 2-D float8_e4m3fn")
    block = BLOCK if scale_key.endswith("_inv") else None
    check_scale(key, data, scale, block)
    parent, attr, layer = _module_of(root, name.removesuffix(".weight"))
    if not isinstance(layer, nn.Linear) or tuple(data.shape) != (layer.out_features, layer.in_features):
        raise LoraccError(f"load_base_weights: {key} has shape {list(data.shape)} but the model's {name} belongs to "
                          f"{type(layer).__name__} {getattr(layer, 'out_features', '?')}x{getattr(layer, 'in_features', '?')}: "
                          "the checkpoint is for another model or config")
    device = layer.weight.device
    compute = layer.weight.dtype if layer.weight.is_floating_point() else layer.compute_dtype
    q = FP8Weight(data.to(device), scale.float().reshape(-1, 1).to(device) if block is None else scale.float().to(device),
                  block, compute)
    return parent, attr, FP8Linear(q, layer.bias, compute).train(layer.training)


def _quantized_layer(root: nn.Module, key: str, name: str, file_keys):
    """``(parent, attribute, NF4Linear)`` for the checkpoint's quantized ``key`` (the model's ``name``),
    its tensors checked against its quant state and the layer it replaces."""
    from ..quant import NF4Linear
    from ..quant.nf4 import from_state_dict

    if key not in file_keys:
        raise LoraccError(f"load_base_weights: {key} has a quant state but no packed weight {key} in the checkpoint; "
                          "the file is incomplete")
    tensors = {k: _read(file_keys[k], k) for k in [key] + _quant_parts(key, file_keys)}
    q = from_state_dict(tensors, key)
    parent, attr, layer = _module_of(root, name.removesuffix(".weight"))
    if not isinstance(layer, (nn.Linear, NF4Linear)) or not name.endswith(".weight"):
        raise LoraccError(f"load_base_weights: {key} is stored quantized but the model's {name} belongs to a "
                          f"{type(layer).__name__}; loracc reads quantized weights of linear layers only")
    if q.shape != (layer.out_features, layer.in_features):
        raise LoraccError(f"load_base_weights: {key} is quantized with shape {list(q.shape)} but the model's {name} has "
                          f"{[layer.out_features, layer.in_features]}: the checkpoint is for another model or config")
    device = layer.weight.device
    compute = layer.weight.dtype if layer.weight.is_floating_point() else layer.compute_dtype
    for field in ("packed", "absmax", "quant_map", "nested_absmax", "nested_quant_map", "offset"):
        value = getattr(q, field)
        if value is not None:
            setattr(q, field, value.to(device))
    return parent, attr, NF4Linear(q, layer.bias, compute).train(layer.training)


def _module_of(root: nn.Module, plain: str):
    """``(parent, attribute, module)`` of the module the checkpoint calls ``plain`` (PEFT's wrappers
    skipped: a LoRA layer's frozen linear is its ``base_layer``)."""
    found = [path for path, _ in root.named_modules() if _plain_name(path) == plain]
    if found:  # a LoRA layer and its base_layer share the plain name: the base layer comes last
        parent_path, _, attr = found[-1].rpartition(".")
        return root.get_submodule(parent_path), attr, root.get_submodule(found[-1])
    raise LoraccError(f"load_base_weights: the model has no layer {plain} for the checkpoint's quantized {plain}.weight")


def save_adapter(model: nn.Module, directory, **save_kwargs) -> Path:
    """Save a PEFT model's adapter to ``directory`` in PEFT's format, atomically.

    The adapter is written by PEFT's ``save_pretrained`` into a temporary directory beside
    ``directory``, flushed to disk, and swapped in by two renames (the old adapter aside, the new
    one in): ``directory`` is never a half-written mix; between the renames it is briefly absent,
    and if the second rename fails the old adapter is put back. An existing ``directory`` must be empty or
    hold an adapter (its ``adapter_config.json``); it is replaced as a whole.
    """
    if not hasattr(model, "save_pretrained") or not hasattr(model, "peft_config"):
        raise LoraccError(
            f"save_adapter needs a PEFT model (peft.get_peft_model or PeftModel.from_pretrained), got "
            f"{type(model).__name__}; for a plain PyTorch model save the LoRA tensors with safetensors.torch.save_file"
        )
    directory = Path(directory)
    if directory.exists() and (not directory.is_dir() or (any(directory.iterdir()) and not (directory / ADAPTER_CONFIG).exists())):
        raise LoraccError(
            f"save_adapter: {directory} exists and is not an adapter directory; it would be replaced as a "
            "whole, so save the adapter into a directory of its own"
        )
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.saving-", dir=directory.parent))
    try:
        model.save_pretrained(staging, **save_kwargs)
        _flush(staging)
        _swap_in(staging, directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def load_adapter(model: nn.Module, directory, adapter_name: str = "default") -> None:
    """Load the PEFT adapter saved in ``directory`` into ``model``'s existing LoRA weights, in place.

    ``model`` is a PEFT model (compiled by loracc or not) whose adapter ``adapter_name`` has the same
    targets and LoRA settings as the saved one; the parameters stay the same objects, so a compiled
    model and an optimizer over its parameters keep working. To build a model from an adapter,
    use ``PeftModel.from_pretrained(base_model, directory, is_trainable=True)``.
    """
    from peft import PeftConfig
    from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

    directory = Path(directory)
    if not (directory / ADAPTER_CONFIG).is_file() or not (directory / ADAPTER_WEIGHTS).is_file():
        raise LoraccError(
            f"load_adapter: {directory} is not a PEFT adapter: it needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} "
            "(written by save_adapter or PEFT's save_pretrained)"
        )
    if adapter_name not in getattr(model, "peft_config", {}):
        raise LoraccError(
            f"load_adapter: the model has no adapter named {adapter_name!r}; its adapters: "
            f"{sorted(getattr(model, 'peft_config', {}))}. Wrap it with peft.get_peft_model first"
        )
    saved, mine = PeftConfig.from_pretrained(directory), model.peft_config[adapter_name]
    base = f"it was trained for {saved.base_model_name_or_path!r}" if saved.base_model_name_or_path else "check its base model"
    changed = [k for k in ADAPTER_SETTINGS if getattr(saved, k, None) != getattr(mine, k, None)]
    if changed:
        details = ", ".join(f"{k}: {getattr(saved, k, None)!r} saved, {getattr(mine, k, None)!r} here" for k in changed)
        raise LoraccError(
            f"load_adapter: the adapter in {directory} has other LoRA settings than the model ({details}); "
            "build the model from it with PeftModel.from_pretrained(base_model, directory, is_trainable=True)"
        )
    expected = get_peft_model_state_dict(model, adapter_name=adapter_name)
    with _open_all([directory / ADAPTER_WEIGHTS]) as (handle,):
        weights = {key: _read(handle, key) for key in handle.keys()}
    extra, absent = sorted(set(weights) - set(expected)), sorted(set(expected) - set(weights))
    if extra or absent:
        raise LoraccError(
            f"load_adapter: the adapter in {directory} targets other modules than the model ({base}): "
            f"in the adapter only: {_names(extra)}; in the model only: {_names(absent)}"
        )
    for key, tensor in weights.items():
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise LoraccError(
                f"load_adapter: {key} is {list(tensor.shape)} in the adapter in {directory} but "
                f"{list(expected[key].shape)} in the model: the adapter is for another base model ({base})"
            )
    set_peft_model_state_dict(model, weights, adapter_name=adapter_name)


def last_complete_checkpoint(output_dir) -> str | None:
    """The newest ``checkpoint-N`` of a Trainer ``output_dir`` that was fully written, or None.

    Trainer writes ``trainer_state.json`` last, so a checkpoint without it was interrupted; pass the
    result as ``trainer.train(resume_from_checkpoint=...)`` instead of ``True``, which takes the
    newest directory even when it is incomplete.
    """
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return None
    steps = [
        (int(m.group(1)), p) for p in output_dir.iterdir()
        if (m := re.fullmatch(r"checkpoint-(\d+)", p.name)) and (p / "trainer_state.json").is_file()
    ]
    return str(max(steps)[1]) if steps else None


def _checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint given as a file, an index or a directory."""
    if path.is_dir():
        for name in (INDEX_FILE, SINGLE_FILE):
            if (path / name).is_file():
                return _checkpoint_files(path / name)
        others = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".safetensors"))
        hint = f"; it has {', '.join(others)}: convert it to safetensors or pass the file itself" if others else ""
        raise LoraccError(f"load_base_weights: no {SINGLE_FILE} or {INDEX_FILE} in {path}{hint}")
    if not path.is_file():
        raise LoraccError(f"load_base_weights: {path} does not exist; pass a .safetensors file, an index or a directory")
    if path.name.endswith(".index.json"):
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise LoraccError(f"load_base_weights: {path} is not a safetensors index (a JSON object with a weight_map): {exc}") from exc
        shards = [path.parent / name for name in dict.fromkeys(weight_map.values())]
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise LoraccError(f"load_base_weights: {path.name} lists shards that are not in {path.parent}: {_names(missing)}; the download is incomplete")
        return shards
    if path.suffix != ".safetensors":
        raise LoraccError(f"load_base_weights: {path} is not a .safetensors file; convert the checkpoint to safetensors")
    return [path]


class _Handle:
    """An open safetensors file that remembers its path for error messages."""

    def __init__(self, path: Path, opened):
        self.path, self.file = path, opened

    def keys(self):
        return self.file.keys()


@contextlib.contextmanager
def _open_all(paths):
    """Open every file with ``safe_open``; a corrupt or truncated one is a ``LoraccError`` naming it."""
    from safetensors import safe_open

    with contextlib.ExitStack() as stack:
        handles = []
        for path in paths:
            try:
                handles.append(_Handle(path, stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))))
            except Exception as exc:
                raise LoraccError(
                    f"{path} is not a valid safetensors file ({exc}); it is corrupt or truncated: download or save it again"
                ) from exc
        yield handles


def _read(handle: _Handle, key: str) -> torch.Tensor:
    try:
        return handle.file.get_tensor(key)
    except Exception as exc:
        raise LoraccError(f"cannot read {key} from {handle.path} ({exc}); the file is corrupt or truncated: download or save it again") from exc


def _base_tensors(root: nn.Module) -> dict[str, list[torch.Tensor]]:
    """The model's base (non-LoRA) state under its original names: PEFT's wrapper segments removed."""
    targets: dict[str, list[torch.Tensor]] = {}
    for name, tensor in root.state_dict(keep_vars=True).items():
        if any(p.startswith("lora_") for p in name.split(".")):
            continue
        entry = targets.setdefault(_plain_name(name), [])
        if not any(t is tensor for t in entry):
            entry.append(tensor)
    return targets


def _plain_name(name: str) -> str:
    """``name`` without PEFT's wrapper segments (``base_layer``, ``original_module``, ``modules_to_save.<adapter>``)."""
    parts = name.split(".")
    plain, i = [], 0
    while i < len(parts):
        if parts[i] in ("base_layer", "original_module"):
            i += 1
        elif parts[i] == "modules_to_save":  # PEFT's trainable copy of a module: '<name>.modules_to_save.<adapter>'
            i += 2
        else:
            plain.append(parts[i])
            i += 1
    return ".".join(plain)


def _key_mapping(file_keys: list[str], targets: dict, prefix: str):
    """How file names become model names: as they are, or with the base-model prefix added or removed."""
    candidates = [lambda k: k]
    if prefix:
        candidates += [lambda k: f"{prefix}.{k}", lambda k: k.removeprefix(f"{prefix}.")]
    return max(candidates, key=lambda f: sum(f(k) in targets for k in file_keys))


def _names(names: list[str]) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def _flush(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb+") as f:
                os.fsync(f.fileno())


def _swap_in(staging: Path, directory: Path) -> None:
    """Rename ``staging`` to ``directory``; an old ``directory`` is moved aside first, then removed."""
    if not directory.exists():
        os.rename(staging, directory)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{directory.name}.old-", dir=directory.parent))
    os.rename(directory, old / directory.name)
    try:
        os.rename(staging, directory)
    except OSError:
        os.rename(old / directory.name, directory)
        raise
    shutil.rmtree(old, ignore_errors=True)
