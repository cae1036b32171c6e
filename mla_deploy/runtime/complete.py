"""One prompt in, a streamed completion out: the glue `mla-deploy run` and simple apps use. Torch-free."""

from __future__ import annotations

import time
from typing import Callable

from ..errors import InputError
from .generator import Generator
from .sampling import SamplingParams
from .session import ExportedModel
from .speculative import Speculation
from .text import TextStream, Tokenizer


def complete(model: ExportedModel, prompt: str | None = None, prompt_ids: list[int] | None = None,
             max_new_tokens: int = 64, sampling: SamplingParams | None = None,
             on_text: Callable[[str], None] | None = None, speculation: Speculation | None = None) -> dict:
    """Generate from text (needs the export's tokenizer) or ids; `on_text` receives text as it is generated.
    sampling defaults to the export's generation_config.json (model.generation); speculation to off."""
    tokenizer = Tokenizer.from_export(model.directory, model.manifest)
    if (prompt is None) == (prompt_ids is None):
        raise InputError("give exactly one of a text prompt or prompt token ids")
    if prompt is not None:
        if tokenizer is None:
            raise InputError(f"{model.directory}: this export has no tokenizer; pass token ids (--prompt-ids)")
        prompt_ids = tokenizer.encode(prompt)
    stream = TextStream(tokenizer) if tokenizer is not None else None
    generator = Generator(model, sampling, speculation=speculation)
    generator.check_prompts([prompt_ids], max_new_tokens)  # every option checked before anything is printed
    if on_text is not None and prompt is not None:
        on_text(prompt)  # the prompt first, then the completion as it is generated
    t0 = time.perf_counter()
    steps = generator.stream([prompt_ids], max_new_tokens)
    while True:
        try:
            step = next(steps)
        except StopIteration as done:
            result = done.value
            break
        if stream is not None and on_text is not None and step.tokens[0] is not None:
            on_text(stream.push(step.tokens[0]))
    out = {
        "prompt_ids": list(prompt_ids), "token_ids": result.token_ids[0], "finish_reason": result.finish_reasons[0],
        "prefill_ms": round(result.prefill_ms, 3), "decode_tokens_per_s": round(result.decode_tokens_per_s, 2),
        "total_ms": round((time.perf_counter() - t0) * 1e3, 3),
        "speculation": None if result.speculation is None else {
            "mode": generator.speculation.mode, "draft_tokens": generator.speculation.draft_tokens,
            **result.speculation.to_dict()},
    }
    if tokenizer is not None:
        out["text"] = tokenizer.decode(result.token_ids[0])
    return out
