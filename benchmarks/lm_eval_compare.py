"""lm-evaluation-harness on an export through `mla-deploy serve` against the same tasks on the torch checkpoint
through lm-eval's own `hf` backend (transformers' DeepseekV3ForCausalLM, offline), side by side:

1. demo_next_line (multiple choice, benchmarks/lm_eval): accuracy of each, and every loglikelihood compared
   (max |difference|, greedy flags that agree);
2. demo_complete_line (generation, until a newline): exact match of each; the served run must reach the end.

Both run with --batch_size 4 and a BOS token before each context (the demo's tokenizer adds one; lm-eval's hf
backend follows the tokenizer, local-completions needs add_bos_token=True). Run from the repository root:

    flock /tmp/mla-cpu.lock .venv/bin/python benchmarks/lm_eval_compare.py out/demo \
        [--checkpoint mla_deploy/models/demo]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from serve_load import MODEL, start_server  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "benchmarks/lm_eval"


def lm_eval(model: str, model_args: str, task: str, out: Path, extra: list[str] = ()) -> tuple[dict, list, float]:
    """Runs the lm_eval command; returns (the task's metrics, its logged samples, seconds)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [str(Path(sys.executable).with_name("lm_eval")), "--model", model, "--model_args", model_args,
           "--tasks", task, "--include_path", str(TASKS), "--batch_size", "4", "--log_samples",
           "--output_path", str(out), *extra]
    t0 = time.perf_counter()
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{run.stderr[-3000:]}")
    results = json.loads(Path(sorted(glob.glob(str(out / "*" / "results_*.json")))[-1]).read_text())
    samples = [json.loads(line) for line in open(sorted(glob.glob(str(out / "*" / f"samples_{task}_*.jsonl")))[-1])]
    return results["results"][task], sorted(samples, key=lambda s: s["doc_id"]), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("export_dir")
    parser.add_argument("--checkpoint", default=str(ROOT / "mla_deploy/models/demo"))
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lm-eval-compare-"))
    proc, base = start_server(args.export_dir, 16)
    served_args = (f"model={MODEL},base_url={base}/v1/completions,tokenizer={args.checkpoint},"
                   "tokenizer_backend=huggingface,max_length=1024,add_bos_token=True")
    hf_args = f"pretrained={args.checkpoint},dtype=float32"
    try:
        mc_served, served, t_served = lm_eval("local-completions", served_args, "demo_next_line", work / "served")
        gen_served, gen_samples, t_gen = lm_eval("local-completions", served_args, "demo_complete_line",
                                                 work / "served-gen")
    finally:
        proc.terminate()
        proc.wait(10)
    mc_hf, hf, t_hf = lm_eval("hf", hf_args, "demo_next_line", work / "hf", ["--device", "cpu"])
    gen_hf, _, t_gen_hf = lm_eval("hf", hf_args, "demo_complete_line", work / "hf-gen", ["--device", "cpu"])
    diffs, greedy_agree, n = [], 0, 0
    for a, b in zip(served, hf):
        assert a["doc_id"] == b["doc_id"]
        for ra, rb in zip(a["resps"], b["resps"]):
            diffs.append(abs(float(ra[0][0]) - float(rb[0][0])))
            greedy_agree += str(ra[0][1]) == str(rb[0][1])
            n += 1
    result = {
        "multiple_choice": {"documents": len(served), "loglikelihoods": n,
                            "acc_served": mc_served["acc,none"], "acc_hf": mc_hf["acc,none"],
                            "max_abs_loglikelihood_diff": max(diffs), "greedy_flags_agree": greedy_agree,
                            "seconds_served": round(t_served, 1), "seconds_hf": round(t_hf, 1)},
        "generation": {"documents": len(gen_samples), "exact_match_served": gen_served["exact_match,none"],
                       "exact_match_hf": gen_hf["exact_match,none"], "seconds_served": round(t_gen, 1),
                       "seconds_hf": round(t_gen_hf, 1)},
    }
    mc, gen = result["multiple_choice"], result["generation"]
    print(f"demo_next_line ({mc['documents']} documents, {mc['loglikelihoods']} loglikelihoods, batch size 4)")
    print(f"  accuracy: served {mc['acc_served']:.4f}   hf on the torch checkpoint {mc['acc_hf']:.4f}")
    print(
        f"  max |loglikelihood difference| {mc['max_abs_loglikelihood_diff']:.2e}; greedy flags agree "
        f"{mc['greedy_flags_agree']}/{mc['loglikelihoods']}; {mc['seconds_served']} s served, {mc['seconds_hf']} s hf"
    )
    print(f"demo_complete_line ({gen['documents']} documents, batch size 4): exact match served "
          f"{gen['exact_match_served']:.4f}, hf {gen['exact_match_hf']:.4f}; {gen['seconds_served']} s served, "
          f"{gen['seconds_hf']} s hf")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
