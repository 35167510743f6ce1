"""The rules the package's wrappers share, for what the C++ layer cannot
learn from DLPack alone: which CUDA stream to launch on (PyTorch's current
stream of the tensor's device, as a PyTorch op would, unless the caller
names one), FP8 tensors (passed as their uint8 views: DLPack carries float8
only from version 1.1 on), and tensors that take part in autograd (passed
detached: PyTorch will not export them)."""

from __future__ import annotations

import sys
from typing import Any, Optional


def _torch():
    # Only when the caller already imported PyTorch: the package never
    # imports it itself.
    return sys.modules.get("torch")


def plain(t: Any) -> Any:
    """A tensor that takes part in autograd (an nn.Linear's weight) as its
    detached view, the same memory: PyTorch refuses to export such a tensor
    through DLPack, and the kernels do not differentiate."""
    torch = _torch()
    if torch is not None and isinstance(t, torch.Tensor) and t.requires_grad:
        return t.detach()
    return t


def fp8_view(t: Any) -> Any:
    """A torch.float8_e4m3fn tensor as its uint8 view; anything else as is."""
    torch = _torch()
    if torch is not None and isinstance(t, torch.Tensor) and t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)
    return t


def stream_of(stream: Optional[Any], tensor: Any) -> int:
    """The cudaStream_t to launch on, as an integer.

    stream: None (PyTorch's current stream on the device of `tensor`, the
    call's first tensor argument, when it is a CUDA torch.Tensor, else the
    legacy default stream 0), an int (a cudaStream_t's value), or an object
    with a ``cuda_stream`` attribute (torch.cuda.Stream) or ``ptr``
    (cupy.cuda.Stream)."""
    if stream is None:
        torch = _torch()
        if torch is not None and isinstance(tensor, torch.Tensor) and tensor.is_cuda:
            return _current_raw_stream(torch, tensor.device)
        return 0
    if isinstance(stream, int):
        return stream
    for attribute in ("cuda_stream", "ptr"):
        value = getattr(stream, attribute, None)
        if isinstance(value, int):
            return value
    raise TypeError(
        f"argument 'stream': expected None, an int (cudaStream_t) or a stream object "
        f"with cuda_stream or ptr, got {type(stream).__name__}"
    )


def _current_raw_stream(torch, device) -> int:
    # PyTorch's private raw-stream getter skips building a torch.cuda.Stream
    # object per call (~4 us of host time per launch, measured on the H200
    # machine); the public call is the fallback should it go away.
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(device.index if device.index is not None else torch.cuda.current_device())
    return torch.cuda.current_stream(device).cuda_stream
