"""What the training examples share: the device to use, the --memory-budget argument, a progress bar, and the end-of-run summary."""
from __future__ import annotations

import resource
import sys
import time

import torch
from tqdm.auto import tqdm


def pick_device(name: str | None) -> torch.device:
    """``name`` if given, else the GPU when there is one, else the CPU."""
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def memory_budget(text: str | None):
    """``"0.5"`` → 0.5 (a fraction); ``"8GB"`` stays a size; ``None`` → the fastest plan."""
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        return text


def peak_memory(device: torch.device) -> str:
    """The peak memory of the run: allocated GPU memory on CUDA, the process's peak RSS on the CPU."""
    if device.type == "cuda":
        return f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB (GPU, max allocated)"
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return f"{kib / 2**20:.2f} GiB (process peak RSS)"


class TrainingMeter:
    """A progress bar over the training steps, and a summary: tokens/s (or another ``unit``), peak memory, loss.

    Call ``step(loss, tokens)`` after each optimizer step and ``summary()`` at the end. Tokens/s
    covers the whole run, first steps (and loracc's compilation) included.
    """

    def __init__(self, total_steps: int, device: torch.device, description: str = "training", unit: str = "tokens"):
        self.device, self.unit, self.tokens, self.positions, self.losses = device, unit, 0, 0, []
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        self.bar = tqdm(total=total_steps, desc=description, unit="step", file=sys.stdout, dynamic_ncols=True)
        self.start = time.perf_counter()

    def step(self, loss: float, tokens: int, positions: int | None = None) -> None:
        """``tokens``: the batch's real tokens; ``positions``: its padded size, when padding is used."""
        self.losses.append(loss)
        self.tokens += tokens
        self.positions += tokens if positions is None else positions
        self.bar.set_postfix(loss=f"{loss:.4f}")
        self.bar.update(1)

    def summary(self) -> str:
        self.bar.close()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - self.start
        tail = self.losses[-10:]
        return "\n".join([
            f"steps: {len(self.losses)} in {seconds:.1f} s",
            f"{self.unit}/s: {self.tokens / seconds:,.0f} ({self.tokens:,} {self.unit}"
            + (f"; {self.positions / seconds:,.0f}/s counting padding)" if self.positions != self.tokens else ")"),
            f"peak memory: {peak_memory(self.device)}",
            f"loss: first {self.losses[0]:.4f}, last {self.losses[-1]:.4f} (mean of last {len(tail)}: {sum(tail) / len(tail):.4f})",
        ])
