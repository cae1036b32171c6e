"""Memory follows the largest layer, not the model: the export's peak RSS and the runtime's resident weights,
each measured in a child process (its own ru_maxrss and smaps_rollup) on checkpoints of N and 4N layers."""

import json
import subprocess
import sys

import pytest

from mla_deploy.checkpoint import expected_tensors
from mla_deploy.config import MLAConfig
from mla_deploy.presets import checkpoint_bytes, preset_config, write_random_checkpoint

N = 2
MiB = 1 << 20
# DeepSeek-V2-Lite's structure at 1/4 of its width: a MoE layer is ~33 MB of float32, the largest tensor 1 MB.
SMALL_V2 = dict(
    vocab_size=1024,
    hidden_size=512,
    intermediate_size=1024,
    moe_intermediate_size=512,
    num_attention_heads=8,
    num_key_value_heads=8,
    kv_lora_rank=256,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)


def config(layers: int) -> dict:
    raw = {**preset_config("v2lite-2L"), **SMALL_V2, "num_hidden_layers": layers}
    raw.pop("rope_scaling")
    return raw


def layer_bytes(layers: int) -> int:
    """float32 bytes of one MoE layer (every layer past the first is one)."""
    return (
        checkpoint_bytes(MLAConfig.from_hf_dict(config(layers))) - checkpoint_bytes(MLAConfig.from_hf_dict(config(1)))
    ) // (layers - 1)


def child(code: str) -> dict:
    """Run `code` in a fresh interpreter; it prints one JSON object last."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


EXPORT = """
import json, resource, sys
from mla_deploy.export import export
export(sys.argv[1] if len(sys.argv) > 1 else {ckpt!r}, {out!r})
print(json.dumps({{"maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}}))
"""

RUN = """
import json
from mla_deploy.runtime import ExportedModel, Generator, RuntimeOptions
from mla_deploy.runtime.memory import resident_memory
model = ExportedModel({out!r}, RuntimeOptions(prepack={prepack}))
Generator(model, stop_token_ids=()).generate([list(range(3, 40)), list(range(50, 60))], 3)
print(json.dumps({{"loaded": model.load_memory.to_dict(), "after": resident_memory().to_dict()}}))
"""


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{layers: (export dir, exporter's peak RSS)} for N and 4N layers, same seed (the first N layers are equal)."""
    root = tmp_path_factory.mktemp("memory")
    result = {}
    for layers in (N, 4 * N):
        ckpt = write_random_checkpoint(config(layers), root / f"ckpt{layers}", seed=0)
        out = root / f"export{layers}"
        result[layers] = (out, child(EXPORT.format(ckpt=str(ckpt), out=str(out)))["maxrss"])
    return result


def test_random_checkpoint_cut_is_a_prefix_of_the_full_one(tmp_path):
    from mla_deploy.checkpoint import Checkpoint

    short = Checkpoint(write_random_checkpoint(config(1), tmp_path / "one", seed=3))
    full = Checkpoint(write_random_checkpoint(config(2), tmp_path / "two", seed=3))
    assert set(short.names()) < set(full.names()) and set(full.names()) == set(expected_tensors(full.config))
    for name in short.names():
        assert (short.tensor(name) == full.tensor(name)).all(), name


def test_export_peak_rss_grows_by_less_than_one_layer_from_n_to_4n_layers(exports):
    (_, small), (_, large) = exports[N], exports[4 * N]
    one_layer = layer_bytes(4 * N)
    assert one_layer > 24 * MiB  # the bound below must be able to fail: holding the model costs 3N layers
    growth = large - small
    print(f"export peak RSS: {small / MiB:.0f} MiB ({N} layers), {large / MiB:.0f} MiB ({4 * N} layers), "
          f"one layer {one_layer / MiB:.0f} MiB")
    assert growth < one_layer + 16 * MiB, f"peak RSS grew {growth / MiB:.0f} MiB for {3 * N} more layers"


@pytest.mark.parametrize("prepack, bound", [(False, (0.5, 1.15))])
def test_runtime_holds_the_weights_once(exports, prepack, bound):
    """PSS after load, a prefill and decode steps: its growth from N to 4N layers per byte of weights.bin growth."""
    (small_dir, _), (large_dir, _) = exports[N], exports[4 * N]
    small, large = (child(RUN.format(out=str(d), prepack=prepack)) for d in (small_dir, large_dir))
    weights = (large_dir / "weights.bin").stat().st_size - (small_dir / "weights.bin").stat().st_size
    ratio = (large["after"]["pss"] - small["after"]["pss"]) / weights
    print(f"prepack={prepack}: resident growth / weights growth = {ratio:.3f}")
    assert bound[0] < ratio <= bound[1]
    assert large["loaded"]["anonymous"] - small["loaded"]["anonymous"] < weights / 4  # nothing copied at load


# DeepSeek-V2-Lite's structure at half its width (64 experts of 704, hidden 1024, vocab 25600), 2 layers: a 0.9 GB
# float32 checkpoint whose quantized exports hold 0.19 (int4) and 0.28 GB (int8) of weights, so that what loading
# copies is measured against weights far larger than a session's own bookkeeping (~4 MB)
HALF_V2 = dict(hidden_size=1024, intermediate_size=5472, moe_intermediate_size=704, vocab_size=25600,
               max_position_embeddings=4096)

LOAD = """
import json
from mla_deploy.runtime import ExportedModel, Generator, RuntimeOptions, SamplingParams
from mla_deploy.runtime.memory import resident_memory
before = resident_memory()
model = ExportedModel({out!r})
Generator(model, SamplingParams(), stop_token_ids=()).generate([list(range(3, 40)), list(range(50, 60))], 3)
print(json.dumps({{"before": before.to_dict(), "loaded": model.load_memory.to_dict(), "prepack": model.prepack}}))
"""


@pytest.fixture(scope="module")
def quantized_exports(tmp_path_factory):
    from mla_deploy.export import ExportOptions, export

    root = tmp_path_factory.mktemp("quantized-memory")
    raw = {**preset_config("v2lite-2L"), **HALF_V2}
    raw.pop("rope_scaling")
    ckpt = write_random_checkpoint(raw, root / "ckpt", seed=0)
    built = {}
    for name, options in (("int4", dict(quantize="int4")), ("int8", dict(quantize="int8")),
                          ("int4 onnxruntime", dict(quantize="int4", quantized_ops="onnxruntime"))):
        built[name] = root / name.replace(" ", "-")
        export(ckpt, built[name], ExportOptions(**options))
    return built


@pytest.mark.parametrize("name, bound", [("int4", (0, 0.1)), ("int8", (0, 0.1)), ("int4 onnxruntime", (1.0, 3.0))])
def test_quantized_exports_hold_one_copy_of_their_weights(quantized_exports, name, bound):
    """Both graphs loaded (by default options) and a generation run: the anonymous memory loading added, per byte of
    weights.bin, is at most 0.1 for mla-deploy's quantized kernels, which read the mapped file where it lies (both
    sessions share its pages); onnxruntime's MatMulNBits / QMoE, prepacked by default, copy every weight once per
    session."""
    out = quantized_exports[name]
    measured = child(LOAD.format(out=str(out)))
    weights = (out / "weights.bin").stat().st_size
    ratio = (measured["loaded"]["anonymous"] - measured["before"]["anonymous"]) / weights
    print(f"{name}: anonymous memory added by loading both graphs / weights.bin = {ratio:.3f} "
          f"({weights / MiB:.0f} MiB of weights)")
    assert measured["prepack"] == (name == "int4 onnxruntime")
    assert bound[0] <= ratio <= bound[1]


def _mapping_rss(start: int) -> int:
    """Resident bytes of this process's mapping starting at `start` (/proc/self/smaps)."""
    lines = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        if line.split("-", 1)[0] == f"{start:x}":
            for field in lines[i + 1:]:
                if field.startswith("Rss:"):
                    return int(field.split()[1]) * 1024
    raise AssertionError(f"no mapping at {start:x}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and madvise are Linux's")
def test_populate_maps_every_page_of_the_files_mappings(tmp_path):
    """runtime.populate: a fresh read-only mapping of a file has no page mapped until one is read; populate maps
    them all, and leaves other files' mappings alone."""
    import mmap

    from mla_deploy.runtime.populate import mappings, populate

    size = 8 * MiB
    files = [tmp_path / "weights.bin", tmp_path / "other.bin"]
    for f in files:
        f.write_bytes(bytes(range(256)) * (size // 256))
    handles = [open(f, "rb") for f in files]
    maps = [mmap.mmap(h.fileno(), size, prot=mmap.PROT_READ) for h in handles]
    try:
        (start, end), = mappings(files[0])
        (other, _), = mappings(files[1])
        assert end - start == size
        assert _mapping_rss(start) == 0 and _mapping_rss(other) == 0
        assert populate(files[0], skip=frozenset({(start, end)})) == 0 and _mapping_rss(start) == 0
        assert populate(files[0]) == size
        assert _mapping_rss(start) == size and _mapping_rss(other) == 0
        assert populate(tmp_path / "not-mapped.bin") == 0
    finally:
        for m, h in zip(maps, handles):
            m.close()
            h.close()


def test_fits_in_memory_reads_memavailable(tmp_path):
    from mla_deploy.runtime.populate import fits_in_memory

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:    1000000 kB\n")
    assert fits_in_memory(1000000 * 1024, str(meminfo)) and not fits_in_memory(1000000 * 1024 + 1, str(meminfo))
    assert not fits_in_memory(1, str(tmp_path / "missing"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and madvise are Linux's")
def test_a_loaded_export_has_its_weights_mapped_unless_asked_not_to(exports):
    """By default (a file that fits in the memory available) both sessions' mappings of weights.bin are populated
    at load; populate=False leaves them to be faulted in as steps read them."""
    from mla_deploy.runtime import ExportedModel, RuntimeOptions
    from mla_deploy.runtime.populate import mappings

    out = exports[N][0]
    model = ExportedModel(out)
    spans = mappings(out / "weights.bin")
    assert model.populated_bytes == sum(end - start for start, end in spans) > 0
    assert all(_mapping_rss(start) == end - start for start, end in spans)
    loaded = model.populated_bytes
    model.load("verify")  # a graph loaded later: its session's mappings alone, the others' not again
    added = set(mappings(out / "weights.bin")) - set(spans)
    assert added and model.populated_bytes - loaded == sum(end - start for start, end in added)
    assert all(_mapping_rss(start) == end - start for start, end in added)
    assert ExportedModel(out, RuntimeOptions(populate=False)).populated_bytes == 0
