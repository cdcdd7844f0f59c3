"""LocalCluster: results in rank order, a raising rank's traceback, clean-up of processes and segments;
tensors of every dtype both ways; a script without the `__main__` guard gets an error naming it."""
import collections
import dataclasses
import glob
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_a2a import LocalCluster
from moe_a2a.config import A2AConfig
from moe_a2a.local import _dumps, _loads

from ..conftest import TEST_DEVICE


def _who(a2a, rank, tag):
    if rank == 1 and tag == "boom":
        raise ValueError("boom from the rank function")
    return {"rank": rank, "tag": tag, "world": a2a.world_size, "tensor": torch.full((2,), rank)}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_results_errors_and_cleanup():
    cfg = A2AConfig(max_num_tokens=2, num_experts=4, experts_per_token=1, hidden_dim=8, in_dtype=torch.float32)
    with LocalCluster(cfg, world_size=2, node_size=1, transport="shm", device=TEST_DEVICE, timeout_s=30) as cl:
        pids = [p.pid for p in cl._procs]
        out = cl.run(_who, "hello")
        assert [o["rank"] for o in out] == [0, 1] and all(o["world"] == 2 for o in out)
        assert out[1]["tensor"].device.type == "cpu" and out[1]["tensor"].tolist() == [1, 1]
        with pytest.raises(RuntimeError, match="rank 1 raised:(.|\n)*boom from the rank function"):
            cl.run(_who, "boom")
        assert cl.run(_who, "again")[0]["tag"] == "again"  # a raising function does not break the cluster
        segments = [path for pid in pids for path in glob.glob(f"/dev/shm/moe_a2a-{pid}-*")]
        assert segments == []  # unlinked once every peer mapped them: nothing to leave behind
    for pid in pids:
        assert not glob.glob(f"/dev/shm/moe_a2a-{pid}-*"), "segments left behind"
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def test_bad_cluster_arguments_are_refused_before_starting():
    cfg = A2AConfig(num_experts=8)
    with pytest.raises(ValueError, match="node_size"):
        LocalCluster(cfg, world_size=4, node_size=3)
    with pytest.raises(ValueError, match="divisible"):
        LocalCluster(cfg, world_size=3)
    with pytest.raises(ValueError, match="device"):
        LocalCluster(cfg, world_size=2, device="tpu")
    with pytest.raises(ValueError, match="buffers"):
        LocalCluster(cfg, world_size=2, buffers="pinned")
    with pytest.raises(ValueError, match="buffers='gpu' needs device='cuda'"):
        LocalCluster(cfg, world_size=2, device="cpu", buffers="gpu")
    with pytest.raises(ValueError, match="gpu_wait"):
        LocalCluster(cfg, world_size=2, gpu_wait="spin")
    with pytest.raises(ValueError, match=r"proxies must be .* \[1, 2\]"):  # at most the 2 remote peers
        LocalCluster(cfg, world_size=4, node_size=2, proxies=3)
    relay = A2AConfig(num_experts=8, dispatch_rows="rank", combine_rows="rank", relay=True)
    LocalCluster(relay, world_size=4, node_size=2, proxies=3)  # the relay: a piece per proxy, none started yet
    with pytest.raises(ValueError, match=r"proxies must be .* \[1, 16\]"):
        LocalCluster(relay, world_size=4, node_size=2, proxies=17)


def _children() -> set[int]:
    kids = set()
    for name in os.listdir("/proc"):
        try:
            stat = open(f"/proc/{name}/stat", "rb").read() if name.isdigit() else b""
        except OSError:
            continue
        if stat and int(stat[stat.rindex(b")") + 2:].split()[1]) == os.getpid():
            kids.add(int(name))
    return kids


@pytest.mark.parametrize("kwargs, needle", [
    (dict(cfg={"num_experts": 8}), "cfg must be an A2AConfig, got dict"),
    (dict(cfg=None), "cfg must be an A2AConfig"),
    (dict(world_size="2"), "world_size must be a positive int"),
    (dict(world_size=2.0), "world_size must be a positive int"),
    (dict(world_size=True), "world_size must be a positive int"),
    (dict(world_size=0), "world_size must be a positive int"),
    (dict(node_size="1"), "node_size"),
    (dict(node_size=True), "node_size"),
    (dict(node_size=0), "node_size"),
    (dict(transport="udp"), "transport must be one of"),
    (dict(transport=None), "transport must be one of"),
    (dict(device=0), "device must be 'cpu' or 'cuda'"),
    (dict(timeout_s=0), "timeout_s must be a positive finite number"),
    (dict(timeout_s=-1.0), "timeout_s must be a positive finite number"),
    (dict(timeout_s=float("nan")), "timeout_s must be a positive finite number"),
    (dict(timeout_s=float("inf")), "timeout_s must be a positive finite number"),
    (dict(timeout_s="30"), "timeout_s must be a positive finite number"),
    (dict(timeout_s=True), "timeout_s must be a positive finite number"),
    (dict(gpu_wait=None), "gpu_wait"),
    (dict(buffers=1), "buffers"),
    (dict(nics="efa0"), "nics"),
    (dict(nics=[]), "nics"),
    (dict(nics=["", "x"]), "nics"),
    (dict(nics=[3]), "nics"),
    (dict(device="cpu", buffers="gpu"), "buffers='gpu' needs device='cuda'"),
])
def test_every_cluster_argument_is_checked_before_anything_starts(kwargs, needle):
    before = _children()
    args = dict(cfg=A2AConfig(num_experts=8), world_size=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=needle):
        LocalCluster(**args)
    assert _children() - before == set(), "a process was started for a refused cluster"


def test_buffers_larger_than_this_machine_are_refused_before_anything_starts():
    # ~697 GB per rank (64 ranks on 8 nodes x 45440 tokens x top-8 rows of 14 KB, both ways): no machine we run on.
    cfg = A2AConfig(max_num_tokens=45440, num_experts=256, experts_per_token=8, hidden_dim=7168)
    before = _children()
    with pytest.raises(ValueError, match=r"buffers too large for this machine: 64 rank\(s\) x 697,029,\d{3},\d{3} B "
                                         r"\(697.0 GB\)(.|\n)*physical memory(.|\n)*max_num_tokens=45440"):
        LocalCluster(cfg, world_size=64, node_size=8)
    assert _children() - before == set()


# ---- tensors of every dtype travel both ways -------------------------------------------------------
DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16, torch.float32, torch.float64,
          torch.complex64, torch.complex128, torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32,
          torch.int64]
Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass
class Box:
    tensor: torch.Tensor
    label: str = "box"


def _random_tensor(dtype, shape, seed: int, view: str) -> torch.Tensor:
    """Random bit patterns (NaNs and infinities included for floats), then a view of kind `view`."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw &= 1
    t = raw.view(dtype).reshape(shape)
    if view == "transposed" and t.dim() >= 2:
        t = t.transpose(0, 1)
    elif view == "strided" and t.dim() >= 1:
        t = t[::2]
    elif view == "expanded" and t.dim() >= 1 and t.shape[0] >= 1:
        t = t[:1].expand(3, *t.shape[1:])
    return t


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and (a.numel() == 0 or torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))))


def _nest(t: torch.Tensor, how: str):
    return {"plain": lambda: t, "list": lambda: [t, 1, "x"], "tuple": lambda: (None, (t,)),
            "dict": lambda: {"k": {"inner": [t]}}, "namedtuple": lambda: Pair(t, 2),
            "dataclass": lambda: Box(t)}[how]()


def _unnest(obj, how: str) -> torch.Tensor:
    return {"plain": lambda: obj, "list": lambda: obj[0], "tuple": lambda: obj[1][0],
            "dict": lambda: obj["k"]["inner"][0], "namedtuple": lambda: obj.a, "dataclass": lambda: obj.tensor}[how]()


@settings(max_examples=150, deadline=None)
@given(dtype=st.sampled_from(DTYPES),
       shape=st.sampled_from([(), (0,), (5,), (4, 0), (4, 6), (3, 4, 5)]),
       view=st.sampled_from(["contiguous", "transposed", "strided", "expanded"]),
       how=st.sampled_from(["plain", "list", "tuple", "dict", "namedtuple", "dataclass"]),
       seed=st.integers(0, 2**16))
def test_tensor_codec_round_trips_every_dtype_and_nesting_bitwise(dtype, shape, view, how, seed):
    t = _random_tensor(dtype, shape, seed, view)
    for to_cpu in (False, True):
        back = _loads(_dumps(_nest(t, how), to_cpu=to_cpu))
        assert type(back) is type(_nest(t, how))
        got = _unnest(back, how)
        assert type(got) is torch.Tensor and _same_bits(got, t), (dtype, shape, view, how)
        assert _same_bits(_unnest(_loads(_dumps(_nest(t, how))), how), t)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tensor_codec_keeps_identity_grad_parameters_and_functions(dtype):
    t = _random_tensor(dtype, (4, 2), 1, "contiguous")
    back = _loads(_dumps({"twice": [t, t], "fn": lambda k: k + 1}))
    assert back["twice"][0] is back["twice"][1] and _same_bits(back["twice"][0], t)
    assert back["fn"](1) == 2  # functions still travel by value (cloudpickle)
    if dtype.is_floating_point and dtype.itemsize > 1:
        p = torch.nn.Parameter(t.clone())
        q = _loads(_dumps(p))
        assert type(q) is torch.nn.Parameter and q.requires_grad and _same_bits(q.detach(), t)
    c = torch.complex(torch.ones(2), torch.arange(2.0)).conj()  # a conjugate view resolves to its values
    assert torch.equal(_loads(_dumps(c)), c.resolve_conj())


def _fp8_echo(a2a, rank, x, extra):
    bits = x.view(torch.uint8) ^ rank  # a different fp8 tensor per rank, bit-exact
    return {"x": x, "mine": bits.view(x.dtype), "extra": extra, "scale": torch.full((2,), rank, dtype=torch.bfloat16)}


def _raise_words(a2a, rank):
    raise RuntimeError("this text says the proxy exited and a peer died, but no process did")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fp8_arguments_and_results_cross_a_real_cluster():
    cfg = A2AConfig(max_num_tokens=2, num_experts=4, experts_per_token=1, hidden_dim=8, in_dtype=torch.float32)
    x = _random_tensor(torch.float8_e4m3fn, (4, 8), 7, "transposed")
    extra = [(_random_tensor(torch.float8_e5m2, (3,), 8, "contiguous"),), {"b": torch.tensor(True)}]
    with LocalCluster(cfg, world_size=2, node_size=1, transport="shm", device=TEST_DEVICE, timeout_s=30) as cl:
        out = cl.run(_fp8_echo, x, extra)
        for rank, o in enumerate(out):
            assert _same_bits(o["x"], x) and o["x"].device.type == "cpu"
            assert _same_bits(o["mine"], (x.view(torch.uint8) ^ rank).view(torch.float8_e4m3fn))
            assert _same_bits(o["extra"][0][0], extra[0][0]) and o["extra"][1]["b"].item() is True
            assert o["scale"].dtype == torch.bfloat16 and o["scale"].tolist() == [rank, rank]
        # "died"/"exited" in a rank's error text is an error, not a death: the cluster stays usable
        with pytest.raises(RuntimeError, match="rank 0 raised:(.|\n)*no process did"):
            cl.run(_raise_words)
        assert _same_bits(cl.run(_fp8_echo, x, None)[1]["x"], x)


# ---- a script without `if __name__ == "__main__":` --------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_script_without_main_guard_gets_an_error_naming_the_guard(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent("""
        import torch
        from moe_a2a import LocalCluster
        from moe_a2a.config import A2AConfig

        cfg = A2AConfig(max_num_tokens=2, num_experts=4, experts_per_token=1, hidden_dim=8, in_dtype=torch.float32)
        with LocalCluster(cfg, world_size=2, node_size=1, transport="shm", device="cpu", timeout_s=20) as cl:
            print("RESULTS", cl.run(lambda a2a, rank: rank))
        """))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0 and "RESULTS" not in proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: LocalCluster: the rank processes could not start"), proc.stderr
    assert 'if __name__ == "__main__":' in last and str(script) in last
    assert "TimeoutError" not in proc.stderr and "bootstrapping phase" not in proc.stderr  # not Python's wall of text
    assert elapsed < 20, f"took {elapsed:.1f}s: the start-up wait ran out instead of noticing (bound 80 s)"


# ---- CPU ranks from the forkserver's template: the caller's environment of the moment ----------------
def _environment(a2a, rank):
    import sys

    return {"mark": os.environ.get("MOE_A2A_TEST_MARK"), "interpret": os.environ.get("TRITON_INTERPRET"),
            "cluster": os.environ.get("MOE_A2A_LOCAL_CLUSTER_ID"), "torch": "torch" in sys.modules}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cpu_ranks_see_the_callers_environment_of_each_start(monkeypatch):
    """The template's server starts once with the environment of the first cluster's start; each cluster's ranks
    still get the caller's environment when that cluster starts (a variable changed in between included) and
    their cluster's id, none of an earlier one."""
    cfg = A2AConfig(max_num_tokens=2, num_experts=4, experts_per_token=1, hidden_dim=8, in_dtype=torch.float32)
    seen = []
    for value in ("first", "second"):
        monkeypatch.setenv("MOE_A2A_TEST_MARK", value)
        with LocalCluster(cfg, world_size=2, node_size=1, transport="shm", device="cpu", timeout_s=30) as cl:
            seen.append((cl._cluster_id, cl.run(_environment)))
    for value, (cluster_id, ranks) in zip(("first", "second"), seen):
        assert ranks == 2 * [{"mark": value, "interpret": "1", "cluster": cluster_id, "torch": True}], ranks
    assert "MOE_A2A_LOCAL_CLUSTER_ID" not in os.environ


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_clusters_start_when_the_caller_started_a_forkserver_of_its_own(tmp_path):
    """A caller whose own forkserver runs (its imports and environment, not ours): the template is spawned."""
    script = tmp_path / "own_forkserver.py"
    script.write_text(textwrap.dedent("""
        import multiprocessing as mp
        import torch
        from moe_a2a import LocalCluster
        from moe_a2a.config import A2AConfig

        def nothing():
            pass

        if __name__ == "__main__":
            p = mp.get_context("forkserver").Process(target=nothing)
            p.start()
            p.join()
            cfg = A2AConfig(max_num_tokens=2, num_experts=4, experts_per_token=1, hidden_dim=8, in_dtype=torch.float32)
            with LocalCluster(cfg, world_size=2, node_size=1, transport="shm", device="cpu", timeout_s=20) as cl:
                print("RESULTS", cl.run(lambda a2a, rank: rank), p.exitcode)
        """))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and "RESULTS [0, 1] 0" in proc.stdout, proc.stderr
