"""Which libfabric is loaded, what fi_getinfo is asked for, and what an engine reports of it (issue 30, 2-3)."""
from __future__ import annotations

import logging
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moe_a2a.proxy import libfabric as lf
from moe_a2a.proxy.engine import TransferEngine

from ._providers import PROVIDERS, provider_params

ROOT = Path(__file__).resolve().parents[2]


# ---- library choice --------------------------------------------------------------------------------------
def test_the_override_alone_is_tried_when_set(tmp_path, monkeypatch):
    (tmp_path / "libfabric.so.1").write_bytes(b"")
    monkeypatch.setattr(lf, "EFA_INSTALLER_DIRS", (str(tmp_path),))
    got = lf.library_candidates({lf.LIBFABRIC_ENV: "/opt/mine/libfabric.so.1"})
    assert got == [("/opt/mine/libfabric.so.1", "MOE_A2A_LIBFABRIC")]


def test_the_efa_installers_library_comes_before_the_systems(tmp_path, monkeypatch):
    lib, lib64, empty = tmp_path / "lib", tmp_path / "lib64", tmp_path / "none"
    for d in (lib, lib64, empty):
        d.mkdir()
    (lib / "libfabric.so").write_bytes(b"")
    (lib / "libfabric.so.1").write_bytes(b"")  # the soname wins over the development link
    (lib64 / "libfabric.so.1.25.0").write_bytes(b"")  # only a versioned file: found too
    monkeypatch.setattr(lf, "EFA_INSTALLER_DIRS", (str(lib), str(empty), str(lib64)))
    got = lf.library_candidates({})
    assert got[:2] == [(str(lib / "libfabric.so.1"), "EFA installer"), (str(lib64 / "libfabric.so.1.25.0"), "EFA installer")]
    assert len(got) == 3 and got[2][1] == "system" and "fabric" in got[2][0]
    monkeypatch.setattr(lf, "EFA_INSTALLER_DIRS", (str(empty),))
    assert [source for _, source in lf.library_candidates({})] == ["system"]


def test_a_preferred_library_that_does_not_load_is_named_and_passed_over(tmp_path, caplog):
    bad = tmp_path / "libfabric.so.1"
    bad.write_bytes(b"not an ELF file")
    system = lf.library_candidates({})[-1]
    with caplog.at_level(logging.WARNING, logger="moe_a2a.proxy"):
        lib, info = lf.load_library([(str(bad), "EFA installer"), system])
    assert info["source"] == "system" and info["version"] == "%d.%d" % lf.runtime_version()
    assert os.path.isabs(info["path"]) and os.path.exists(info["path"])
    assert str(bad) in caplog.text and info["path"] in caplog.text
    with pytest.raises(OSError, match=rf"tried {bad} \(EFA installer\).*/nowhere/libfabric.so.1 "
                                      rf"\(MOE_A2A_LIBFABRIC\).*MOE_A2A_LIBFABRIC"):
        lf.load_library([(str(bad), "EFA installer"), ("/nowhere/libfabric.so.1", "MOE_A2A_LIBFABRIC")])


def test_the_loaded_library_says_where_it_is_from_and_what_api_is_requested():
    info = lf.library_info()
    assert info["source"] in ("MOE_A2A_LIBFABRIC", "EFA installer", "system")
    assert os.path.realpath(info["path"]) == info["path"] and os.path.exists(info["path"])
    major, minor = lf.runtime_version()
    assert info["version"] == f"{major}.{minor}"
    assert info["api"] == lf.api_version() == min(lf.FI_VERSION(major, minor), lf.API_NEWEST)
    assert info["api_version"] == lf.version_str(info["api"])


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_library_under_the_efa_installers_prefix_is_the_one_loaded(tmp_path):
    """A copy of the system's libfabric at an EFA-installer-like prefix: that copy is loaded (not the system's)
    and an engine runs on it."""
    efa_lib = tmp_path / "efa" / "lib"
    efa_lib.mkdir(parents=True)
    shutil.copy(lf.library_info()["path"], efa_lib / "libfabric.so.1")
    code = (f"from moe_a2a.proxy import libfabric as lf; lf.EFA_INSTALLER_DIRS = ({str(efa_lib)!r},)\n"
            "from moe_a2a.proxy.engine import TransferEngine\n"
            "e = TransferEngine('tcp', local_only=True, timeout_s=10); print(e.fabric_info['source'], "
            "e.fabric_info['path']); e.close()")
    env = {k: v for k, v in os.environ.items() if k != lf.LIBFABRIC_ENV}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=50)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["EFA", "installer", str((efa_lib / "libfabric.so.1").resolve())]


# ---- what fi_getinfo is asked -----------------------------------------------------------------------------
@pytest.fixture
def asked(monkeypatch):
    """Record each fi_getinfo call's (version, caps, threading) and answer -FI_ENODATA."""
    calls = []

    def spy(version, node, service, flags, hints, out):
        h = hints.contents
        calls.append((version, h.caps, h.domain_attr.contents.threading))
        return -lf.FI_ENODATA

    monkeypatch.setattr(lf.library(), "fi_getinfo", spy)
    return calls


@pytest.mark.parametrize("provider, remote_only", [("efa", True), ("verbs", True), ("tcp", False), ("shm", False)])
def test_hints_ask_for_one_thread_per_domain_and_remote_only_comm_on_nic_providers(asked, monkeypatch, provider,
                                                                                 remote_only):
    monkeypatch.setattr(lf, "api_version", lambda: lf.EFA_API_MIN)  # so that efa is asked at all
    with pytest.raises(lf.FabricError, match="FI_ENODATA"):
        lf.getinfo(provider)
    [(version, caps, threading)] = asked
    assert version == lf.EFA_API_MIN and threading == lf.FI_THREAD_DOMAIN
    assert bool(caps & lf.FI_REMOTE_COMM) == remote_only and not caps & lf.FI_LOCAL_COMM
    assert caps & (lf.FI_RMA | lf.FI_WRITE | lf.FI_REMOTE_WRITE) == lf.FI_RMA | lf.FI_WRITE | lf.FI_REMOTE_WRITE


def test_efa_below_api_1_18_is_refused_naming_the_library_and_its_version(asked, monkeypatch):
    monkeypatch.setattr(lf, "api_version", lambda: lf.FI_VERSION(1, 17))
    monkeypatch.setattr(lf, "library_info", lambda: {"path": "/usr/lib/x/libfabric.so.1.20.0", "version": "1.17",
                                                     "source": "system", "api": lf.FI_VERSION(1, 17)})
    with pytest.raises(lf.FabricError, match=r"efa needs libfabric >= 1\.18.*found 1\.17 at "
                                             r"/usr/lib/x/libfabric\.so\.1\.20\.0 \(system\).*MOE_A2A_LIBFABRIC"):
        lf.getinfo("efa")
    assert asked == []  # refused before fi_getinfo: no efa endpoint at an API that emulates its writes
    monkeypatch.setattr(lf, "api_version", lambda: lf.EFA_API_MIN)
    with pytest.raises(lf.FabricError, match="FI_ENODATA"):  # from 1.18 on efa is asked
        lf.getinfo("efa")
    assert len(asked) == 1


# ---- what an engine reports ----------------------------------------------------------------------------
@pytest.mark.timeout(30)
@pytest.mark.parametrize("provider", provider_params(PROVIDERS))
def test_an_engine_reports_and_logs_its_library_provider_and_fi_hmem_once(provider, caplog, monkeypatch):
    monkeypatch.setattr(lf, "_logged_fabrics", set())
    with caplog.at_level(logging.INFO, logger="moe_a2a.proxy"):
        engines = [TransferEngine(provider, local_only=True, timeout_s=10) for _ in range(2)]
    try:
        info = engines[0].fabric_info
        lib = lf.library_info()
        assert {k: info[k] for k in ("path", "source", "version")} == {k: lib[k] for k in ("path", "source", "version")}
        assert info["api_version"] == lib["api_version"]
        assert info["provider"] == engines[0].provider_name == lf.PROVIDER_NAMES[provider]
        assert info["domains"] == engines[0].domain_names and info["hmem"] == "not requested"
        assert info["remote_only"] is False  # tcp and shm serve this host's peers (CI runs on one host)
        # shm takes the hint; rxm answers with a stronger level (FI_THREAD_SAFE)
        assert info["threading"] == ("FI_THREAD_DOMAIN" if provider == "shm" else "FI_THREAD_SAFE")
        # libfabric 1.17 knows no such option (-FI_ENOPROTOOPT); 1.18+ builds without CUDA say -FI_EINVAL
        assert info["cuda_api_permitted"] in ("not an option of this provider (-FI_ENOPROTOOPT)",
                                              "no CUDA library or device for the provider (-FI_EINVAL)")
        assert engines[1].fabric_info == info
        lines = [r.getMessage() for r in caplog.records if r.name == "moe_a2a.proxy"]
        assert len(lines) == 1, lines  # two engines alike: logged once
        assert all(str(v) in lines[0] for v in (lib["path"], lib["version"], info["provider"], "FI_HMEM not requested"))
        assert pickle.loads(pickle.dumps(info)) == info  # it travels to the model process
    finally:
        for e in engines:
            e.close()
