"""One prompt in, a streamed completion out: the glue `mla-deploy run` and simple apps use. Torch-free."""

from __future__ import annotations

import time
from typing import Callable, Sequence

from ..errors import InputError
from .chain import StagedExport
from .generator import Generator
from .healing import HealedText, heal
from .pipeline import PipelineGenerator
from .sampling import SamplingParams
from .session import ExportedModel
from .speculative import Speculation
from .stop import StopStrings
from .text import TextStream, Tokenizer


def complete(model: ExportedModel | StagedExport, prompt: str | None = None, prompt_ids: list[int] | None = None,
             max_new_tokens: int = 64, sampling: SamplingParams | None = None,
             on_text: Callable[[str], None] | None = None, speculation: Speculation | None = None,
             token_healing: bool = True, stop: Sequence[str] = ()) -> dict:
    """Generate from text (needs the export's tokenizer) or ids; `on_text` receives text as it is generated.
    sampling defaults to the export's generation_config.json (model.generation); speculation to off. A staged
    export's stages (runtime.chain, runtime.stages) generate through runtime.pipeline, without speculation.
    token_healing (text prompts): a prompt ending part-way through a token, such as `def `, is fed without its last
    token and the completion's first token starts with that token's text (runtime.healing); the text streamed and
    returned is what follows the prompt either way.
    stop: strings that end the completion where its text first holds one (the text stops before it; the tokens keep
    the one that completed it, and `stop_reason` names it: vLLM's); the export's stop token ids end it as well."""
    tokenizer = Tokenizer.from_export(model.directory, model.manifest)
    if (prompt is None) == (prompt_ids is None):
        raise InputError("give exactly one of a text prompt or prompt token ids")
    stop = check_stop_strings(stop)
    if stop and tokenizer is None:
        raise InputError(f"{model.directory}: this export has no tokenizer, so no text to find a stop string in")
    if prompt is not None:
        if tokenizer is None:
            raise InputError(f"{model.directory}: this export has no tokenizer; pass token ids (--prompt-ids)")
        prompt_ids = tokenizer.encode(prompt)
    healing = (heal(tokenizer, prompt_ids, model.config.vocab_size) if prompt is not None and token_healing
               else None)
    if healing is not None:
        prompt_ids = healing.prompt_ids
    stream = TextStream(tokenizer) if tokenizer is not None else None
    if stream is not None and healing is not None:
        stream = HealedText(stream, healing.text)
    generator = (Generator(model, sampling, speculation=speculation) if isinstance(model, ExportedModel)
                 else PipelineGenerator(model, sampling))
    generator.check_prompts([prompt_ids], max_new_tokens)  # every option checked before anything is printed
    if on_text is not None and prompt is not None:
        on_text(prompt)  # the prompt first, then the completion as it is generated
    stops, pieces = StopStrings(stop), []

    def emit(piece: str) -> None:
        pieces.append(piece)
        if on_text is not None and piece:
            on_text(piece)

    t0 = time.perf_counter()
    steps = generator.stream([prompt_ids], max_new_tokens, None if healing is None else healing.allowed[None])
    ended = None
    while True:
        try:
            step = steps.send(ended)
        except StopIteration as done:
            result = done.value
            break
        if stream is not None and step.tokens[0] is not None:
            emit(stops.push(stream.push(step.tokens[0])))
            ended = [0] if stops.stopped else None  # the row ends at this token
    if stream is not None:  # what a token cut off mid-character held back (the pieces join to the decoded text)
        emit(stops.push(stream.flush()))
        emit(stops.flush())
    out = {
        "prompt_ids": list(prompt_ids), "token_ids": result.token_ids[0],
        "finish_reason": "stop" if stops.stopped else result.finish_reasons[0],
        "prefill_ms": round(result.prefill_ms, 3), "decode_tokens_per_s": round(result.decode_tokens_per_s, 2),
        "total_ms": round((time.perf_counter() - t0) * 1e3, 3),
        "speculation": None if result.speculation is None else {
            "mode": generator.speculation.mode, "draft_tokens": generator.speculation.draft_tokens,
            **result.speculation.to_dict()},
    }
    if healing is not None:
        out["token_healing"] = healing.to_dict()
    if stop:
        out["stop_reason"] = stops.found
    if tokenizer is not None:
        out["text"] = "".join(pieces)
    return out


def check_stop_strings(stop) -> list[str]:
    """A list of non-empty strings, or an InputError naming what is not one."""
    stop = [stop] if isinstance(stop, str) else list(stop or ())
    for s in stop:
        if not isinstance(s, str) or not s:
            raise InputError(f"stop string {s!r}: must be non-empty text")
    return stop
