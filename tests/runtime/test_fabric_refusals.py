"""Issue 44 in the model process, in-process (no proxy started):

- item 1: a proxy that cannot take GPU buffers (here: the HmemUnsupported of a refused
  FI_OPT_CUDA_API_PERMITTED) makes every rank fall back to staged buffers with one log line, or refuse, as
  ``buffers=`` asks (`Wiring._try_nic`, the exchange faked);
- item 4: mixed nodes (another libfabric version or EFA device generation) are refused on every rank, naming
  the ranks (`bootstrap.check_same_fabric` over the exchanged addresses).
"""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from moe_a2a.proxy.engine import EngineAddress
from moe_a2a.runtime import bootstrap, wiring


def _addr(fabric: str, provider: str = "efa") -> EngineAddress:
    return EngineAddress(provider, (b"\x01",), fabric=fabric)


def test_mixed_efa_nodes_are_refused_naming_the_ranks():
    p5, p5en = "libfabric 2.1, EFA device 0xefa1", "libfabric 2.1, EFA device 0xefa2"
    table = [[_addr(p5)]] * 4 + [[_addr(p5en)]] * 3 + [[_addr(p5)]]
    with pytest.raises(ValueError, match=r"mixed nodes: .*\(ranks 0-3, 7: libfabric 2.1, EFA device 0xefa1; "
                                         r"ranks 4-6: libfabric 2.1, EFA device 0xefa2\)"):
        bootstrap.check_same_fabric(table)
    older = [[_addr(p5)], [_addr(p5)], [_addr("libfabric 1.22, EFA device 0xefa1")]]
    with pytest.raises(ValueError, match=r"ranks 0-1: .*; ranks 2: libfabric 1.22"):
        bootstrap.check_same_fabric(older)
    bootstrap.check_same_fabric([[_addr(p5), _addr(p5)]] * 8)  # alike (two proxies each): nothing to say
    bootstrap.check_same_fabric([[_addr("", "tcp;ofi_rxm")], [_addr("", "shm")]])  # nothing compared


def _wiring(monkeypatch, failing_ranks: dict[int, str], rank: int = 0):
    w = wiring.Wiring.__new__(wiring.Wiring)
    w.rank, w.group, w.transport = rank, None, "efa"
    w.device = SimpleNamespace(type="cuda")
    w.layout = SimpleNamespace(world_size=4)
    w.placement_reason, launched, released = None, [], []

    def launch(name):
        launched.append(name)
        if name == "nic" and rank in failing_ranks:
            raise RuntimeError(f"proxy of rank {rank} failed:\nHmemUnsupported: {failing_ranks[rank]}")

    monkeypatch.setattr(w, "_launch", launch)
    monkeypatch.setattr(w, "release", lambda: released.append(True))
    monkeypatch.setattr(bootstrap, "exchange", lambda group, reason: [
        (f"RuntimeError: HmemUnsupported: {failing_ranks[r]}" if r in failing_ranks else None) for r in range(4)])
    return w, launched


WHY = "fi_setopt(FI_OPT_CUDA_API_PERMITTED, false) failed: -FI_EOPNOTSUPP (Operation not supported)"


def test_a_refused_cuda_api_option_stages_on_every_rank_with_one_log_line(monkeypatch, caplog):
    for rank in (0, 2):  # the failing rank and one that registered fine: both fall back alike
        w, launched = _wiring(monkeypatch, {2: WHY}, rank)
        with caplog.at_level(logging.WARNING, logger="moe_a2a"):
            caplog.clear()
            w._try_nic(strict=False)
        assert launched == ["nic", "staged"]
        [line] = [r.getMessage() for r in caplog.records]
        assert "cannot be registered with the NIC over 'efa' (rank 2: RuntimeError: HmemUnsupported: " \
               "fi_setopt(FI_OPT_CUDA_API_PERMITTED" in line and "1 of 4 ranks failed" in line
        assert w.placement_reason in line


def test_a_refused_cuda_api_option_is_raised_when_gpu_buffers_were_asked_for(monkeypatch):
    w, launched = _wiring(monkeypatch, {2: WHY}, 0)
    with pytest.raises(RuntimeError, match=r"buffers='gpu': GPU send/recv buffers cannot be registered with the "
                                           r"NIC over 'efa' \(rank 2: .*FI_OPT_CUDA_API_PERMITTED"):
        w._try_nic(strict=True)
    assert launched == ["nic"]
