"""The ctypes mirrors in ``moe_a2a.proxy.libfabric`` must match the C compiler on the installed headers.

The C program is generated from the mirrors themselves (``mirrored_structs`` / ``mirrored_constants`` of
the headers' API version, FI_MAJOR_VERSION.FI_MINOR_VERSION in fabric.h), so adding a struct or field to
the shim adds it to this check: the mirror cannot drift silently. The layouts of the 1.18 to 1.22 headers
are checked as data by test_libfabric_versions.py (printed by this program: ``python -m
tests.proxy.test_libfabric_layout <libfabric>/include 1.22``).
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

from moe_a2a.proxy import libfabric as lf
from ..conftest import TEST_DEVICE

pytestmark = [pytest.mark.slow]  # gcc and the program it builds

HEADER_DIR = "/usr/include/rdma"
HEADERS = ["sys/uio.h", "rdma/fabric.h", "rdma/fi_domain.h", "rdma/fi_endpoint.h", "rdma/fi_rma.h",
           "rdma/fi_eq.h", "rdma/fi_cm.h", "rdma/fi_errno.h"]


def _header_text(header_dir: str = HEADER_DIR) -> str:
    return "".join(open(os.path.join(header_dir, h[len("rdma/"):])).read() for h in HEADERS
                   if h.startswith("rdma/"))


def _header_version(header_dir: str = HEADER_DIR) -> int:
    text = open(os.path.join(header_dir, "fabric.h")).read()
    major, minor = (int(re.search(rf"#define FI_{w}_VERSION\s+(\d+)", text).group(1)) for w in ("MAJOR", "MINOR"))
    return lf.FI_VERSION(major, minor)


def _c_program(structs: dict, constants: dict) -> str:
    lines = [f"#include <{h}>" for h in HEADERS]
    lines += ["#include <stdio.h>", "#include <stddef.h>", "int main(void) {"]
    for name, cls in structs.items():
        lines.append(f'  printf("%s %s %zu %zu\\n", "{name}", "-", sizeof(struct {name}), (size_t)0);')
        for field, *_ in cls._fields_:
            lines.append(f'  printf("%s %s %zu %zu\\n", "{name}", "{field}", offsetof(struct {name}, {field}), '
                         f"sizeof(((struct {name} *)0)->{field}));")
    for name in constants:
        lines.append(f'  printf("const %s %llu\\n", "{name}", (unsigned long long)({name}));')
    lines += ["  return 0;", "}"]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory):
    # Both are part of the set-up (.ci/setup.sh installs libfabric-dev "for the struct-layout test"): a
    # missing one fails here, saying which, rather than skipping the only check of the ctypes mirrors. The GPU
    # machine's image has no libfabric-dev and no network to install it: there CI's run of this test stands.
    if TEST_DEVICE != "cpu" and not os.path.exists(os.path.join(HEADER_DIR, "fabric.h")):
        pytest.skip(f"no libfabric headers on this machine ({HEADER_DIR}/fabric.h; CI installs libfabric-dev)")
    assert os.path.exists(os.path.join(HEADER_DIR, "fabric.h")), \
        f"libfabric headers not installed ({HEADER_DIR}/fabric.h missing; apt-get install libfabric-dev)"
    assert shutil.which("gcc") is not None, "gcc not installed: cannot compile the offsetof program"
    version = _header_version()
    structs, lines = _compile(HEADER_DIR, version, str(tmp_path_factory.mktemp("layout")))
    return structs, lines, version


def _compile(header_dir: str, version: int, workdir: str) -> tuple[dict, list[str]]:
    """(the mirrors of `version`, the lines the offsetof program prints) for the headers in `header_dir`;
    headers newer than the mirrors (2.x) are compared with the newest mirrors."""
    api = min(version, lf.API_NEWEST)
    structs, constants = lf.mirrored_structs(api), lf.mirrored_constants(api)
    text = _header_text(header_dir)
    missing = [n for n in structs if n != "iovec" and f"struct {n} {{" not in text]
    assert not missing, f"mirrored structs absent from the {lf.version_str(version)} headers: {missing}"
    src, exe = os.path.join(workdir, "layout.c"), os.path.join(workdir, "layout")
    with open(src, "w") as f:
        f.write(_c_program(structs, constants))
    include = ["-I", os.path.dirname(os.path.abspath(header_dir))]  # <rdma/...> from header_dir's parent
    subprocess.run(["gcc", *include, "-o", exe, src], check=True, capture_output=True, text=True)
    return structs, subprocess.run([exe], check=True, capture_output=True, text=True).stdout.splitlines()


def test_struct_layouts_match_headers(c_layout):
    structs, lines, version = c_layout
    # Headers newer than the mirrors (2.x) may append fields: their structs may be larger, never smaller.
    grown_ok = version > lf.API_NEWEST
    mismatches, checked = [], 0
    for line in lines:
        parts = line.split()
        if parts[0] == "const":
            continue
        name, field, off, size = parts[0], parts[1], int(parts[2]), int(parts[3])
        cls = structs[name]
        if field == "-":
            got = ctypes.sizeof(cls)
            if got != off and not (grown_ok and off > got):
                mismatches.append(f"sizeof(struct {name}): C {off}, ctypes {got}")
        else:
            desc = getattr(cls, field)
            if (desc.offset, desc.size) != (off, size):
                mismatches.append(f"struct {name}.{field}: C offset {off} size {size}, "
                                  f"ctypes offset {desc.offset} size {desc.size}")
        checked += 1
    assert not mismatches, "\n".join(mismatches)
    # Every mirrored field and every struct size was compared (guards against an empty program).
    assert checked == sum(len(c._fields_) + 1 for c in structs.values())


def test_constants_match_headers(c_layout):
    _, lines, version = c_layout
    seen = {}
    for line in lines:
        parts = line.split()
        if parts[0] == "const":
            seen[parts[1]] = int(parts[2])
    ours = lf.mirrored_constants(min(version, lf.API_NEWEST))
    assert seen.keys() == ours.keys()
    wrong = {k: (seen[k], v) for k, v in ours.items() if seen[k] != v}
    assert not wrong, f"constant: (C, ours): {wrong}"


def test_measured_offsets_from_notes():
    # Offsets the hot path depends on, as measured against libfabric 1.17's headers on x86-64 (the
    # offsetof test above checks every field against the installed headers).
    assert lf.fi_ops_rma.writemsg.offset == 48 and lf.fi_ops_rma.writedata.offset == 64
    assert ctypes.sizeof(lf.fi_msg_rma) == 64 and lf.fi_msg_rma.data.offset == 56
    assert ctypes.sizeof(lf.fi_cq_data_entry) == 40 and lf.fi_cq_data_entry.data.offset == 32
    assert ctypes.sizeof(lf.fid_ep) == 80 and lf.fid_ep.rma.offset == 48
    assert lf.fi_domain_attr.mr_mode.offset == 36 and lf.fi_domain_attr.cq_data_size.offset == 48


if __name__ == "__main__":  # print one version's layout lines: <libfabric>/include x.y
    major, minor = map(int, sys.argv[2].split("."))
    with tempfile.TemporaryDirectory() as d:
        print("\n".join(_compile(os.path.join(sys.argv[1], "rdma"), lf.FI_VERSION(major, minor), d)[1]))
