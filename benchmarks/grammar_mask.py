"""Per-token mask cost of the JSON-schema grammar libraries on one tokenizer (default: the demo's 4096 tokens).

For each schema of json_schemas.py, each library compiles the schema, then replays the tokens of a valid document:
before each token it computes the allowed-token mask (the timed part), checks the token is allowed, and consumes
it. Prints compile time and mask time per token (mean, median, 99th percentile) per library, side by side.
Libraries not installed are skipped: llguidance (the serve extra's), outlines-core, xgrammar (needs torch).

    flock /tmp/mla-cpu.lock python benchmarks/grammar_mask.py \
        [--tokenizer mla_deploy/models/demo/tokenizer.json] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from json_schemas import DOCUMENTS, SCHEMAS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def byte_level_vocab(tokenizer_json: Path) -> list[bytes]:
    """Each token id's bytes, from a byte-level BPE tokenizer.json (GPT-2's byte-to-character table reversed)."""
    from mla_deploy.runtime.text import Tokenizer

    tok = Tokenizer(tokenizer_json)
    return [tok.token_bytes(i) for i in range(tok.vocab_size)]


class LLGuidance:
    name = "llguidance"

    def __init__(self, path: Path, vocab: int, eos: int):
        import llguidance
        import llguidance.numpy as llnp

        self.ll, self.llnp = llguidance, llnp
        self.tokenizer = llguidance.LLTokenizer(str(path), n_vocab=vocab, eos_token=eos)
        self.mask = llnp.allocate_token_bitmask(1, vocab)

    def compile(self, schema: dict):
        from mla_deploy.runtime.grammar import JSON_OPTIONS  # the server's settings

        return self.ll.LLMatcher(
            self.tokenizer, self.ll.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        )

    def fill(self, matcher) -> np.ndarray:
        self.llnp.fill_next_token_bitmask(matcher, self.mask, 0)
        return self.mask[0]

    def allowed(self, mask, token: int) -> bool:
        return bool(mask[token // 32] >> (token % 32) & 1)

    def consume(self, matcher, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, path: Path, vocab: int, eos: int):
        import outlines_core

        self.oc = outlines_core
        table: dict[bytes, list[int]] = {}
        for i, b in enumerate(byte_level_vocab(path)):
            if i != eos and b:
                table.setdefault(b, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos, table)
        self.vocab = vocab
        self.mask = np.zeros((vocab + 31) // 32, np.int32)

    def compile(self, schema: dict):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Guide(self.oc.Index(regex, self.vocabulary))

    def fill(self, guide) -> np.ndarray:
        guide.write_mask_into(self.mask.ctypes.data, self.mask.size, self.mask.itemsize)
        return self.mask

    def allowed(self, mask, token: int) -> bool:
        return bool(mask[token // 32] >> (token % 32) & 1)

    def consume(self, guide, token: int) -> None:
        guide.advance(token)


class XGrammar:
    name = "xgrammar"

    def __init__(self, path: Path, vocab: int, eos: int):
        import xgrammar

        self.xg = xgrammar
        raw = json.loads(path.read_text())["model"]["vocab"]  # byte-level token strings, as tokenizer.json holds them
        encoded = [""] * vocab
        for token, i in raw.items():
            encoded[i] = token
        info = xgrammar.TokenizerInfo(encoded, xgrammar.VocabType.BYTE_LEVEL, vocab_size=vocab, stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info)
        self.mask = xgrammar.allocate_token_bitmask(1, vocab)

    def compile(self, schema: dict):
        grammar = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                    separators=(", ", ": "))
        return self.xg.GrammarMatcher(grammar)

    def fill(self, matcher):
        matcher.fill_next_token_bitmask(self.mask, 0)
        return self.mask[0]

    def allowed(self, mask, token: int) -> bool:
        return bool(int(mask[token // 32]) >> (token % 32) & 1)

    def consume(self, matcher, token: int) -> None:
        assert matcher.accept_token(token)


def measure(lib, tokenizer, repeat: int) -> dict:
    compile_ms, mask_us = {}, []
    for name, schema in SCHEMAS.items():
        ids = tokenizer.encode(json.dumps(DOCUMENTS[name], ensure_ascii=False), add_special_tokens=False)
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            matcher = lib.compile(schema)
            times.append((time.perf_counter() - t0) * 1e3)
            for token in ids:
                t0 = time.perf_counter()
                mask = lib.fill(matcher)
                mask_us.append((time.perf_counter() - t0) * 1e6)
                assert lib.allowed(mask, token), f"{lib.name}: {name}: token {token} refused"
                lib.consume(matcher, token)
        compile_ms[name] = float(np.median(times))
    us = np.array(mask_us)
    return {"compile_ms": compile_ms, "mask_us_mean": float(us.mean()), "mask_us_median": float(np.median(us)),
            "mask_us_p99": float(np.percentile(us, 99)), "tokens": len(us)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", type=Path, default=ROOT / "mla_deploy/models/demo/tokenizer.json")
    parser.add_argument("--eos", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    from tokenizers import Tokenizer as HFTokenizer

    class Encode:
        def __init__(self):
            self.tok = HFTokenizer.from_file(str(args.tokenizer))

        def encode(self, text, add_special_tokens):
            return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    tokenizer = Encode()
    vocab = tokenizer.tok.get_vocab_size()
    results = {}
    for cls in (LLGuidance, OutlinesCore, XGrammar):
        try:
            t0 = time.perf_counter()
            lib = cls(args.tokenizer, vocab, args.eos)
            setup_ms = (time.perf_counter() - t0) * 1e3
        except ImportError as e:
            print(f"{cls.name}: not installed ({e})")
            continue
        results[cls.name] = {"tokenizer_setup_ms": setup_ms, **measure(lib, tokenizer, args.repeat)}
    print(f"vocabulary {vocab} tokens, {len(SCHEMAS)} schemas, {args.repeat} replays each")
    print(f"{'library':<15}{'setup ms':>10}{'mask us mean':>14}{'median':>9}{'p99':>9}  compile ms per schema")
    for name, r in results.items():
        compiled = " ".join(f"{k} {v:.1f}" for k, v in r["compile_ms"].items())
        print(f"{name:<15}{r['tokenizer_setup_ms']:>10.1f}{r['mask_us_mean']:>14.1f}{r['mask_us_median']:>9.1f}"
              f"{r['mask_us_p99']:>9.1f}  {compiled}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
