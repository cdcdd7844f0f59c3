"""The DeepEP facade's remaining engine calls (issue 33, 3): signatures against DeepEP's, `Buffer.num_sms` /
`set_num_sms`, `Config`, `get_dispatch_config` / `get_combine_config`, `capture`, the refused calls (normal
mode, `get_local_buffer_tensor`, `use_nvfp4`, `use_logfmt`), and `dispatch_wait_recv_cost_stats` in DeepEP's
sixth place.

DeepEP's signatures below are written down from its source, not imported (DeepEP cannot be installed
here): `deep_ep/buffers/legacy.py` (class `Buffer`) and `csrc/legacy/buffer.hpp` (pybind11 `Config`, with
its argument names and defaults) at DeepEP commit dd758caf451848bd150e1046af3d0a73e5fff38d (2026-07-14,
`deep_ep.__version__` 2.1.0). The engines' calls are from vLLM's
`vllm/model_executor/layers/fused_moe/prepare_finalize/deepep_ll.py` and
`vllm/distributed/device_communicators/all2all.py`, and SGLang's
`python/sglang/srt/layers/moe/token_dispatcher/deepep.py` (docs/compat.md, "Every DeepEP call engines make").
"""
from __future__ import annotations

import inspect

import pytest
import torch

from moe_a2a import A2AConfig, LocalCluster, reference
from moe_a2a.compat import deep_ep as m
from moe_a2a.oracle import combine_problems, default_max_ulps

from ..conftest import TEST_DEVICE
from .test_deep_ep import E, H, K, T_MAX, _attempt, _inputs

# DeepEP's parameters (name, default; `inspect.Parameter.empty` for none), in order, as in its source.
_ = inspect.Parameter.empty
DEEP_EP = {
    "low_latency_dispatch": [("x", _), ("topk_idx", _), ("num_max_dispatch_tokens_per_rank", _), ("num_experts", _),
                             ("cumulative_local_expert_recv_stats", None), ("dispatch_wait_recv_cost_stats", None),
                             ("use_fp8", True), ("round_scale", False), ("use_ue8m0", False), ("async_finish", False),
                             ("return_recv_hook", False)],
    "low_latency_combine": [("x", _), ("topk_idx", _), ("topk_weights", _), ("handle", _), ("use_logfmt", False),
                            ("zero_copy", False), ("async_finish", False), ("return_recv_hook", False),
                            ("out", None), ("combine_wait_recv_cost_stats", None)],
    "get_local_buffer_tensor": [("dtype", _), ("size", None), ("offset", 0), ("use_rdma_buffer", False)],
    "get_low_latency_rdma_size_hint": [("num_max_dispatch_tokens_per_rank", _), ("hidden", _), ("num_ranks", _),
                                       ("num_experts", _)],
    "clean_low_latency_buffer": [("num_max_dispatch_tokens_per_rank", _), ("hidden", _), ("num_experts", _)],
    "get_next_low_latency_combine_buffer": [("handle", _)],
    "low_latency_update_mask_buffer": [("rank_to_mask", _), ("mask", False)],
    "low_latency_query_mask_buffer": [("mask_status", _)],
    "set_num_sms": [("new_num_sms", _)],
    "capture": [],
    "get_dispatch_config": [("num_ranks", _)],
    "get_combine_config": [("num_ranks", _)],
}
STATIC = ("set_num_sms", "capture", "get_low_latency_rdma_size_hint", "get_dispatch_config", "get_combine_config")
CONFIG = [("num_sms", 20), ("num_max_nvl_chunked_send_tokens", 6), ("num_max_nvl_chunked_recv_tokens", 256),
          ("num_max_rdma_chunked_send_tokens", 6), ("num_max_rdma_chunked_recv_tokens", 256)]


def _params(fn) -> list:
    """The positional parameters (keyword-only ones are the facade's own: they change no positional binding)."""
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()
            if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL, p.KEYWORD_ONLY)]


@pytest.mark.parametrize("name", sorted(DEEP_EP))
def test_signature_matches_deep_ep(name):
    """DeepEP's parameters in DeepEP's order with its defaults (positional callers get the same binding);
    the facade may take more keywords after them (`**kwargs`: DeepEP's hybrid-ep keywords)."""
    assert _params(getattr(m.Buffer, name)) == DEEP_EP[name]
    if name in STATIC:
        assert isinstance(inspect.getattr_static(m.Buffer, name), staticmethod), name


def test_config_num_sms_and_configs_as_deep_ep():
    assert _params(m.Config) == CONFIG
    c = m.Config()
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens,
            c.num_max_rdma_chunked_send_tokens) == (20, 6, 256, 6)
    assert c.num_max_rdma_chunked_recv_tokens == 258  # rounded up to a multiple of the send chunk, as DeepEP
    c = m.Config(num_sms=24, num_max_nvl_chunked_send_tokens=8, num_max_nvl_chunked_recv_tokens=512,
                 num_max_rdma_chunked_send_tokens=16, num_max_rdma_chunked_recv_tokens=128)  # SGLang's keywords
    assert c.num_sms == 24 and c.num_max_rdma_chunked_recv_tokens == 128
    assert c.get_nvl_buffer_size_hint(7168 * 2, 8) == 0 and c.get_rdma_buffer_size_hint(7168 * 2, 16) == 0
    for bad in (dict(num_sms=-2), dict(num_max_nvl_chunked_send_tokens=256),
                dict(num_max_rdma_chunked_send_tokens=300), dict(num_sms=2.0)):
        with pytest.raises(ValueError, match="Config"):
            m.Config(**bad)
    saved = m.Buffer.num_sms
    try:
        assert m.Buffer.num_sms == 20  # DeepEP's class attribute, read before any Buffer exists
        m.Buffer.set_num_sms(24)
        assert m.Buffer.num_sms == 24
        for cfg in (m.Buffer.get_dispatch_config(8), m.Buffer.get_combine_config(2)):
            assert isinstance(cfg, m.Config) and cfg.num_sms == 24
        for bad in (23, -2, True, 2.0):
            with pytest.raises(ValueError, match="even"):
                m.Buffer.set_num_sms(bad)
        assert m.Buffer.num_sms == 24
        with pytest.raises(ValueError, match="num_ranks"):
            m.Buffer.get_dispatch_config(0)
    finally:
        m.Buffer.num_sms = saved


def test_capture_returns_an_event_overlap():
    event = m.Buffer.capture()
    assert isinstance(event, m.EventOverlap)
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        assert event.event is None  # CPU: nothing to wait for
    event.current_stream_wait()
    with event:
        pass


def test_local_buffer_tensor_is_refused_saying_why():
    """Refused before anything is sent, the same way on every rank (no input is read): get_local_buffer_tensor
    says why. (Normal mode is served since issue 32, item 6: tests/compat/test_deep_ep_normal.py.)"""
    buf = object.__new__(m.Buffer)  # this refusal reads nothing of the instance (no process group needed)
    with pytest.raises(NotImplementedError, match="get_local_buffer_tensor: .*enable_fault_tolerance"):
        buf.get_local_buffer_tensor(dtype=torch.int8, use_rdma_buffer=True)


# ---- between processes -----------------------------------------------------------------------------------
def _engine_calls(a2a, rank):
    """DeepEP's sixth positional argument, DeepEP's wait-cost statistics left untouched, the hybrid-ep
    keywords, and refusals of one rank aborting the call on every rank; a good call after each."""
    from moe_a2a.compat import Buffer

    dev, seen, W = a2a.device, [], 2
    x, idx, w = (t.to(dev) for t in _inputs(rank, 80, T_MAX, "random"))
    recv_stats = torch.zeros(E // W, dtype=torch.int32, device=dev)
    cost = torch.full((W,), 7, dtype=torch.int64, device=dev)

    def attempt(fn):
        _attempt(fn, buf, dev, seen, (NotImplementedError,))

    def combined(recv_x, handle, **kw):
        out, _, _ = buf.low_latency_combine((2 * recv_x.float()).to(torch.bfloat16), idx, w, handle, **kw)
        buf.check()
        seen.append(out.clone())

    def good(**kw):
        recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T_MAX, E, use_fp8=False, **kw)
        combined(recv_x, handle)

    with Buffer(transport="shm", timeout_s=10.0, node_group=a2a.layout.node_size) as buf:
        # DeepEP's positional order: stats, wait-cost stats, then use_fp8 (False: recv_x is a bf16 tensor).
        recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T_MAX, E, recv_stats, cost, False)
        seen.append(isinstance(recv_x, torch.Tensor) and recv_x.dtype == torch.bfloat16)
        seen.append(torch.equal(recv_stats, count))
        combined(recv_x, handle, use_logfmt=False, combine_wait_recv_cost_stats=cost)
        seen.append(cost.tolist())  # left untouched: 7 each
        # The hybrid-ep keywords: use_nvfp4=False and x_global_scale are accepted; use_nvfp4=True on one rank
        # aborts the call on every rank.
        good(use_nvfp4=False, x_global_scale=torch.ones((), dtype=torch.float32, device=dev))
        attempt(lambda: buf.low_latency_dispatch(x, idx, T_MAX, E, use_fp8=False, use_nvfp4=rank == 1))
        good()
        bad_cost = torch.zeros(W, dtype=torch.int32 if rank == 0 else torch.int64, device=dev)
        attempt(lambda: buf.low_latency_dispatch(x, idx, T_MAX, E, None, bad_cost, False))
        good()
        # SGLang's single-batch-overlap keywords to the combine on one rank: that call aborts everywhere.
        recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T_MAX, E, use_fp8=False)
        extra = {"overlap": True} if rank == 0 else {}
        attempt(lambda: buf.low_latency_combine(recv_x, idx, w, handle, **extra))
        good()
        # Normal mode (issue 32, item 6): the layout is local; a dispatch without it is refused on every
        # rank alike, nothing sent; the next call works.
        attempt(lambda: buf.get_dispatch_layout(idx, E))
        attempt(lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w))
        attempt(lambda: buf.get_local_buffer_tensor(torch.int8, use_rdma_buffer=True))
        good()
    return seen


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_engine_calls_between_processes_positional_stats_and_refusals():
    cfg0 = A2AConfig(max_num_tokens=T_MAX, num_experts=E, experts_per_token=K, hidden_dim=H, in_dtype=torch.bfloat16)
    with LocalCluster(cfg0, world_size=2, node_size=2, transport="shm", device=TEST_DEVICE, timeout_s=60) as cl:
        got = cl.run(_engine_calls)
    for r in range(2):
        seen = got[r]
        assert len(seen) == 15, seen
        assert seen[0] is True and seen[1] is True and seen[3] == [7, 7], seen[:4]
        assert seen[11] == "ok", seen[11]
        assert seen[12].startswith("ValueError: num_tokens_per_rank: required"), seen[12]
        assert seen[13].startswith("NotImplementedError: get_local_buffer_tensor: moe_a2a's DeepEP facade has no "
                                   "single raw buffer"), seen[13]
    for i, bad_rank, what in ((5, 1, "use_nvfp4=True: NVFP4 dispatch"),
                              (7, 0, "dispatch_wait_recv_cost_stats: expected an int64 [2]"),
                              (9, 0, "unexpected arguments ['overlap']")):
        assert got[bad_rank][i].startswith(f"ValueError: {what}") and "aborted this call" in got[bad_rank][i], \
            got[bad_rank][i]
        assert got[1 - bad_rank][i].startswith("CallAborted") and f"rank {bad_rank}" in got[1 - bad_rank][i], \
            got[1 - bad_rank][i]
    cfg = A2AConfig(max_num_tokens=T_MAX, num_experts=E, experts_per_token=K, hidden_dim=H, in_dtype=torch.bfloat16,
                    expert_capacity=T_MAX * 2)
    ins = [_inputs(r, 80, T_MAX, "random") for r in range(2)]
    want = reference.dispatch(cfg, [x for x, _, _ in ins], None, [i for _, i, _ in ins])
    outs = reference.combine(cfg, [i for _, i, _ in ins], [w for _, _, w in ins],
                             [(2 * x_ref.float()).to(torch.bfloat16) for _, x_ref, _ in want])
    for r in range(2):
        for i in (2, 4, 6, 8, 10, 14):
            assert combine_problems(got[r][i].cpu(), outs[r], default_max_ulps(TEST_DEVICE)) == [], (i, r)
