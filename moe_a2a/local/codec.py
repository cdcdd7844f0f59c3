"""What travels between the caller and the ranks: objects through cloudpickle, tensors of any dtype as raw bytes."""
from __future__ import annotations

import io
import pickle
import sys
from typing import Any

import cloudpickle

# torch cannot pickle every dtype through cloudpickle (float8: "UntypedStorage has no attribute
# 'dtype'"), so a tensor is written as its raw bytes + dtype + shape + device and rebuilt from them.
# Everything else (functions, lambdas, classes defined in a notebook) goes through cloudpickle as before.

def _rebuild_tensor(data: bytearray, dtype, shape: tuple, device: str, requires_grad: bool,
                    parameter: bool):
    """Inverse of `_TensorPickler.reducer_override`: a tensor from its raw (C-order) bytes."""
    import torch

    flat = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    t = flat.view(dtype).reshape(shape)
    if device != "cpu":
        t = t.to(device)
    if parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    return t.requires_grad_(requires_grad) if requires_grad else t


class _TensorPickler(cloudpickle.Pickler):
    """cloudpickle, except that a plain tensor (or `nn.Parameter`) of any dtype, wherever it sits in
    the object (lists, dicts, namedtuples, dataclasses, closures, modules), is written as raw bytes.
    The same tensor object twice is sent once (pickle's memo); two views of one storage become two
    independent copies."""

    def __init__(self, file, to_cpu: bool = False) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.to_cpu = to_cpu

    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        if (torch is not None and type(obj) in (torch.Tensor, torch.nn.Parameter)
                and obj.layout == torch.strided and not obj.is_quantized and obj.device.type != "meta"):
            device = "cpu" if self.to_cpu else str(obj.device)
            t = obj.detach().cpu().resolve_conj().resolve_neg().clone(memory_format=torch.contiguous_format)
            raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else bytearray()  # C-order bytes
            return _rebuild_tensor, (pickle.PickleBuffer(raw), obj.dtype, tuple(obj.shape), device,
                                     obj.requires_grad, type(obj) is torch.nn.Parameter)
        return super().reducer_override(obj)  # cloudpickle's (functions and classes by value)


def _dumps(obj: Any, to_cpu: bool = False) -> bytes:
    """Serialise `obj` for the other side of a rank pipe (`to_cpu`: tensors come back on the CPU)."""
    buf = io.BytesIO()
    _TensorPickler(buf, to_cpu=to_cpu).dump(obj)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    """Inverse of `_dumps`."""
    return pickle.loads(data)

