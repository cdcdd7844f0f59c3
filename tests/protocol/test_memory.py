"""protocol.memory: shared segments, file descriptors passed between real processes, cuMem buffers (GPU)."""
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from moe_a2a.protocol.memory import SharedSegment, fd_from_process, recv_fds, send_fds, unique_name


def _memfd(content: bytes) -> int:
    fd = os.memfd_create("moe_a2a-test")
    os.write(fd, content)
    return fd


def _python(code: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                            stdin=subprocess.PIPE, text=True, **kw)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_proxy_process_imports_neither_torch_nor_triton():
    # The proxy starts once per rank: torch alone costs seconds and hundreds of MB there.
    out = subprocess.run([sys.executable, "-c", "import sys, moe_a2a.proxy.worker; "
                          "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_fds_cross_a_unix_socket_to_another_process():
    ours, theirs = socket.socketpair()
    child = _python(f"""
        import os, socket
        from moe_a2a.protocol.memory import recv_fds
        sock = socket.socket(fileno={theirs.fileno()})
        fds = recv_fds(sock, 2, 20.0)
        print(b"|".join(os.pread(fd, 64, 0) for fd in fds).decode())
    """, pass_fds=[theirs.fileno()])
    theirs.close()
    fds = [_memfd(b"send buffer"), _memfd(b"recv buffer")]
    send_fds(ours, fds)
    for fd in fds:
        os.close(fd)  # the child holds its own duplicates
    out, _ = child.communicate(timeout=30)
    assert child.returncode == 0 and out.strip() == "send buffer|recv buffer"


@pytest.mark.timeout(30)
def test_recv_fds_times_out_and_refuses_a_wrong_count():
    a, b = socket.socketpair()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="no file descriptors arrived within 0.2s"):
        recv_fds(b, 2, 0.2)
    assert time.monotonic() - t0 < 5
    fd = _memfd(b"x")
    send_fds(a, [fd])
    with pytest.raises(RuntimeError, match="expected 2 file descriptors, got 1"):
        recv_fds(b, 2, 5.0)
    os.close(fd)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_fd_pulled_from_a_sibling_process_with_pidfd_getfd():
    # Same-node ranks are siblings (children of one launcher), as here.
    owner = _python("""
        import os, sys
        fd = os.memfd_create("moe_a2a-test")
        os.write(fd, b"peer recv buffer")
        print(os.getpid(), fd, flush=True)
        sys.stdin.readline()
    """)
    try:
        pid, fd = map(int, owner.stdout.readline().split())
        puller = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
            import os
            from moe_a2a.protocol.memory import fd_from_process
            print(os.pread(fd_from_process({pid}, {fd}), 64, 0).decode())
        """)], capture_output=True, text=True, timeout=30)
        assert puller.returncode == 0, puller.stderr
        assert puller.stdout.strip() == "peer recv buffer"
    finally:
        owner.communicate("\n", timeout=30)


def test_fd_from_process_names_the_process_and_fd_it_could_not_get():
    with pytest.raises(OSError, match=rf"pidfd_getfd\(pid {os.getpid()}, fd 987654\)"):
        fd_from_process(os.getpid(), 987654)


def test_shared_segment_is_zeroed_shared_and_removed():
    seg = SharedSegment(unique_name("moe_a2a-test"), 4096, create=True)
    other = SharedSegment(seg.name)
    seg.numpy(128, 4)[:] = [1, 2, 3, 4]
    assert other.numpy(0, 4096).sum() == 10 and list(other.numpy(128, 4)) == [1, 2, 3, 4]
    other.close()
    seg.close()
    assert not os.path.exists(seg.path)
    with pytest.raises(ValueError, match="plain file name"):
        SharedSegment("a/b")


def test_shared_segment_file_is_removed_when_mapping_fails():
    name = unique_name("moe_a2a-test")
    # 1 PiB: /dev/shm accepts the size (sparse), mmap cannot map it (ENOMEM).
    with pytest.raises(OSError):
        SharedSegment(name, 1 << 50, create=True)
    assert not os.path.exists(f"/dev/shm/{name}")
    with pytest.raises(ValueError, match="nbytes must be positive"):
        SharedSegment(name, 0, create=True)
    assert not os.path.exists(f"/dev/shm/{name}")
    with pytest.raises(FileNotFoundError):  # attaching to a missing segment creates nothing
        SharedSegment(name)
    assert not os.path.exists(f"/dev/shm/{name}")


def test_process_shm_files_match_one_pid_exactly():
    from moe_a2a.protocol.memory import process_shm_files, remove_process_shm_files

    pid = (1 << 22) + 1 + os.getpid()  # above the largest possible pid_max (2**22): nobody else's
    mine = [f"/dev/shm/{pid}:0:0", f"/dev/shm/moe_a2a-{pid}-0011aabb"]
    others = [f"/dev/shm/{pid}1:0:0", f"/dev/shm/{pid}", f"/dev/shm/moe_a2a-{pid}1-0011aabb", f"/dev/shm/x{pid}:0"]
    for path in mine + others:
        open(path, "w").close()
    try:
        assert process_shm_files(pid) == sorted(mine)
        assert process_shm_files(pid, segments=False) == [mine[0]]
        assert remove_process_shm_files(pid, segments=False) == [mine[0]]
        assert remove_process_shm_files(pid) == [mine[1]]
        assert all(os.path.exists(p) for p in others) and not any(os.path.exists(p) for p in mine)
    finally:
        for path in mine + others:
            if os.path.exists(path):
                os.unlink(path)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.gpu(reason="cuMem allocations")
def test_cumem_buffer_is_mapped_by_another_process_through_its_fd():
    import torch

    from moe_a2a.protocol.memory import CuMemBuffer, device_view

    buf = CuMemBuffer(3 << 20, torch.cuda.current_device())
    assert buf.size >= 3 << 20 and buf.fd is not None
    view = device_view(buf.addr, buf.size, torch.device("cuda"))
    assert int(view.sum()) == 0  # zero filled
    view[:5] = torch.tensor(list(b"hello"), dtype=torch.uint8)
    torch.cuda.synchronize()
    ours, theirs = socket.socketpair()
    # The importer is torch-free, as the proxy is: the driver API only.
    child = _python(f"""
        import ctypes, socket
        from cuda.bindings import driver as cu
        from moe_a2a.protocol.memory import CuMemBuffer, recv_fds
        (fd,) = recv_fds(socket.socket(fileno={theirs.fileno()}), 1, 20.0)
        mem = CuMemBuffer({buf.size}, {torch.cuda.current_device()}, fd=fd)
        out = ctypes.create_string_buffer(5)
        assert cu.cuMemcpyDtoH(ctypes.addressof(out), mem.addr, 5)[0] == cu.CUresult.CUDA_SUCCESS
        assert cu.cuMemsetD8(mem.addr + 5, 33, 1)[0] == cu.CUresult.CUDA_SUCCESS
        cu.cuCtxSynchronize()
        print(out.raw.decode(), flush=True)
        mem.close()
    """, pass_fds=[theirs.fileno()])
    theirs.close()
    send_fds(ours, [buf.fd])
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0 and out.strip() == "hello"
    assert int(view[5]) == 33  # the importer's write is visible here: one allocation, two mappings
    buf.close()
