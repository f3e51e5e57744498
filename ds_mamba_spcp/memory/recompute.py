"""What a recompute in backward takes over from its forward, as ``torch.utils.checkpoint`` does.

A block run without a graph in forward and again with one in backward (``OffloadedCheckpoint``, ``tiled_block``)
must compute the same function both times. Besides the inputs, two pieces of global state decide it:

- autocast (loops enter it around the forward only): the forward's settings for the input's device type and
  the CPU are captured and re-entered around the recompute;
- the random number generators: the CPU's and the input device's are captured, and the recompute runs inside
  ``torch.random.fork_rng`` from them (the caller's generators are left as they were).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AutocastState:
    """The autocast settings of the forward: ``(device_type, enabled, dtype)`` per device type, and the
    weight-cast cache flag (shared by all device types)."""

    settings: tuple
    cache_enabled: bool

    def context(self) -> contextlib.ExitStack:
        """Enters these settings (whatever the caller's are: the backward's may be none at all)."""
        stack = contextlib.ExitStack()
        for device_type, enabled, dtype in self.settings:
            stack.enter_context(
                torch.autocast(device_type=device_type, dtype=dtype, enabled=enabled, cache_enabled=self.cache_enabled)
            )
        return stack


def autocast_state(device: torch.device) -> AutocastState:
    """The current autocast settings of ``device``'s type and of the CPU."""
    types = [device.type] if device.type != "cpu" and torch.amp.is_autocast_available(device.type) else []
    settings = tuple((t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types + ["cpu"])
    return AutocastState(settings, torch.is_autocast_cache_enabled())


@dataclass(frozen=True)
class RngState:
    """The CPU generator's state and that of ``device``'s generator (None on the CPU)."""

    device: torch.device
    cpu: torch.Tensor
    on_device: torch.Tensor | None

    def same_as(self, other: RngState) -> bool:
        """Nothing drew between the two captures (the generators only move forward)."""
        same_device = (self.on_device is None) == (other.on_device is None) and (
            self.on_device is None or torch.equal(self.on_device, other.on_device)
        )
        return same_device and torch.equal(self.cpu, other.cpu)

    @contextlib.contextmanager
    def replay(self):
        """Runs the body from these states; the caller's generators are restored after it."""
        dev = self.device
        forked = [] if self.on_device is None else [dev.index]
        with torch.random.fork_rng(devices=forked, device_type=None if dev.type == "cpu" else dev.type):
            torch.set_rng_state(self.cpu)
            if self.on_device is not None:
                torch.get_device_module(dev.type).set_rng_state(self.on_device, dev)
            yield


def rng_state(device: torch.device) -> RngState:
    """The generators a recompute on ``device`` may draw from: the CPU's, and the device's when it is not the
    CPU (the input lives there, so its runtime is initialised)."""
    if device.type == "cpu":
        return RngState(device, torch.get_rng_state(), None)
    if device.index is None:
        device = torch.device(device.type, torch.get_device_module(device.type).current_device())
    return RngState(device, torch.get_rng_state(), torch.get_device_module(device.type).get_rng_state(device))
