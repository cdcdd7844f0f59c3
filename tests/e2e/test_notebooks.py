"""Execute notebooks/quickstart.ipynb top to bottom (CPU: kernels in the Triton interpreter).

The kernel is always the interpreter running pytest (a kernelspec written to a temporary folder), so
the test does not depend on which "python3" kernelspec, if any, is installed on the machine.
"""
import json
import os
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="needs the test extras: pip install -e '.[test]'")
nbclient = pytest.importorskip("nbclient", reason="needs the test extras: pip install -e '.[test]'")
pytest.importorskip("ipykernel", reason="needs the test extras: pip install -e '.[test]'")
pytest.importorskip("matplotlib", reason="needs the test extras: pip install -e '.[test]'")

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
VERIFIED = "VERIFIED:"

pytestmark = [pytest.mark.slow]


def _kernel_manager(tmp_path: Path):
    """A KernelManager for kernel "python3" that runs this interpreter (sys.executable)."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    spec_dir = tmp_path / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (pytest)", "language": "python"}))
    ksm = KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")], ensure_native_kernel=False)
    return KernelManager(kernel_name="python3", kernel_spec_manager=ksm)


def test_committed_notebook_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, "clear the notebook's outputs before committing"


@pytest.mark.timeout(600)
def test_quickstart_notebook_runs(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    km = _kernel_manager(tmp_path)
    client = nbclient.NotebookClient(nb, timeout=240, kernel_name="python3", km=km,
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    t0 = time.perf_counter()
    try:
        client.execute(env=env)  # raises CellExecutionError (with the cell's traceback) on any error
    finally:
        if km.has_kernel:  # the client does not stop a kernel whose manager it was given
            km.shutdown_kernel(now=False)
    elapsed = time.perf_counter() - t0

    texts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            assert out.output_type != "error", "".join(out.get("traceback", []))
            if out.output_type == "stream":
                texts.append(out.text)
            elif "data" in out:
                texts.append(out.data.get("text/plain", ""))
    text = "".join(texts)
    assert VERIFIED in text, f"the verification message is missing; outputs were:\n{text[-3000:]}"
    # section 8: a bad input on rank 1 aborts that call on rank 0 too (CPU; a GPU drops the route instead)
    assert "aborted by rank 1" in text and "ValueError: indices[0, 0]" in text, text[-2000:]
    # section 9: each wire checked against the reference; the relay sends fewer bytes to other nodes
    assert text.count("matches reference.py; a rank sends") == 3, text[-2000:]
    assert "RELAY: fewer network bytes than per_route in both phases" in text, text[-2000:]
    n_images = sum("image/png" in out.get("data", {}) for cell in nb.cells for out in cell.get("outputs", []))
    assert n_images >= 4, f"expected the heat map, layout strip, latency and wire bytes plots, got {n_images} images"
    print(f"quickstart notebook ran in {elapsed:.1f} s")
