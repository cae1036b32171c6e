import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny import VARIANTS, build_hf_model, save_hf_model  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Under mutmut only (scripts/mutate): the selected tests cheapest first, by the call times mutmut measured, a
    test file's tests kept together (module fixtures are set up once) and files ordered by their tests' total time.
    mutmut runs a mutant's tests with -x, so a killed mutant stops at its first cheap failing test instead of after
    whichever export-heavy file came first; a surviving mutant still runs every one of them."""
    stats = Path("mutmut-stats.json")  # mutmut runs the tests from inside mutants/
    if not os.environ.get("MUTANT_UNDER_TEST") or not stats.exists():
        return
    seconds = json.loads(stats.read_text()).get("duration_by_test", {})
    file_of = {item.nodeid: item.nodeid.partition("::")[0] for item in items}
    per_file = defaultdict(float)
    for item in items:
        per_file[file_of[item.nodeid]] += seconds.get(item.nodeid, 0.0)
    items.sort(key=lambda item: (per_file[file_of[item.nodeid]], file_of[item.nodeid], seconds.get(item.nodeid, 0.0)))


def pytest_sessionstart(session):
    """Under mutmut only: it runs one test process per core, so each gets one torch and one onnxruntime thread
    instead of a thread per core in every process (onnxruntime's spinning between ops, the default, then takes the
    core the other mutant's process is on). Sessions given an explicit thread count keep it."""
    if not os.environ.get("MUTANT_UNDER_TEST"):
        return
    import onnxruntime as ort
    import torch

    torch.set_num_threads(1)
    init = ort.InferenceSession.__init__
    if getattr(init, "one_thread", False):
        return

    def one_thread(self, path_or_bytes, sess_options=None, *args, **kwargs):
        sess_options = sess_options if sess_options is not None else ort.SessionOptions()
        if sess_options.intra_op_num_threads == 0:
            sess_options.intra_op_num_threads = 1
        init(self, path_or_bytes, sess_options, *args, **kwargs)

    one_thread.one_thread = True
    ort.InferenceSession.__init__ = one_thread


def flushes_denormals() -> bool:
    """Whether this thread's floating-point state flushes subnormals (FTZ) or reads them as zero (DAZ)."""
    subnormal = np.float64(np.finfo(np.float64).smallest_subnormal)
    return subnormal * np.float64(1.0) == 0.0 or np.float64(np.finfo(np.float64).tiny) / np.float64(2.0) == 0.0


@pytest.fixture(autouse=True)
def keeps_denormals():
    """Fails a test that leaves the process flushing subnormals: the state is per thread and outlives the test, so
    the tests after it (in pytest-randomly's order) would see other sampling and kernel results. Restored after the
    failure so that one test is the only one to fail."""
    assert not flushes_denormals(), "a test before this one left FTZ / DAZ set"
    yield
    if flushes_denormals():
        import torch

        torch.set_flush_denormal(False)
        pytest.fail("this test left the thread flushing subnormals (FTZ / DAZ), e.g. through onnxruntime's "
                    "session.set_denormal_as_zero in the test process: run it in a child process")


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """variant name -> (saved checkpoint directory, the transformers model it came from); built once per session."""
    built = {}

    def get(variant: str):
        if variant not in built:
            model = build_hf_model(variant)
            directory = tmp_path_factory.mktemp(variant)
            save_hf_model(model, directory)
            built[variant] = (directory, model)
        return built[variant]

    return get


@pytest.fixture(params=sorted(VARIANTS))
def variant(request):
    return request.param


@pytest.fixture(scope="session")
def exported(checkpoint_dir, tmp_path_factory):
    """(variant, absorb) -> export directory of that tiny checkpoint; built once per session, not verified here."""
    from mla_deploy.export import ExportOptions, export

    built = {}

    def get(variant: str, absorb: str = "fused"):
        key = (variant, absorb)
        if key not in built:
            src, _ = checkpoint_dir(variant)
            out = tmp_path_factory.mktemp(f"export-{variant}-{absorb}") / "out"
            # one If per expert, the path DeepSeek's own checkpoints take (export.experts): the tiny models' 8 experts
            # would otherwise run dense (tests/test_export_runtime.py checks that path against this one)
            export(src, out, ExportOptions(absorb=absorb, experts="branches"))
            built[key] = out
        return built[key]

    return get


@pytest.fixture(scope="session")
def demo_export_dir(tmp_path_factory):
    """The bundled demo model exported once (float32, default options), for tests that read it and leave it as is."""
    from mla_deploy.export import export
    from mla_deploy.presets import DEMO_CHECKPOINT

    out = tmp_path_factory.mktemp("demo-export") / "demo"
    export(DEMO_CHECKPOINT, out)
    return out
