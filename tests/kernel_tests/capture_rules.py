"""What a CUDA graph capture forbids, enforced on any device: catches on the CPU what only breaks on a GPU.

Inside ``torch.cuda.graph`` the code may not wait for the device (``.item()``, ``.tolist()``, ``bool(t)``,
``int(t)``, ``.cpu()``: the capture aborts), may not copy host data in (``torch.tensor([...])``: the values would be
baked into the graph, or the capture aborts), and a tensor created without ``device=`` lands on the CPU and fails
at the first kernel that mixes it with CUDA tensors. On a CPU-only machine every tensor is on the CPU, so none of
these fail there; `capture_rules` turns each into a `CaptureRuleError` when project code (not torch or triton
internals) does it, so a CPU run of the captured region catches them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch
from torch.overrides import TorchFunctionMode

Tensor = torch.Tensor
# waits for the device, or moves data to the host
SYNCS = {Tensor.item, Tensor.tolist, Tensor.__bool__, Tensor.__int__, Tensor.__float__, Tensor.__index__,
         Tensor.cpu, Tensor.numpy, Tensor.nonzero, torch.nonzero, torch.masked_select, Tensor.masked_select,
         torch.unique, Tensor.unique, torch.any, torch.all}
# copies host values in
HOST_DATA = {torch.tensor, torch.as_tensor, torch.from_numpy}
# factories whose device must be given
FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.rand, torch.randn, torch.randint,
             torch.linspace, torch.eye, torch.empty_strided}


class CaptureRuleError(AssertionError):
    """Project code did something a CUDA graph capture does not allow."""


class capture_rules(TorchFunctionMode):
    """Context manager: raise `CaptureRuleError` on a host sync, a host-data copy, a device move or a factory call
    without ``device=`` made directly by code of `packages` (qualified names in `allow` are exempt)."""

    def __init__(self, packages: Iterable[str] = ("gpullama",), allow: Iterable[str] = ()):
        super().__init__()
        self.packages = tuple(packages)
        self.allow = set(allow)

    def _caller(self) -> tuple[str, str] | None:
        """(module, qualified function) of the nearest frame outside torch and this module."""
        frame = sys._getframe(2)
        while frame is not None:
            module = frame.f_globals.get("__name__", "")
            if not (module == __name__ or module == "torch" or module.startswith("torch.")):
                return module, f"{module}.{frame.f_code.co_name}"
            frame = frame.f_back
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        caller = self._caller()
        if caller is not None and caller[0].startswith(self.packages) and caller[1] not in self.allow:
            name = getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))
            where = f"in {caller[1]}"
            if func in SYNCS:
                raise CaptureRuleError(f"{name} waits for the device {where}: a CUDA graph capture aborts on it")
            if func in HOST_DATA:
                raise CaptureRuleError(f"{name} copies host data {where}: a captured graph would replay stale values")
            if func in FACTORIES and kwargs.get("device") is None:
                raise CaptureRuleError(f"{name} without device= {where}: the tensor lands on the CPU")
            if func in (Tensor.to, Tensor.cuda) and _moves_device(args[1:], kwargs):
                raise CaptureRuleError(f"{name} moves a tensor between devices {where}")
        return func(*args, **kwargs)


def _moves_device(args: tuple, kwargs: dict) -> bool:
    """Whether `Tensor.to(*args, **kwargs)` names a device (rather than only a dtype)."""
    targets = [*args, kwargs.get("device")]
    return any(isinstance(a, (str, torch.device, int)) and not isinstance(a, bool) for a in targets if a is not None)
