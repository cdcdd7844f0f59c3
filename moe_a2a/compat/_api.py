"""DeepEP's small API objects the facade's two modes share: `EventOverlap` (what `async_finish=True`
returns) and `Config` (its normal mode's tuning, kept and not used)."""
from __future__ import annotations

import torch

from ..config import ceil_div


class EventOverlap:
    """DeepEP's `EventOverlap`: what `async_finish=True` returns. On a GPU it holds a CUDA event recorded
    on the stream the call was issued on, after the call's work; `current_stream_wait()` makes the
    current stream wait for it. Without an event (CPU, or `async_finish=False`: one shared instance) every
    method is a no-op.
    `with event:` waits at the end of the block, as DeepEP's."""

    def __init__(self, event: "torch.cuda.Event | None" = None, extra_tensors=None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, *exc) -> None:
        self.current_stream_wait()


# What a call without async_finish returns: an EventOverlap without an event (its methods are no-ops).
_NO_EVENT = EventOverlap()


class Config:
    """DeepEP's `Config`: the tuning of its normal (high-throughput) mode's kernels, with DeepEP's constructor
    arguments, defaults and checks (ValueError where DeepEP asserts), so engines that build one (SGLang's
    `--deepep-config`, `Buffer.get_dispatch_config`) work, and normal-mode calls take it (`config=`). The
    facade's kernels pick their own grids: the values are kept and never used. The buffer size hints are 0
    (no buffer is sized by them: the low-latency buffers are sized by their first dispatch, the normal-mode
    ones by the first normal-mode dispatch)."""

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        values = dict(num_sms=num_sms, num_max_nvl_chunked_send_tokens=num_max_nvl_chunked_send_tokens,
                      num_max_nvl_chunked_recv_tokens=num_max_nvl_chunked_recv_tokens,
                      num_max_rdma_chunked_send_tokens=num_max_rdma_chunked_send_tokens,
                      num_max_rdma_chunked_recv_tokens=num_max_rdma_chunked_recv_tokens)
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"Config: {name} must be an int, got {value!r}")
        nvl_send, nvl_recv = num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens
        rdma_send, rdma_recv = num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens
        if rdma_send > 0:  # DeepEP rounds the RDMA receive chunk up to a multiple of the send chunk
            rdma_recv = ceil_div(rdma_recv, rdma_send) * rdma_send
        if not (num_sms >= 0 and 0 < nvl_send < nvl_recv and 0 < rdma_send < rdma_recv
                and rdma_send <= rdma_recv // 2):
            raise ValueError(f"Config: DeepEP needs num_sms >= 0, 0 < num_max_nvl_chunked_send_tokens < "
                             f"num_max_nvl_chunked_recv_tokens, 0 < num_max_rdma_chunked_send_tokens <= half of "
                             f"num_max_rdma_chunked_recv_tokens (rounded up to a multiple of it); got {values}")
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens, self.num_max_nvl_chunked_recv_tokens = nvl_send, nvl_recv
        self.num_max_rdma_chunked_send_tokens, self.num_max_rdma_chunked_recv_tokens = rdma_send, rdma_recv

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP: bytes of its normal mode's NVLink buffer. Here 0: no normal-mode buffer."""
        return 0

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP: bytes of its normal mode's RDMA buffer. Here 0: no normal-mode buffer."""
        return 0

    def __repr__(self) -> str:
        return (f"Config(num_sms={self.num_sms}, "
                f"num_max_nvl_chunked_send_tokens={self.num_max_nvl_chunked_send_tokens}, "
                f"num_max_nvl_chunked_recv_tokens={self.num_max_nvl_chunked_recv_tokens}, "
                f"num_max_rdma_chunked_send_tokens={self.num_max_rdma_chunked_send_tokens}, "
                f"num_max_rdma_chunked_recv_tokens={self.num_max_rdma_chunked_recv_tokens})")
