"""Who can write into (or read) a rank's memory through its engine (docs/threat-model.md).

The attack these guard against: a process of another local user that knows only the proxy's
``IP:port`` (``ss -ltn``) connected to the tcp endpoint and wrote into the rank's segment with keys 1
and 2 (they were handed out in sequence). Now keys are random 64-bit values, regions have the least
access they need (no remote reads, source-only buffers not writable), and with ``local_only`` the tcp
endpoint listens on 127.0.0.1 only.

The attacker is a separate process (``tests/proxy/_attacker.py``) using the same ctypes shim; every
test first shows the attack harness *does* work with the right key on a region that allows it (a
control), so a failing attack is the engine's protection, not a broken harness.
"""
from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_a2a.proxy import libfabric as lf
from moe_a2a.proxy.engine import (ACCESS_SOURCE, ACCESS_SOURCE_AND_TARGET, ACCESS_TARGET,
                                  TransferEngine)

from .._procnet import listening_sockets, socket_inodes
from ._providers import provider_params

ROOT = Path(__file__).resolve().parents[2]
NBYTES = 4096
FILL = 0x5A  # the target's bytes; the attacker writes 0xAA
GUESSES = (0, 1, 2, 3, 4)  # what sequential keys would have been
IMM = 0xA77AC4ED

# The attacks go through tcp, a software provider of every libfabric we run on: where it is missing the
# tests fail (fi_getinfo names it), they are not skipped. Every attacker is a process of its own (slow).


def _ip_port(eng: TransferEngine) -> tuple[str, int]:
    """The engine's tcp endpoint as IP:port (what ``ss -ltn`` shows anyone on the host)."""
    name = eng.address.names[0]
    assert struct.unpack("<H", name[:2])[0] == socket.AF_INET, name.hex()
    return socket.inet_ntoa(name[4:8]), struct.unpack(">H", name[2:4])[0]


def _attack(target: TransferEngine, op: str, ip: str, port: int, keys, length: int = 64, imm: int = IMM,
            timeout_s: float = 60.0) -> tuple[list[dict], list[str]]:
    """Run the attacker process against ``ip:port`` while progressing ``target`` (software providers
    move data only while the target polls). Returns (the attacker's results per key, errors the
    target's CQ reported meanwhile)."""
    args = [op, ip, str(port), str(NBYTES), str(length)] + ([hex(imm)] if op == "write" else [])
    args += [hex(k) for k in keys]
    proc = subprocess.Popen([sys.executable, "-m", "tests.proxy._attacker", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    errors = []
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"attacker did not finish within {timeout_s}s")
            try:
                if not target.progress():
                    time.sleep(2e-4)
            except lf.FabricError as exc:
                errors.append(str(exc))
    finally:
        if proc.poll() is None:
            proc.kill()
        out, err = proc.communicate()
    assert proc.returncode == 0, f"attacker crashed:\n{err}"
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["key"] for r in results] == list(keys), (out, err)
    return results, errors


def _filled(nbytes: int = NBYTES):
    return ctypes.create_string_buffer(bytes([FILL]) * nbytes, nbytes)


def _wrong_key(*real: int) -> int:
    while True:
        k = secrets.randbits(64)
        if k not in real:
            return k


# ------------------------------------------------------------------------------------------ (a)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_attacker_with_guessed_or_wrong_keys_cannot_write():
    """Keys 0..4 and a wrong random key, with data and as zero-length writes carrying an immediate:
    the region's bytes stay unchanged, no immediate is counted, and a legitimate peer (holding the
    key from the bootstrap) still writes afterwards."""
    with TransferEngine("tcp", timeout_s=10.0, idle_yield=True) as eng:
        buf = _filled()
        region = eng.register(ctypes.addressof(buf), NBYTES, ACCESS_SOURCE_AND_TARGET)  # like the segment
        ip, port = _ip_port(eng)
        guesses = (*GUESSES, _wrong_key(*region.keys, *eng._scratch_region.keys))
        for length in (64, 0):
            results, target_errors = _attack(eng, "write", ip, port, guesses, length=length)
            assert buf.raw == bytes([FILL]) * NBYTES, f"attacker changed the region: {results}"
            assert eng.imm_counts() == {}, f"attacker's immediates were counted: {eng.imm_counts()}"
        # The legitimate peer: the right key (it travels in the descriptor, through the bootstrap).
        [key] = region.descriptor().keys
        results, _ = _attack(eng, "write", ip, port, [key])
        assert results[0]["ok"], results
        eng.wait_imms({IMM: 1}, 10, "the legitimate peer's write")
        assert buf.raw[:64] == b"\xAA" * 64 and buf.raw[64:] == bytes([FILL]) * (NBYTES - 64)
        # And the engine's own traffic is unaffected (self loop through the same endpoint).
        src_buf = ctypes.create_string_buffer(b"\x11" * 256, 256)
        src = eng.register(ctypes.addressof(src_buf), 256, ACCESS_SOURCE)
        [me] = eng.connect([eng.address])
        eng.scatter(eng.peer_group([me], [region.descriptor()]), src, [(0, 0, 256, 1024)], 7)
        eng.wait_imms({7: 1}, 10, "self write")
        eng.wait_writes(10)
        assert buf.raw[1024:1280] == b"\x11" * 256


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_source_only_regions_reject_writes_even_with_their_key():
    """A send buffer (ACCESS_SOURCE: FI_WRITE only) cannot be written by a peer that knows its key;
    neither can the engine's scratch buffer. Control: a writable region accepts the same write."""
    with TransferEngine("tcp", timeout_s=10.0, idle_yield=True) as eng:
        send_buf, recv_buf = _filled(), _filled()
        send = eng.register(ctypes.addressof(send_buf), NBYTES, ACCESS_SOURCE)
        recv = eng.register(ctypes.addressof(recv_buf), NBYTES, ACCESS_TARGET)
        ip, port = _ip_port(eng)
        _attack(eng, "write", ip, port, [send.keys[0], eng._scratch_region.keys[0]])
        assert send_buf.raw == bytes([FILL]) * NBYTES
        assert eng._scratch.raw == bytes(64)
        assert eng.imm_counts() == {}
        with pytest.raises(ValueError, match="without FI_REMOTE_WRITE"):
            send.descriptor()  # and its key is never handed to peers
        results, _ = _attack(eng, "write", ip, port, [recv.keys[0]])  # control
        assert results[0]["ok"], results
        eng.wait_imms({IMM: 1}, 10, "control write")
        assert recv_buf.raw[:64] == b"\xAA" * 64


# ------------------------------------------------------------------------------------------ (b)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("provider", provider_params())
def test_keys_are_random_not_sequential(provider):
    bufs = [ctypes.create_string_buffer(NBYTES) for _ in range(4)]
    with TransferEngine(provider) as a, TransferEngine(provider) as b:
        keys = []
        for eng in (a, b):
            keys += eng._scratch_region.keys
            for buf, access in zip(bufs, (ACCESS_SOURCE, ACCESS_TARGET, ACCESS_SOURCE_AND_TARGET, ACCESS_TARGET)):
                region = eng.register(ctypes.addressof(buf), NBYTES, access)
                keys += region.keys
                if access & lf.FI_REMOTE_WRITE:
                    desc = region.descriptor()
                    assert desc.keys == region.keys  # keys travel in the descriptor, not in its repr
                    assert all(str(k) not in repr(desc) and hex(k)[2:] not in repr(desc) for k in desc.keys)
        assert len(set(keys)) == len(keys), keys
        assert eng.info.mr_key_size >= 8 or eng.info.prov_key
        # 64-bit random keys: below 2**32 with probability 2**-32 each; sequential never.
        assert all(k >= 1 << 32 for k in keys), [hex(k) for k in keys]
        ordered = sorted(keys)
        assert min(y - x for x, y in zip(ordered, ordered[1:])) > 1 << 16, [hex(k) for k in keys]


@pytest.mark.timeout(60)
def test_keys_respect_a_smaller_mr_key_size():
    """A domain with mr_key_size < 8 gets keys of that many bytes (here: pretend 2 bytes)."""
    with TransferEngine("tcp") as eng:
        eng.carrier._key_bits = 16
        bufs = [ctypes.create_string_buffer(64) for _ in range(8)]
        keys = [eng.register(ctypes.addressof(b), 64, ACCESS_TARGET).keys[0] for b in bufs]
        assert all(0 < k < 1 << 16 for k in keys) and len(set(keys)) == len(keys), keys


@pytest.mark.timeout(60)
def test_register_refuses_remote_read_and_unknown_access():
    with TransferEngine("tcp") as eng:
        buf = ctypes.create_string_buffer(64)
        for bad in (lf.FI_REMOTE_READ, ACCESS_TARGET | lf.FI_REMOTE_READ, 0, lf.FI_SEND, -1):
            with pytest.raises(ValueError, match="access|FI_REMOTE_READ"):
                eng.register(ctypes.addressof(buf), 64, bad)
        assert eng._scratch_region.access == ACCESS_SOURCE


# ------------------------------------------------------------------------------------------ (c)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_rdma_read_with_the_right_key_fails():
    """No region allows remote reads: a peer with the right key reads nothing. Control: an MR
    registered the old way (FI_REMOTE_READ), over the same bytes, is readable by the same harness."""
    with TransferEngine("tcp", timeout_s=10.0, idle_yield=True) as eng:
        buf = _filled()
        region = eng.register(ctypes.addressof(buf), NBYTES, ACCESS_SOURCE_AND_TARGET)
        control = eng._domains[0].mr_reg(ctypes.addressof(buf), NBYTES, lf.FI_REMOTE_READ | lf.FI_REMOTE_WRITE,
                                         _wrong_key(*region.keys))
        try:
            ip, port = _ip_port(eng)
            [denied], _ = _attack(eng, "read", ip, port, [region.keys[0]])
            assert not denied["ok"] and denied["error"] and not denied["data"], denied
            [allowed], _ = _attack(eng, "read", ip, port, [control.key])
            assert allowed["ok"] and allowed["data"] == bytes([FILL]).hex() * 64, allowed
        finally:
            control.close()


def test_protocol_issues_no_rdma_reads():
    """Nothing in the package posts a read (readmsg/fi_read): that is why no region needs FI_REMOTE_READ."""
    pkg = ROOT / "moe_a2a"
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in pkg.rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if ("readmsg" in line or "fi_read" in line or '"readv"' in line)
            and not line.lstrip().startswith(("#", "_fields_", '("size"'))]
    assert hits == [], hits


# ------------------------------------------------------------------------------------------ (d)


def _listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of the TCP sockets in LISTEN state that process ``pid`` holds (/proc)."""
    mine = socket_inodes(pid)
    return {(addr, port) for addr, port, inode in listening_sockets() if inode in mine}


LOOPBACK = {"127.0.0.1", "::1"}


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_local_only_engine_listens_on_loopback_only():
    before = _listening(os.getpid())
    with TransferEngine("tcp", local_only=True) as eng:
        ip, port = _ip_port(eng)
        new = _listening(os.getpid()) - before
        assert ip == "127.0.0.1", (ip, eng.domain_names)
        assert (ip, port) in new, (ip, port, new)
        assert all(addr in LOOPBACK for addr, _ in new), f"listening beyond loopback: {new}"
        if shutil.which("ss"):
            ss = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True, timeout=10)
            locals_ = [line.split()[3] for line in ss.stdout.splitlines() if line.strip()]
            assert locals_ == [f"127.0.0.1:{port}"], ss.stdout
        # Still a working engine: a write to itself over loopback.
        buf = ctypes.create_string_buffer(64)
        dst = eng.register(ctypes.addressof(buf), 64)
        [me] = eng.connect([eng.address])
        eng.scatter(eng.peer_group([me], [dst.descriptor()]), eng._scratch_region, [(0, 0, 8, 0)], 3)
        eng.wait_imms({3: 1}, 10, "loopback self write")
        eng.wait_writes(10)
    # Providers without a socket ignore the option.
    TransferEngine("shm", local_only=True).close()


# ------------------------------------------------------------------ the proxy process (the reported attack)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_proxy_local_only_segment_is_not_writable_by_guessing():
    """The original report, end to end: a proxy started with ``ProxySpec(local_only=True)`` listens on
    127.0.0.1 only, its segment's keys are random, and 64-byte writes with keys 0..4 (and a wrong
    random key) through its port change nothing in the segment."""
    from moe_a2a.config import A2AConfig
    from moe_a2a.protocol.words import Flag
    from moe_a2a.protocol.memory import SharedSegment, unique_name
    from moe_a2a.protocol.segment import read_error
    from moe_a2a.protocol.proxy_spec import ProxySpec
    from moe_a2a.runtime.proxy_handle import ProxyHandle

    lay = A2AConfig(max_num_tokens=4, num_experts=2, experts_per_token=1, hidden_dim=16).layout(1, 1)
    seg = SharedSegment(unique_name("moe_a2a_sec"), lay.segment_bytes(True), create=True)
    handle = None
    try:
        spec = ProxySpec(lay, 0, seg.name, True, "tcp", 20.0, parent_pid=os.getpid(), idle_yield=True,
                         local_only=True)
        handle = ProxyHandle(spec)
        address, desc, gpu_desc = handle.address(30.0)
        assert gpu_desc is None
        handle.finish([(address, desc, None)], 30.0, node_local=True)  # the proxy now only progresses
        listening = _listening(handle.proc.pid)
        assert listening and all(addr in LOOPBACK for addr, _ in listening), listening
        [key] = desc.keys
        assert key >= 1 << 32, hex(key)
        name = address.names[0]
        ip, port = socket.inet_ntoa(name[4:8]), struct.unpack(">H", name[2:4])[0]
        assert (ip, port) in listening
        before = bytes(seg.numpy(0, seg.nbytes))
        proc = subprocess.run([sys.executable, "-m", "tests.proxy._attacker", "write", ip, str(port),
                               str(NBYTES), "64", hex(IMM), *map(hex, (*GUESSES, _wrong_key(key)))],
                              cwd=ROOT, capture_output=True, text=True, timeout=90)
        assert proc.returncode == 0, proc.stderr
        time.sleep(0.2)  # the proxy keeps progressing: anything that was going to land has landed
        after = bytes(seg.numpy(0, seg.nbytes))
        changed = [i for i, (x, y) in enumerate(zip(before, after)) if x != y]
        # Only the proxy's own heartbeat word may move.
        hb = lay.flag_offset_bytes(Flag.HEARTBEAT)
        assert all(hb <= i < hb + 8 for i in changed), f"segment bytes changed at {changed[:16]}"
        assert handle.proc.poll() is None, f"proxy died: {read_error(seg, lay)}"
    finally:
        if handle is not None:
            handle.stop(seg, lay)
        seg.close()
