"""A target split layer-wise over several devices (a model larger than one GPU)."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from dflash_flow.model.device import as_device
from dflash_flow.model.features import backbone


def layer_devices(num_layers: int, num_devices: int) -> list[int]:
    """The device index of each decoder layer: contiguous runs, balanced by layer count. When the layers
    do not divide evenly the later devices take one more, since the first also holds the embedding."""
    if num_devices < 1:
        raise ValueError("at least one device is needed")
    if num_devices > num_layers:
        raise ValueError(
            f"{num_devices} devices for {num_layers} decoder layers: every device needs at least one layer "
            f"(use at most {num_layers} devices)"
        )
    base, extra = divmod(num_layers, num_devices)
    counts = [base + (1 if d >= num_devices - extra else 0) for d in range(num_devices)]
    return [d for d, n in enumerate(counts) for _ in range(n)]


def _tied(model: nn.Module) -> bool:
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    return head is not None and embed is not None and head.weight is embed.weight


def split_device_map(model: nn.Module, devices: Sequence[str | torch.device]) -> dict[str, str]:
    """Module name -> device, in transformers' ``device_map`` form: decoder layers by
    :func:`layer_devices`; the final norm and an untied LM head on the last device; everything else (the
    embedding, rotary embedding, a tied LM head, other towers) on the first. Keys are the largest
    subtrees on one device."""
    devs = [str(as_device(d)) for d in devices]
    stack = backbone(model)
    names = {id(m): n for n, m in model.named_modules()}
    layers = list(stack.layers)
    plan = layer_devices(len(layers), len(devs))
    placed = {names[id(layer)]: devs[plan[i]] for i, layer in enumerate(layers)}
    norm = getattr(stack, "norm", None)
    if isinstance(norm, nn.Module):
        placed[names[id(norm)]] = devs[-1]
    head = model.get_output_embeddings()
    if head is not None and not _tied(model):
        placed[names[id(head)]] = devs[-1]
    rest: dict[str, str] = {}
    _fill_rest(model, "", placed, devs[0], rest)
    return {**rest, **placed}


def _fill_rest(
    module: nn.Module, prefix: str, placed: Mapping[str, str], device: str, out: dict[str, str]
) -> None:
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        if path in placed:
            continue
        if any(p.startswith(path + ".") for p in placed):
            _fill_rest(child, path + ".", placed, device, out)
        else:
            out[path] = device


class _ToDevice:
    """Forward pre-hook of every module of one run of modules on a device: moves the tensors among its
    inputs there. The inputs every layer shares (mask, rotary cos/sin, position ids) are moved once per
    run and reused by the run's other layers; the cache is per thread (concurrent callers), reset by the
    run's first module and cleared after its last."""

    def __init__(self, device: torch.device, first: nn.Module, last: nn.Module) -> None:
        self.device = device
        self.first = first
        self.last = last
        self._local = threading.local()

    def _move(self, x: Any, moved: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> Any:
        if isinstance(x, torch.Tensor):
            if x.device == self.device:
                return x
            hit = moved.get(id(x))
            if hit is not None and hit[0] is x:
                return hit[1]
            y = x.to(self.device)
            moved[id(x)] = (x, y)
            return y
        if isinstance(x, tuple):
            return tuple(self._move(v, moved) for v in x)
        if isinstance(x, list):
            return [self._move(v, moved) for v in x]
        if isinstance(x, dict):
            return {k: self._move(v, moved) for k, v in x.items()}
        return x

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if module is self.first or getattr(self._local, "moved", None) is None:
            self._local.moved = {}
        moved = self._local.moved
        # The residual stream (first argument) comes from the module before: moved, never cached.
        head = tuple(a.to(self.device) if isinstance(a, torch.Tensor) else a for a in args[:1])
        return head + self._move(args[1:], moved), self._move(kwargs, moved)

    def post(self, module: nn.Module, _args: Any, _output: Any) -> None:
        if module is self.last:
            self._local.moved = None


def place_on_devices(model: nn.Module, devices: Sequence[str | torch.device]) -> nn.Module:
    """Split ``model`` over ``devices`` by :func:`split_device_map` (each module moved straight to its
    own device, so the whole model never sits on one) and hook every module after the first device's
    run so that its inputs follow it. The map is kept as ``model.dflash_device_map``.

    Ours, not accelerate's ``dispatch_model`` (tried: same features, also on CPU with ``force_hooks``),
    for one thing it cannot: the inputs every layer shares (mask, rotary cos/sin, position ids) cross to a
    device once per run of layers there, not once per layer (``test_target_split`` counts the copies).

    The hooks are installed by position in the map, not by whether two devices differ: a split over
    ``cpu`` entries (the tests' CPU "devices") runs exactly this path, its moves being no-ops."""
    devs = [as_device(d) for d in devices]
    device_map = split_device_map(model, devs)
    for name, dev in device_map.items():
        model.get_submodule(name).to(dev)
    stack = backbone(model)
    layers = list(stack.layers)
    plan = layer_devices(len(layers), len(devs))
    runs: list[list[nn.Module]] = []
    for i, layer in enumerate(layers):
        if i and plan[i] == plan[i - 1]:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    tails = [
        m
        for m in (getattr(stack, "norm", None), model.get_output_embeddings())
        if isinstance(m, nn.Module)
    ]
    for run in runs[1:] + [[m] for m in tails]:
        hook = _ToDevice(_module_device(run[0]), run[0], run[-1])
        for module in run:
            module.register_forward_pre_hook(hook.pre, with_kwargs=True)
        run[-1].register_forward_hook(hook.post)
    model.dflash_device_map = device_map
    return model


def _module_device(module: nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    for b in module.buffers():
        return b.device
    return torch.device("cpu")
