import json
import os
import sys
from collections import defaultdict
from pathlib import Path

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
    per_file = defaultdict(float)
    for item in items:
        per_file[item.nodeid.split("::")[0]] += seconds.get(item.nodeid, 0.0)
    items.sort(key=lambda item: (per_file[item.nodeid.split("::")[0]], item.nodeid.split("::")[0],
                                 seconds.get(item.nodeid, 0.0)))


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
