import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny import VARIANTS, build_hf_model, save_hf_model  # noqa: E402


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
