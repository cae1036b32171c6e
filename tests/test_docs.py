"""The documentation holds what it claims: README.md's figures are what scripts/readme_figures.py renders from
benchmarks/results, every relative link resolves, every docs page dates its figures, every command-line option is
documented, and no page speaks of how it was written."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

# How a page would speak of its own writing: periods of work and their ordinals, and words that only make sense
# against an earlier state of the project. History lives in git.
ORDINALS = r"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|\d+(?:st|nd|rd|th))"
FORBIDDEN = [
    r"\b(?:this|that|previous|last|next|earlier|later|current|working)\s+(?:session|round)s?\b",
    rf"\b{ORDINALS}\s+(?:session|round|period|iteration|sprint)s?\b",
    r"\bsessions?\s+ago\b",
    r"\bused\s+to\b",
    r"\b(?:before|after|since)\s+(?:this|that|the)\s+(?:changes?|fix|round|session)\b",
    r"\bissue\s+#?\d+",  # the tracker's numbers: say what the goal is
    r"\bhas\s+not\s+been\s+retaken\b",
    r"\bthis\s+change\b",
    r"\bno\s+longer\b",
    r"\bsince\s+fixed\b",
    r"\bso\s+far\b",
    r"\bnow\b",
    r"\btoday\b",
]


def _figures_module():
    spec = importlib.util.spec_from_file_location("readme_figures", ROOT / "scripts" / "readme_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _prose(text: str) -> str:
    """`text` without fenced code blocks (their lines blanked, so line numbers stay)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            lines.append("")
        else:
            lines.append("" if fenced else line)
    return "\n".join(lines)


def _links(text: str) -> list[str]:
    """Targets of the inline links and images in `text`'s prose, inline code left out."""
    prose = re.sub(r"`[^`\n]*`", "", _prose(text))
    return re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: its rendered text lower-cased, punctuation but hyphens and underscores
    dropped, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file, duplicates numbered as GitHub numbers them (-1, -2, ...)."""
    seen: dict[str, int] = {}
    found = set()
    for line in _prose(path.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = github_anchor(match[1])
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


def test_readme_figures_are_the_scripts_rendering():
    figures = _figures_module()
    text = README.read_text()
    assert "<!-- figures: llamacpp-summary" in text, "README.md has lost its llama.cpp summary block"
    rendered = figures.render(text)
    assert rendered == text, ("README.md's figures differ from benchmarks/results: run "
                              "`.venv/bin/python scripts/readme_figures.py --write`")


def test_summary_table_names_date_and_machine_of_each_row():
    table = _figures_module().llamacpp_summary()
    rows = [line for line in table.splitlines()[2:] if line.startswith("|")]
    assert [row.split("|")[1].strip() for row in rows] == [
        "int8 vs q8_0", "int4 vs q4_0", "int4 `--head-bits 8` vs q4_0", "int4 `--head-bits 4` vs q4_0",
        "float16 vs f16"]
    for row in rows:
        assert re.search(r"\| \d{4}-\d{2}-\d{2}, [^|]*\d+ threads", row), row


def test_summary_picks_the_latest_file_for_each_precision(tmp_path):
    figures = _figures_module()
    pair = {"llama.cpp": "q8_0", "mla_deploy": "int8",
            "ours": dict.fromkeys(("prefill_512", "decode_128", "decode_4096", "decode_16384", "batch8_128"), 2.0),
            "theirs": dict.fromkeys(("prefill_512", "decode_128", "decode_4096", "decode_16384", "batch8_128"), 1.0)}
    later = {**pair, "ours": dict.fromkeys(pair["ours"], 3.0)}
    (tmp_path / "llamacpp.json").write_text(
        f'{{"date": "2026-01-01", "cpu": "A", "threads": 2, '
        f'"pairs": [{_json(pair)}, {_json({**pair, "mla_deploy": "x"})}]}}'
    )
    (tmp_path / "llamacpp-q8_0.json").write_text(
        f'{{"date": "2026-01-01", "cpu": "B", "threads": 4, "pairs": [{_json(later)}]}}')
    chosen = figures.llamacpp_pairs(tmp_path)
    assert chosen["int8"]["machine"] == "B, 4 threads" and chosen["int8"]["ours"]["prefill_512"] == 3.0
    assert chosen["x"]["machine"] == "A, 2 threads"
    (tmp_path / "llamacpp.json").write_text(
        f'{{"date": "2026-01-02", "cpu": "A", "threads": 2, "pairs": [{_json(pair)}]}}')
    assert figures.llamacpp_pairs(tmp_path)["int8"]["date"] == "2026-01-02"
    # two runs of one day: the later by its start time, however many pairs each holds
    (tmp_path / "llamacpp.json").write_text(f'{{"date": "2026-01-02", "time": "09:30", "cpu": "A", "threads": 2, '
                                            f'"pairs": [{_json(pair)}, {_json({**pair, "mla_deploy": "x"})}]}}')
    (tmp_path / "llamacpp-q8_0.json").write_text(
        f'{{"date": "2026-01-02", "time": "08:00", "cpu": "B", "threads": 4, "pairs": [{_json(later)}]}}')
    assert figures.llamacpp_pairs(tmp_path)["int8"]["machine"] == "A, 2 threads"


def test_int4_pairs_are_named_by_their_heads_bits(tmp_path):
    """A pair that records its head's bits keeps its name; one that does not was named by its file's command, where
    "int4" held the 8-bit head and "int4-head6" the 6-bit one (int4's default)."""
    figures = _figures_module()
    pair = {"llama.cpp": "q4_0", "ours": {"decode_128": 2.0}, "theirs": {"decode_128": 1.0}}
    (tmp_path / "llamacpp-a.json").write_text(_json({"date": "2026-01-01", "pairs": [
        {**pair, "mla_deploy": "int4"}, {**pair, "mla_deploy": "int4-head6", "ours": {"decode_128": 3.0}}]}))
    chosen = figures.llamacpp_pairs(tmp_path)
    assert chosen["int4-head8"]["ours"] == {"decode_128": 2.0} and chosen["int4"]["ours"] == {"decode_128": 3.0}
    (tmp_path / "llamacpp-b.json").write_text(_json({"date": "2026-01-02", "pairs": [
        {**pair, "mla_deploy": "int4", "head_bits": 6, "ours": {"decode_128": 4.0}},
        {**pair, "mla_deploy": "int4-head8", "head_bits": 8, "ours": {"decode_128": 5.0}}]}))
    chosen = figures.llamacpp_pairs(tmp_path)
    assert chosen["int4"]["ours"] == {"decode_128": 4.0} and chosen["int4-head8"]["ours"] == {"decode_128": 5.0}


def test_gpu_row_counts_failed_verifies_and_says_what_was_not_measured(tmp_path):
    figures = _figures_module()
    rate = {"tokens_per_s": 150.0}
    jobs = {"environment": {"device": "GPU X"},
            "verify m/bfloat16/fused": {"passed": True}, "verify m/float32/fused": {"passed": False},
            "verify m/int4/fused": {"error": "RuntimeError: x"},
            "decode m/bfloat16/fused batch 1 ctx 128": rate,
            "decode m/bfloat16/fused batch 1 ctx 128 cuda-graph": {"error": "Fail: control flow"},
            "peer m eager batch 1 ctx 128": {"tokens_per_s": 100.0}}
    (tmp_path / "gpu.json").write_text(_json({"updated": "2026-01-03T10:00:00+00:00", "jobs": jobs}))
    row = figures.gpu(tmp_path).splitlines()[2]
    assert row.startswith("| `m/bfloat16/fused`, GPU X | 1 of 2 exports pass | 1.50x (150 / 100) | not measured |")
    assert "2026-01-03" in row
    del jobs["peer m eager batch 1 ctx 128"]
    (tmp_path / "gpu.json").write_text(_json({"updated": "2026-01-03T10:00:00+00:00", "jobs": jobs}))
    assert "| 150 tokens/s |" in figures.gpu(tmp_path)
    jobs["peer m eager batch 1 ctx 128"] = {"tokens_per_s": 100.0}
    jobs["peer m compiled batch 1 ctx 128"] = {"tokens_per_s": 200.0}
    (tmp_path / "gpu.json").write_text(_json({"updated": "2026-01-03T10:00:00+00:00", "jobs": jobs}))
    table = figures.gpu(tmp_path).splitlines()
    assert "vs transformers bf16 eager / torch.compile |" in table[0]
    assert "| 1.50x / **0.75x** (150 / 100 / 200) |" in table[2]


def _json(value) -> str:
    import json

    return json.dumps(value)


def test_readme_is_at_most_400_lines():
    assert len(README.read_text().splitlines()) <= 400


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in _links(page.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        path = (page.parent / path_part).resolve() if path_part else page
        if not path.exists() or ROOT not in (path, *path.parents):
            broken.append(f"{target}: no such file")
        elif anchor and (path.suffix != ".md" or anchor not in anchors(path)):
            broken.append(f"{target}: no heading with anchor #{anchor}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_github_anchors():
    assert github_anchor("3. RoPE, YaRN and the cached key's layout") == "3-rope-yarn-and-the-cached-keys-layout"
    assert github_anchor("Precision: float32, float16, bfloat16, int8, int4") == \
        "precision-float32-float16-bfloat16-int8-int4"
    assert github_anchor("`serve` and `--ray-replicas`") == "serve-and---ray-replicas"
    assert github_anchor("Against [llama.cpp](https://x)") == "against-llamacpp"


@pytest.mark.parametrize("page", PAGES[1:], ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_page_states_dates_and_machines(page):
    head = "\n".join(page.read_text().splitlines()[:8])
    assert re.search(r"^Figures\b", head, re.M), f"{page.name}: no 'Figures ...' line under its title"
    assert re.search(r"\d{4}-\d{2}-\d{2}", head), f"{page.name}: its header line names no date"
    assert re.search(r"\b(?:VM|machine|CPU|EPYC|Xeon)\b", head), f"{page.name}: its header line names no machine"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_does_not_speak_of_how_it_was_written(page):
    hits = [f"line {text[:m.start()].count(chr(10)) + 1}: {m[0]!r}"
            for text in [page.read_text()] for pattern in FORBIDDEN
            for m in re.finditer(pattern, text, re.I)]
    assert not hits, f"{page.relative_to(ROOT)}: " + "; ".join(hits)


@pytest.mark.parametrize("sentence", [
    "measured this session", "the eleventh session's kernels", "in the 3rd round", "this round's figures",
    "the cache used to be copied", "after this change it is faster", "it is now the default",
    "threads no longer spin", "a bug since fixed", "two sessions ago", "the kernel before the changes above",
    "the goals of issue 27", "the figure has not been retaken",
])
def test_forbidden_phrases_catch_history(sentence):
    assert any(re.search(pattern, sentence, re.I) for pattern in FORBIDDEN), sentence


@pytest.mark.parametrize("sentence", [
    "each session holds its packed copy", "codes rounded to nearest even", "4 rounds of 48 tokens",
    "one onnxruntime session per graph", "the first layer", "a second run",
])
def test_forbidden_phrases_leave_the_domain_alone(sentence):
    assert not any(re.search(pattern, sentence, re.I) for pattern in FORBIDDEN), sentence


def test_every_command_line_option_is_in_the_readme():
    import click

    from mla_deploy.cli import main

    text = README.read_text()
    missing = []
    commands = [("", main), *main.commands.items()]
    for name, command in commands:
        for param in command.params:
            if not isinstance(param, click.Option):
                continue
            names = [opt for opt in (*param.opts, *param.secondary_opts) if opt.startswith("--")]
            if names and not any(re.search(rf"{re.escape(opt)}(?![\w-])", text) for opt in names):
                missing.append(f"{name or 'mla-deploy'} {'/'.join(names)}")
    assert not missing, "README.md does not mention: " + ", ".join(missing)
