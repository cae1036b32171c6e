"""Structured output: JSON constrained by a grammar, token by token, with llguidance (the 'serve' extra).

    grammars = Grammars(tokenizer_json, vocab_size, eos_token_ids)   # once per export
    constraint = grammars.json_schema(schema)    # or grammars.json_object(); InputError if it cannot compile
    allowed_tokens([constraint, ...], vocab)     # [rows, vocab] bool: what each row may sample next
    constraint.consume(token)                    # after sampling; constraint.done once the JSON and EOS are out

llguidance computes each mask lazily from the grammar's lexer and parser state over a token trie of the
tokenizer, so compiling a schema costs well under a millisecond and a mask tens of microseconds on the demo's
4096 tokens (benchmarks/grammar_mask.py measures it beside outlines-core and xgrammar). Whitespace between JSON
tokens is json.dumps' (", " and ": ", nothing else), so a sampled document cannot grow by spaces alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import GrammarError, InputError, missing_extra

# JSON's whitespace: none but the separators json.dumps writes. A schema's own "x-guidance" options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance():
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401 - the mask helpers
    except ModuleNotFoundError as e:
        raise InputError(f"response_format {missing_extra(e.name) or 'needs llguidance: pip install llguidance'}") \
            from None
    return llguidance


class Grammars:
    """Compiles JSON grammars for one tokenizer (the export's tokenizer.json, read from disk: nothing downloaded)."""

    def __init__(self, tokenizer_json: str | Path, vocab_size: int, eos_token_ids: Sequence[int]):
        ll = _llguidance()
        eos = [int(t) for t in eos_token_ids]
        if not eos:
            raise InputError("response_format needs an end-of-sequence token id (generation_config.json eos_token_id)")
        self.tokenizer = ll.LLTokenizer(str(tokenizer_json), n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size

    def json_object(self) -> "Constraint":
        """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
        return self._compile({"type": "object"}, "json_object")

    def json_schema(self, schema: dict) -> "Constraint":
        """A JSON document valid under `schema`; InputError naming the problem when llguidance cannot compile it."""
        if not isinstance(schema, dict):
            raise InputError("json_schema.schema: expected a JSON Schema object")
        return self._compile(schema, "json_schema.schema")

    def _compile(self, schema: dict, what: str) -> "Constraint":
        ll = _llguidance()
        try:
            grammar = ll.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except (ValueError, TypeError, RuntimeError) as e:
            raise InputError(f"{what}: cannot be compiled to a grammar: {e}") from None
        error = ll.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise InputError(f"{what}: cannot be compiled to a grammar: {error}")
        matcher = ll.LLMatcher(self.tokenizer, grammar, log_level=0)  # its errors are raised, not printed
        if matcher.is_error():
            raise InputError(f"{what}: cannot be compiled to a grammar: {matcher.get_error()}")
        return Constraint(matcher)


class Constraint:
    """One request's grammar state: which tokens may come next, advanced by each sampled token."""

    def __init__(self, matcher):
        self.matcher = matcher
        self.consumed = 0  # tokens advanced by

    def consume(self, token: int) -> None:
        """Advance by the sampled `token`; GrammarError where the grammar cannot go on (llguidance gave up on it while
        generating: a request's own failure, the others running on)."""
        if self.matcher.is_error() or not self.matcher.consume_token(int(token)):
            why = self.matcher.get_error().strip().splitlines()
            raise GrammarError(f"the grammar engine gave up on the schema after {self.consumed} generated "
                               f"tokens ({why[0] if why else f'token {token} refused'}): simplify the schema")
        self.consumed += 1

    def copy(self) -> "Constraint":
        """The same grammar in its own state (one per choice of a request): llguidance's copy, not a compile."""
        return Constraint(self.matcher.deep_copy())

    @property
    def done(self) -> bool:
        """The document is complete and its end-of-sequence token consumed: nothing more may be generated."""
        return self.matcher.is_stopped()


def allowed_tokens(constraints: Sequence[Constraint | None], vocab_size: int) -> np.ndarray | None:
    """[rows, vocab] bool: each row's allowed next tokens (every token for a row without a constraint); None when
    no row has one."""
    if all(c is None for c in constraints):
        return None
    ll = _llguidance()
    bits = ll.numpy.allocate_token_bitmask(len(constraints), vocab_size)  # all ones: unconstrained rows keep them
    for row, c in enumerate(constraints):
        if c is not None:
            ll.numpy.fill_next_token_bitmask(c.matcher, bits, row)
            if c.matcher.is_error():  # given up while computing the mask: every token, and consume() says why
                bits[row] = -1
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size].astype(bool)
    return allowed
