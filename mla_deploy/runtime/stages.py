"""A staged export (export --stages N) over Ray (the 'ray' extra): one actor per stage, each loading only its stage's
directory and holding its layers' caches for every sequence, on whichever node of the cluster has room, or, where
nodes offer the stages' resources (stage_resource: `ray start --resources '{"mla_stage_1": 1}'` pins stage 1 to that
host), each on the node that offers its own. A step's hidden states go from one actor to the next as a Ray object
ref, never through the driver.

    model = StagedModel("out/", address="auto")          # join a running cluster; None starts a local one
    result = PipelineGenerator(model, micro_batches=2).generate(prompts, 64)
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from dataclasses import replace
from pathlib import Path
from typing import Hashable

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from ..errors import MLADeployError, StageFailedError
from .chain import StagedExport, StageWorker
from .session import RuntimeOptions

LOAD_TIMEOUT_S = 600.0  # a stage that is not placed and loaded by then: the cluster lacks what it asks for
CONNECT_TIMEOUT_S = 5.0  # a cluster address that accepts no connection by then is refused (Ray itself retries minutes)


HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(3) + b"\x04" + bytes(5)  # and an empty SETTINGS frame
RESOLVED_BY_RAY = ("auto", "local")


def unreachable(address: str | None, timeout_s: float = CONNECT_TIMEOUT_S) -> str | None:
    """Why no Ray cluster answers at `address` (else RAY_ADDRESS) as an error message naming where the address came
    from: not of the form [ray://]HOST:PORT, auto or local; nothing listening; or a server that is no gRPC one (Ray's
    GCS and client server speak gRPC, which answers HTTP/2's preface with a SETTINGS frame: the dashboard's port, an
    HTTP server, would keep Ray retrying for minutes). None when it answers as Ray does, or for auto and local (Ray
    resolves those itself, and says at once where none runs)."""
    given = address or os.environ.get("RAY_ADDRESS") or ""
    if not given or given in RESOLVED_BY_RAY:
        return None
    host, sep, port = given.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        source = "--ray-address" if address else "RAY_ADDRESS"
        return (f"{source} {given}: expected HOST:PORT (the head's GCS port, ray start --port), ray://HOST:PORT, "
                "auto or local")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as connection:
            if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
                return None  # a TLS cluster answers the preface only after the handshake Ray makes
            connection.sendall(HTTP2_PREFACE)
            reply = connection.recv(9)
    except socket.timeout:
        return no_cluster(address, f"no answer within {timeout_s:g} s")
    except OSError as e:
        return no_cluster(address, e.strerror or str(e))
    if len(reply) < 4 or reply[3] != 0x04:
        return no_cluster(address, "it answers, but not as Ray's gRPC port does: give the head's GCS port (ray start "
                                   "--port, 6379 by default) or its client port (ray://HOST:10001), not the "
                                   "dashboard's (8265)")
    return None


def no_cluster(address: str | None, why: str) -> str:
    """The error for a cluster that did not answer at `address` (else RAY_ADDRESS), naming where it came from."""
    source = "--ray-address" if address else "RAY_ADDRESS"
    return (f"{source} {address or os.environ.get('RAY_ADDRESS')}: no Ray cluster answered ({why}); start one (ray "
            f"start --head) or leave {source} out to run a local one")


def stage_resource(index: int) -> str:
    """The custom Ray resource that pins stage `index` to the nodes offering it."""
    return f"mla_stage_{index}"


class _StageActor(StageWorker):
    def __init__(self, directory: str, options: RuntimeOptions):
        """A stage that cannot load keeps its error for node() to raise: raised here, Ray gives the driver an
        ActorDiedError holding it as text alone, where a method's error arrives whole (RayTaskError.cause)."""
        self.load_error: MLADeployError | None = None
        try:
            super().__init__(directory, options)
        except MLADeployError as e:
            self.load_error = e

    def node(self) -> dict:
        """Where this stage runs, and how much memory its process holds there."""
        if self.load_error is not None:
            raise self.load_error
        context = ray.get_runtime_context()
        return {**self.describe(), "node_id": context.get_node_id(), "pid": os.getpid()}


class StagedModel(StagedExport):
    """The stages of a staged export as Ray actors, driven as runtime.chain.StageChain is (runtime.pipeline)."""

    def __init__(self, directory: str | Path, options: RuntimeOptions | None = None, address: str | None = None,
                 load_timeout_s: float = LOAD_TIMEOUT_S):
        """`address`: a running cluster's ('auto': the one on this host); None starts a local Ray instance (or uses
        the one this process already joined). `options.threads` 0: the cluster's CPUs shared out over the stages."""
        super().__init__(directory)
        options = options or RuntimeOptions()
        options.validate()  # before a Ray instance starts
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            problem = unreachable(address)
            if problem:
                raise StageFailedError(problem)
            terminate = signal.getsignal(signal.SIGTERM)
            try:
                ray.init(address=address, include_dashboard=False, log_to_driver=False)
            except (ConnectionError, ValueError) as e:  # auto with no cluster here; an address Ray cannot read
                raise StageFailedError(no_cluster(address, str(e))) from None
            if callable(terminate) and threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, terminate)  # the caller's (the CLI's clean stop), not Ray's crash report
        resources = ray.cluster_resources()
        count = len(self.stage_dirs)
        if options.threads == 0:
            options = replace(options, threads=max(1, int(resources.get("CPU", 1)) // count))
        share = min(1.0, resources.get("CPU", 1) / count)  # more stages than CPUs (a test) still all start
        self.actors = []
        # a cluster whose nodes offer any stage's resource pins every stage (one whose node has yet to join waits)
        pinned = any(stage_resource(i) in resources for i in range(count))
        for index, stage_dir in enumerate(self.stage_dirs):
            placement = {stage_resource(index): 1} if pinned else {}
            actor = ray.remote(_StageActor).options(num_cpus=share, resources=placement, max_restarts=0,
                                                    max_task_retries=0, name=None)
            self.actors.append(actor.remote(str(Path(stage_dir).resolve()), options))
        try:
            self.placement = ray.get([a.node.remote() for a in self.actors], timeout=load_timeout_s)
        except GetTimeoutError:
            self.shutdown()
            raise StageFailedError(f"{self.directory}: the stages were not all placed and loaded within "
                                   f"{load_timeout_s:.0f} s: each needs a share of a CPU, and stage i the resource "
                                   f"'{stage_resource(0).replace('0', 'i')}' where a node offers it; the cluster has "
                                   f"{resources}") from None
        except RayTaskError as e:  # a stage that cannot load: its own error (missing file, mixed exports)
            self.shutdown()
            cause = e.cause if isinstance(getattr(e, "cause", None), Exception) else None
            raise (cause if isinstance(cause, MLADeployError) else StageFailedError(str(e).splitlines()[0])) from None
        except BaseException:  # an actor lost while loading, Ctrl-C: the other stages' actors go too
            self.shutdown()
            raise

    # ---- the chain runtime.pipeline drives ----
    def open(self, key: Hashable, rows: int) -> None:
        """Caches of `rows` rows for group `key` on every stage's actor (before any step of the group: an actor runs
        one caller's calls in order)."""
        for actor in self.actors:
            actor.open.remote(key, rows)

    def forward(self, key: Hashable, kind: str, new: np.ndarray, positions: np.ndarray, write: np.ndarray,
                logits_positions: np.ndarray | None = None, rows: tuple[int, int] | None = None):
        """One step of group `key` (its rows `rows`) through every stage's actor: an object ref to the last stage's
        logits."""
        for actor in self.actors:
            new = actor.step.remote(key, kind, new, positions, write, logits_positions, rows)
        return new

    def resolve(self, handle) -> np.ndarray:
        """The logits a step's ref names. A stage whose actor died: StageFailedError naming it, not a hang."""
        try:
            return ray.get(handle)
        except RayActorError as e:
            raise StageFailedError(f"{self._dead_stages()}: its Ray actor died ({type(e).__name__}); the sequences it "
                                   "held are lost") from None
        except RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, Exception) and not isinstance(cause, RayActorError):
                raise cause from None  # the stage's own error (an input out of range)
            raise StageFailedError(f"{self._dead_stages()}: {_first_line(e)}") from None

    def clear_row(self, key: Hashable, row: int) -> None:
        """Group `key`'s row `row` zeroed on every stage's actor, after the steps already sent to it (an actor runs
        one caller's calls in order)."""
        for actor in self.actors:
            actor.clear_row.remote(key, row)

    def close(self, key: Hashable) -> None:
        for actor in self.actors:  # a dead actor's close is never waited for
            actor.close.remote(key)

    # ---- lifetime ----
    def shutdown(self) -> None:
        """Stop the stages' actors, and Ray itself where this model started it."""
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if self.started_ray and ray.is_initialized():
            ray.shutdown()

    def __enter__(self) -> "StagedModel":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _dead_stages(self) -> str:
        dead = []
        for index, actor in enumerate(self.actors):
            try:
                ray.get(actor.describe.remote(), timeout=30)
            except (RayActorError, GetTimeoutError):
                dead.append(index)
        names = [f"stage {i} (layers {self.placement[i]['layers'][0]}-{self.placement[i]['layers'][1]})" for i in dead]
        return ", ".join(names) or "a stage"


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
