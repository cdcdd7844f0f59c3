"""The ctypes mirrors in ``moe_a2a.proxy.libfabric`` must match the C compiler on the installed headers.

The C program is generated from ``MIRRORED_STRUCTS`` / ``MIRRORED_CONSTANTS`` themselves, so adding a
struct or field to the shim adds it to this check: the mirror cannot drift silently.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import pytest

from moe_a2a.proxy import libfabric as lf

pytestmark = [pytest.mark.slow]  # gcc and the program it builds

HEADER_DIR = "/usr/include/rdma"
HEADERS = ["sys/uio.h", "rdma/fabric.h", "rdma/fi_domain.h", "rdma/fi_endpoint.h", "rdma/fi_rma.h",
           "rdma/fi_eq.h", "rdma/fi_cm.h", "rdma/fi_errno.h"]


def _header_text() -> str:
    return "".join(open(os.path.join(HEADER_DIR, h[len("rdma/"):])).read() for h in HEADERS
                   if h.startswith("rdma/"))


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
    # missing one fails here, saying which, rather than skipping the only check of the ctypes mirrors.
    assert os.path.exists(os.path.join(HEADER_DIR, "fabric.h")), \
        f"libfabric headers not installed ({HEADER_DIR}/fabric.h missing; apt-get install libfabric-dev)"
    assert shutil.which("gcc") is not None, "gcc not installed: cannot compile the offsetof program"
    text = _header_text()
    # fi_mr_dmabuf exists only in libfabric >= 1.20 headers; check it only where it is defined.
    structs = {n: c for n, c in lf.MIRRORED_STRUCTS.items()
               if n == "iovec" or f"struct {n} {{" in text}
    missing = set(lf.MIRRORED_STRUCTS) - set(structs)
    assert missing <= {"fi_mr_dmabuf"}, f"mirrored structs absent from the headers: {missing}"
    d = tmp_path_factory.mktemp("layout")
    src = d / "layout.c"
    src.write_text(_c_program(structs, lf.MIRRORED_CONSTANTS))
    exe = d / "layout"
    subprocess.run(["gcc", "-o", str(exe), str(src)], check=True, capture_output=True, text=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return structs, out.splitlines()


def test_struct_layouts_match_headers(c_layout):
    structs, lines = c_layout
    mismatches, checked = [], 0
    for line in lines:
        parts = line.split()
        if parts[0] == "const":
            continue
        name, field, off, size = parts[0], parts[1], int(parts[2]), int(parts[3])
        cls = structs[name]
        if field == "-":
            got = ctypes.sizeof(cls)
            if got != off:
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
    _, lines = c_layout
    seen = {}
    for line in lines:
        parts = line.split()
        if parts[0] == "const":
            seen[parts[1]] = int(parts[2])
    assert seen.keys() == lf.MIRRORED_CONSTANTS.keys()
    wrong = {k: (seen[k], v) for k, v in lf.MIRRORED_CONSTANTS.items() if seen[k] != v}
    assert not wrong, f"constant: (C, ours): {wrong}"


def test_measured_offsets_from_notes():
    # Offsets the hot path depends on, as measured against libfabric 1.17's headers on x86-64 (the
    # offsetof test above checks every field against the installed headers).
    assert lf.fi_ops_rma.writemsg.offset == 48 and lf.fi_ops_rma.writedata.offset == 64
    assert ctypes.sizeof(lf.fi_msg_rma) == 64 and lf.fi_msg_rma.data.offset == 56
    assert ctypes.sizeof(lf.fi_cq_data_entry) == 40 and lf.fi_cq_data_entry.data.offset == 32
    assert ctypes.sizeof(lf.fid_ep) == 80 and lf.fid_ep.rma.offset == 48
    assert lf.fi_domain_attr.mr_mode.offset == 36 and lf.fi_domain_attr.cq_data_size.offset == 48
