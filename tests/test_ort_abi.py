"""The onnxruntime C API slots that mla_deploy/kernels/ort_abi.h counts by hand, checked against the installed
onnxruntime by what they do: tests/ort_abi_probe.c, built on the header, calls every slot it names with inputs whose
results only the right function gives (a shape read back, data summed, a status round trip, every ParallelFor index
visited once, a release that frees, an integer attribute read back). The same probe with any one slot moved one place either way must fail, so a
miscount cannot pass. Each probe runs in its own process: a wrong slot may crash it."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parents[1]
HEADER = ROOT / "mla_deploy" / "kernels" / "ort_abi.h"
PROBE = Path(__file__).with_name("ort_abi_probe.c")
SLOTS = dict(re.findall(r"\bORT_(\w+) = (\d+),", HEADER.read_text()))  # the header's `OrtApi slots` enum
COMPILER = shutil.which("cc") or shutil.which("gcc")
needs_compiler = pytest.mark.skipif(COMPILER is None, reason="no C compiler to build the probe")

X = np.arange(42, dtype=np.float64).reshape(2, 3, 7) * 0.5
PROBE_TASKS, LEAK_BYTES = 37, 256 * 1024
PROBE_VALUE = 4_000_000_123  # an int64 attribute beyond 32 bits  # ParallelFor's tasks; 20000 unreleased shape infos leak over 1 MB
RUN = """
import json, sys
import numpy as np, onnxruntime as ort
so = ort.SessionOptions()
so.intra_op_num_threads = 2
so.register_custom_ops_library(sys.argv[1])
session = ort.InferenceSession(sys.argv[2], so, providers=["CPUExecutionProvider"])
x = np.arange(42, dtype=np.float64).reshape(2, 3, 7) * 0.5
y = session.run(None, {"x": x})[0]
try:
    session.run(None, {"x": -x - 1})
    refused = None
except Exception as e:
    refused = str(e)
print(json.dumps({"y": y.tolist(), "refused": refused}))
"""


def _model(path: Path) -> Path:
    node = helper.make_node("SlotProbe", ["x"], ["y"], domain="mla_deploy_probe", probe_value=PROBE_VALUE)
    graph = helper.make_graph([node], "probe",
                              [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [2, 3, 7])],
                              [helper.make_tensor_value_info("y", TensorProto.DOUBLE, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("mla_deploy_probe", 1)],
                              ir_version=9)
    path.write_bytes(model.SerializeToString())
    return path


def _probe(directory: Path, shift: tuple[str, int] | None = None) -> list[str]:
    """Build the probe (one slot `shift`ed) and run it; what it found wrong (empty: every slot is right)."""
    library = directory / ("probe.so" if shift is None else f"probe-{shift[0]}{shift[1]:+d}.so")
    defines = [] if shift is None else [f"-DSHIFT_SLOT=ORT_{shift[0]}", f"-DSHIFT_BY={shift[1]}"]
    subprocess.run([COMPILER, "-shared", "-fPIC", "-O1", "-std=gnu11", "-Wall", "-Werror", f"-I{HEADER.parent}",
                    *defines, str(PROBE), "-o", str(library)], check=True)
    model = directory / "probe.onnx"
    if not model.exists():
        _model(model)
    try:
        run = subprocess.run([sys.executable, "-c", RUN, str(library), str(model)], capture_output=True, text=True,
                             timeout=60)
    except subprocess.TimeoutExpired:
        return ["the probe hung"]
    if run.returncode != 0:
        return [f"the probe failed (exit {run.returncode}): {run.stderr.strip().splitlines()[-1:] or ''}"]
    found = json.loads(run.stdout)
    y = np.ravel(found["y"]).tolist()
    if len(y) != 16:
        return [f"the output holds {len(y)} values (expected 16)"]
    expected = {"element type": (y[0], 11), "rank": (y[1], 3), "dims": (y[2:5], [2, 3, 7]), "sum": (y[5], X.sum()),
                "ParallelFor status": (y[6], 1), "ParallelFor indices seen once": (y[7], PROBE_TASKS),
                "error code read back": (y[8], 2), "message read back": (y[9], 1),
                "int64 attribute read back": (y[11], PROBE_VALUE), "a missing attribute's status": (y[12], 1)}
    problems = [f"{what}: {got} (expected {want})" for what, (got, want) in expected.items() if got != want]
    if not abs(y[10]) < LEAK_BYTES:
        problems.append(f"heap grew {y[10]:.0f} bytes over the released shape infos")
    if not abs(y[13]) < LEAK_BYTES:
        problems.append(f"heap grew {y[13]:.0f} bytes over the released statuses")
    if found["refused"] is None or "slot probe: refused" not in found["refused"]:
        problems.append(f"a status from CreateStatus did not reach onnxruntime: {found['refused']!r}")
    return problems


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("ort_abi")


def test_the_probe_calls_every_slot_the_header_names():
    called = set(re.findall(r"SLOT\(ORT_(\w+)\)", PROBE.read_text()))
    assert SLOTS and called == set(SLOTS)
    used = set()  # and the library reaches onnxruntime through those slots alone
    for source in HEADER.parent.glob("*.c"):
        used |= set(re.findall(r"ORT_FN\(\s*\w+\s*,\s*\w+\s*,\s*ORT_(\w+)\)", source.read_text()))
    assert used and used <= set(SLOTS)


@needs_compiler
def test_every_slot_is_the_function_the_header_says(work):
    assert _probe(work) == []


@needs_compiler
@pytest.mark.parametrize("shift", [(slot, by) for slot in sorted(SLOTS) for by in (-1, 1)],
                         ids=lambda s: f"{s[0]}{s[1]:+d}")
def test_a_slot_off_by_one_fails(work, shift):
    assert _probe(work, shift) != []
