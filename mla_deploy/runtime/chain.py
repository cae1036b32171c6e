"""A staged export's stages (export --stages N) as workers: each loads only its stage and holds its own layers'
caches for every group of rows it serves; the hidden states one returns are the next one's input.

StageWorker is one stage, plain Python over onnxruntime: what a Ray actor runs on another host (runtime.stages).
StageChain runs every stage's worker in this process, one after another: `verify` checks a staged export with it,
and runtime.pipeline generates over it as over the Ray actors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Hashable

import numpy as np

from .. import io_spec
from ..errors import ExportLoadError, InputError
from ..manifest import cache_format, is_staged, read_manifest, read_stage
from .cache import CacheBuffers
from .chat import GenerationDefaults
from .memory import resident_memory
from .session import ExportedModel, RuntimeOptions


class StageWorker:
    """One stage's sessions and, per group of rows (a generation, or a micro-batch of one), its layers' caches."""

    def __init__(self, directory: str | Path, options: RuntimeOptions | None = None,
                 model_class: type[ExportedModel] = ExportedModel):
        self.model = model_class(directory, options)
        self.stage = self.model.stage
        self.groups: dict[Hashable, CacheBuffers] = {}

    def open(self, key: Hashable, rows: int) -> None:
        """Hold caches of `rows` rows for group `key` (a scheduler's fixed set of rows, whose steps cover some of
        them); a group a step meets first is opened with that step's rows."""
        model = self.model
        self.groups[key] = CacheBuffers(model.config, rows, 1, model.max_seq_len, model.device, model.cache_format,
                                        self.stage.layers, resident=model.resident_caches)

    def step(self, key: Hashable, kind: str, new: np.ndarray, positions: np.ndarray, write: np.ndarray,
             logits_positions: np.ndarray | None = None, rows: tuple[int, int] | None = None) -> np.ndarray:
        """Run the `kind` graph for group `key` over `new` (token ids [b, T] for the first stage, the stage before's
        hidden states [b, T, d] for the others) at `positions` [b, T], writing each row's T entries from slot
        write[b] of this stage's caches (rows (lo, hi) of the group's: b = hi - lo; default all of them). Returns
        the hidden states [b, T, d], or, from the last stage, the logits: [b, vocab] of the one new token (decode)
        or at `logits_positions` [b] (prefill), [b, n, vocab] at `logits_positions` [b, n]."""
        b, t = positions.shape
        if key not in self.groups:
            self.open(key, b)
        caches = self.groups[key]
        lo, hi = rows if rows is not None else (0, caches.batch)
        if hi - lo != b or not 0 <= lo < hi <= caches.batch:
            raise InputError(f"stage {self.stage.index}: group {key!r} holds {caches.batch} rows, the step has {b} "
                             f"(rows {lo}-{hi - 1})")
        caches.ensure(int((write + t).max()))
        session = self.model.sessions[kind]
        binding = session.io_binding()
        binding.bind_cpu_input(io_spec.INPUT_IDS if self.stage.first else io_spec.HIDDEN_STATES,
                               np.ascontiguousarray(new))
        binding.bind_cpu_input(io_spec.POSITION_IDS, np.ascontiguousarray(positions, np.int64))
        binding.bind_cpu_input(io_spec.ATTENTION_MASK, np.ones((b, caches.capacity), np.int64))
        binding.bind_cpu_input(io_spec.WRITE_INDICES, np.ascontiguousarray(write, np.int64))
        every = logits_positions is not None and np.ndim(logits_positions) == 2
        if self.stage.last and kind == io_spec.PREFILL:
            binding.bind_cpu_input(io_spec.LOGITS_POSITIONS,
                                   np.asarray(logits_positions, np.int64).reshape(b, -1 if every else 1))
        binding.bind_output(io_spec.LOGITS if self.stage.last else io_spec.HIDDEN_STATES_OUT, "cpu")
        held = caches.bind(binding, slice(lo, hi))
        session.run_with_iobinding(binding)
        del held
        out = binding.get_outputs()[0].numpy()
        return out if not self.stage.last or every else out[:, 0]  # logits [b, 1, vocab] -> [b, vocab]

    def clear_row(self, key: Hashable, row: int) -> None:
        """Every slot of group `key`'s row `row` zeroed (CacheBuffers.clear_row): a row whose request failed on
        unusable logits may hold NaN, which its next request's attention would sum even where masked."""
        self.groups[key].clear_row(row)

    def close(self, key: Hashable) -> None:
        """Free the group's caches (a finished generation)."""
        self.groups.pop(key, None)

    def describe(self) -> dict:
        """The stage's layers, its weights' bytes and this process's resident memory (the host a stage runs on)."""
        memory = resident_memory()
        return {"index": self.stage.index, "layers": [self.stage.first_layer, self.stage.end_layer - 1],
                "weights_bytes": int(self.model.manifest["weights"]["bytes"]),
                "rss_bytes": None if memory is None else memory.rss, "groups": len(self.groups)}


class StagedExport:
    """What a driver of a staged export reads from its manifest: config, length, generation defaults, stage dirs."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.manifest = read_manifest(self.directory)
        if not is_staged(self.manifest):
            raise ExportLoadError(f"{self.directory}: not a staged export (export --stages N); load it with "
                                  "ExportedModel")
        self.config = self.manifest["config_obj"]
        self.max_seq_len = int(self.manifest["max_seq_len"])
        self.cache_format = cache_format(self.manifest)
        self.cache_dtype = self.cache_format.latent
        self.generation = GenerationDefaults.from_export(self.directory)
        self.stop_token_ids: tuple[int, ...] = self.generation.eos_token_ids or tuple(self.config.eos_token_id)
        self.stage_dirs = [read_stage(self.directory, self.manifest, i)[0] for i in range(len(self.manifest["stages"]))]


class StageChain(StagedExport):
    """Every stage's worker in this process: `forward` passes one group's step through them in order."""

    def __init__(self, directory: str | Path, options: RuntimeOptions | None = None,
                 model_class: type[ExportedModel] = ExportedModel):
        """`model_class`: how each stage loads (verify's exact form, for one)."""
        super().__init__(directory)
        self.workers = [StageWorker(d, options, model_class) for d in self.stage_dirs]

    def open(self, key: Hashable, rows: int) -> None:
        """Caches of `rows` rows for group `key` on every stage (StageWorker.open)."""
        for worker in self.workers:
            worker.open(key, rows)

    def forward(self, key: Hashable, kind: str, new: np.ndarray, positions: np.ndarray, write: np.ndarray,
                logits_positions: np.ndarray | None = None, rows: tuple[int, int] | None = None) -> np.ndarray:
        """One step of group `key` (its rows `rows`) through every stage: the last stage's logits."""
        for worker in self.workers:
            new = worker.step(key, kind, new, positions, write, logits_positions, rows)
        return new

    @property
    def has_draft(self) -> bool:
        return False  # a staged export holds prefill and decode graphs only

    def has_graph(self, kind: str) -> bool:
        return kind in (io_spec.PREFILL, io_spec.DECODE)

    def resolve(self, handle: np.ndarray) -> np.ndarray:
        return handle  # in this process a step's result is at hand (runtime.stages: a Ray object ref)

    def clear_row(self, key: Hashable, row: int) -> None:
        """Group `key`'s row `row` zeroed on every stage (StageWorker.clear_row)."""
        for worker in self.workers:
            worker.clear_row(key, row)

    def close(self, key: Hashable) -> None:
        for worker in self.workers:
            worker.close(key)

    def run(self, kind: str, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A feed of the whole model's graph (input_ids, every layer's caches) through the stages' graphs in order:
        the whole graph's outputs (logits, every layer's present caches). One-off calls, as ExportedModel.run."""
        outputs: dict[str, np.ndarray] = {}
        hidden = None
        for worker in self.workers:
            inputs, _ = worker.model.graph_io(kind)
            result = worker.model.run(kind, {s.name: hidden if s.name == io_spec.HIDDEN_STATES else feed[s.name]
                                             for s in inputs})
            hidden = result.pop(io_spec.HIDDEN_STATES_OUT, None)
            outputs.update(result)
        return outputs
