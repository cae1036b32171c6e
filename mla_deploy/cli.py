"""The mla-deploy command line: parses arguments and calls the library. Errors: one line, non-zero exit."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path

import click

from .cli_options import (MAX_DRAFT_TOKENS, _parse_ids, _parse_ints, _parse_modes, _ray_address_option, _sampling_given,
                          _sampling_options, _session_config_option, _speculation, _speculation_options, _utf8)
from .errors import MLADeployError, install_command, missing_extra
from .presets import DEMO_CHECKPOINT


class _Cli(click.Group):
    """Turns every error into one readable line (the traceback only with --debug)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.UsageError as e:  # a bad option or argument: click's own three-line block, as one line
            command = f"mla-deploy {ctx.invoked_subcommand}" if ctx.invoked_subcommand else "mla-deploy"
            self._fail(ctx, f"error: {e.format_message().rstrip('.')}; `{command} --help` lists the options",
                       e.exit_code)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except MLADeployError as e:
            self._fail(ctx, f"error: {e}", 1)
        except KeyboardInterrupt:
            self._fail(ctx, "interrupted", 130)
        except BrokenPipeError:  # the reader of stdout closed it (`| head`): stop quietly, as a shell tool does
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # the interpreter's last flush of stdout meets no pipe
            sys.exit(141)  # 128 + SIGPIPE: what a shell reports for a writer the pipe ended
        except Exception as e:  # a missing extra, or a bug (not bad input): still one line unless --debug
            hint = missing_extra(e.name) if isinstance(e, ModuleNotFoundError) else None
            if hint is not None:
                self._fail(ctx, f"error: `mla-deploy {ctx.invoked_subcommand}` {hint}", 1)
            self._fail(ctx, f"internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback)", 2)

    @staticmethod
    def _fail(ctx, message: str, code: int):
        if ctx.obj and ctx.obj.get("debug"):
            raise
        click.echo(message, err=True)
        sys.exit(code)


def _interrupted(signum, frame):
    raise KeyboardInterrupt


def _no_staged_speculation(speculative: str) -> None:
    """run and serve refuse --speculative lookup / mtp on a staged export before anything loads (auto means: where
    the export can)."""
    if speculative in ("lookup", "mtp"):
        raise click.UsageError(f"--speculative {speculative}: a staged export (export --stages N) decodes without "
                               "speculation; leave the option out, or export without --stages")


def _progress(start=[None]):  # noqa: B006 - one clock per process
    start[0] = start[0] or time.perf_counter()
    return lambda msg: click.echo(f"[{time.perf_counter() - start[0]:7.1f}s] {msg}", err=True)


@click.group(cls=_Cli)
@click.option("--debug", is_flag=True, help="Show tracebacks on errors.")
@click.version_option(package_name="mla-deploy")
@click.pass_context
def main(ctx, debug):
    """Export MLA (DeepSeek-V2/V3) checkpoints to ONNX and run them with onnxruntime."""
    ctx.obj = {"debug": debug}
    # `kill` (SIGTERM) unwinds like Ctrl-C, so an export or preset interrupted mid-write removes its partial directory
    signal.signal(signal.SIGTERM, _interrupted)
    if not debug:  # library warnings (a provider fallback, say) as one readable line each
        warnings.showwarning = lambda message, *_: click.echo(f"warning: {message}", err=True)


@main.command()
@click.argument("checkpoint", required=False, type=click.Path(path_type=Path))
@click.option(
    "-o", "--output", "out", required=True, type=click.Path(path_type=Path), help="Export directory to create."
)
@click.option(
    "--absorb",
    type=click.Choice(["fused", "factored", "auto"]),
    default="auto",
    show_default=True,
    help="The decode graph's absorbed attention: fused W^Q·W^UK and W^UV·W^O matrices, or factored "
    "per-head W^UK / W^UV; auto picks the one with fewer weight bytes per token (computed from the config).",
)
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default="float32", show_default=True,
              help="Weights and caches (bfloat16 computes in float32 on the CPU: docs/precision.md).")
@click.option("--compute", type=click.Choice(["auto", "float32", "float16"]), default="auto", show_default=True,
              help="What the layers compute in outside their float32 islands: auto is float32 (the CPU's kernels "
                   "read half weights as stored); float16, with --dtype float16, multiplies the weights as stored in "
                   "onnxruntime's own ops, for a GPU (docs/gpu.md).")
@click.option(
    "--cache-dtype",
    type=click.Choice(["auto", "float32", "float16", "bfloat16", "int8"]),
    default="auto",
    show_default=True,
    help="The latent cache: auto stores it in --dtype; int8 stores codes with a float32 "
    "scale per token and layer, the roped key staying in --dtype (docs/long-context.md).",
)
@click.option(
    "--max-seq-len", type=click.IntRange(min=1), default=None, help="Longest sequence (default: the config's)."
)
@click.option("--no-verify", is_flag=True, help="Skip checking the export against the torch source.")
@click.option("--steps", type=click.IntRange(min=1), default=None,
              help="Teacher-forced decode steps the verification compares (after the prefill); default 8, fewer "
                   "where --max-seq-len leaves less room.")
@click.option("--quantize", type=click.Choice(["int4", "int8"]), default=None,
              help="Weight-only block-wise quantization of the MatMul weights, the embedding and the routed experts.")
@click.option("--block-size", type=click.Choice(["16", "32", "64", "128"]), default=None,
              help="Weights per quantization block (one scale each: float16 for mla-deploy's kernels). Default: 32.")
@click.option(
    "--accuracy-level",
    type=click.Choice(["0", "4"]),
    default=None,
    help="Quantized compute: 4 quantizes activations to int8 inside the kernel (fast), 0 multiplies in float. "
         "Default: 4.",
)
@click.option("--quantized-ops", type=click.Choice(["auto", "kernel", "onnxruntime"]), default="auto",
              show_default=True,
              help="The ops over quantized weights: auto (kernel) is mla-deploy's QMatMul / QGather / QRoutedExperts, "
                   "reading the weights where they lie (one copy for both graphs; stock-ONNX bodies elsewhere); "
                   "onnxruntime is its MatMulNBits / GatherBlockQuantized / QMoE, prepacked per session (CPU and "
                   "CUDA kernels of its own; docs/precision.md).")
@click.option("--head-bits", type=click.Choice(["auto", "4", "6", "8"]), default="auto", show_default=True,
              help="A quantized export's embedding and output layer: auto is 6 for int4 (as many bytes as llama.cpp's "
                   "q6_K output layer) and 8 for int8 or --quantized-ops onnxruntime; 8 loses least quality, 4 makes "
                   "the smallest file and the fastest decode (docs/precision.md).")
@click.option("--experts", type=click.Choice(["auto", "kernel", "qmoe", "moe", "branches"]), default="auto",
              show_default=True,
              help="How MoE layers run their routed experts: auto picks mla-deploy's kernel (QRoutedExperts for "
                   "quantized exports, RoutedExperts for float exports of few-expert layers), QMoE with "
                   "--quantized-ops onnxruntime, else branches (one If per expert: stock ONNX that runs anywhere, "
                   "CUDA included; docs/precision.md); moe: onnxruntime's MoE over float experts, no control flow "
                   "(for CUDA; slow on the CPU: docs/gpu.md).")
@click.option("--decode-attention", type=click.Choice(["auto", "kernel", "avx512", "ops"]), default="auto",
              show_default=True,
              help="The decode attention core: mla-deploy's LatentAttention kernel, onnxruntime's ops (stock ONNX "
                   "that runs anywhere, CUDA included), or avx512: the kernel on CPUs with AVX-512, the ops elsewhere "
                   "(auto's choice for float32 caches at 16 heads or more; docs/design.md).")
@click.option("--prefill-attention", type=click.Choice(["auto", "per-chunk", "naive"]), default="auto",
              show_default=True,
              help="The prefill attention: each call the cheaper of the naive and absorbed forms (auto, where both "
                   "compute the same values), or naive always (a GPU session then holds no absorbed weights; "
                   "docs/design.md).")
@click.option("--no-draft", is_flag=True,
              help="Leave out the MTP draft graph of a checkpoint with a multi-token-prediction layer.")
@click.option("--stages", type=click.IntRange(min=1), default=1, show_default=True,
              help="Split the model into N pipeline stages (contiguous layers balanced by weight bytes), one export "
                   "directory each under the output, for hosts that cannot hold the whole model (run, Ray).")
@click.option("--force", is_flag=True, help="Replace an earlier export at the output path (nothing else is ever "
              "replaced).")
def export(checkpoint, out, absorb, dtype, compute, cache_dtype, max_seq_len, no_verify, steps, quantize, block_size,
           accuracy_level, quantized_ops, head_bits, experts, decode_attention, prefill_attention, no_draft, stages,
           force):
    """Export CHECKPOINT (default: the bundled demo model) to prefill.onnx, decode.onnx and verify.onnx (and
    draft.onnx from a checkpoint with an MTP layer); with --stages N, N stage directories."""
    from .export import ExportOptions
    from .export import export as run_export
    from .verify import most_steps, verify_export

    checkpoint = checkpoint or DEMO_CHECKPOINT
    progress = _progress()

    def verify(tmp):
        report = verify_export(tmp, checkpoint, steps=steps)
        for line in report.lines:
            progress(line)
        if not report.passed:
            raise MLADeployError(f"verification failed ({report.lines[-1]}); nothing was written")

    if not no_verify and max_seq_len is not None and most_steps(max_seq_len) < 1:
        raise click.UsageError(f"--max-seq-len {max_seq_len}: verification needs a prompt token and a decode step "
                               f"within the export's length (at least 3); pass --no-verify to export it unverified")
    if not no_verify and max_seq_len is not None and steps is not None and steps > most_steps(max_seq_len):
        raise click.UsageError(f"--steps {steps}: verification decodes after a prompt within --max-seq-len "
                               f"{max_seq_len}, so at most {max(most_steps(max_seq_len), 0)} steps; lower --steps, "
                               "or pass --no-verify")
    options = ExportOptions(absorb=absorb, dtype=dtype, max_seq_len=max_seq_len, force=force, quantize=quantize,
                            block_size=block_size and int(block_size),
                            accuracy_level=accuracy_level and int(accuracy_level),
                            head_bits=None if head_bits == "auto" else int(head_bits),
                            quantized_ops=quantized_ops, experts=experts, decode_attention=decode_attention,
                            prefill_attention=prefill_attention, cache_dtype=cache_dtype, draft=not no_draft,
                            stages=stages, compute=compute)
    run_export(checkpoint, out, options, progress=progress, verify=None if no_verify else verify)


@main.command()
@click.argument("export_dir", type=click.Path(path_type=Path))
@click.option("--prompt", default=None, callback=lambda ctx, param, value: _utf8(value),
              help="Prompt text (needs the export's tokenizer).")
@click.option("--prompt-ids", default=None, help="Prompt as comma-separated token ids, e.g. 1,2,3.")
@click.option("-n", "--max-new-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@_sampling_options
@click.option("--provider", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--threads", type=click.IntRange(min=0), default=0, show_default=True,
              help="onnxruntime intra-op threads; 0 is one per physical core.")
@click.option(
    "--check-weights", is_flag=True, help="Hash every block of weights.bin before loading (default: a sample)."
)
@click.option("--prepack/--no-prepack", default=None,
              help="Let onnxruntime prepack the MatMul weights: faster steps, but each graph's session holds its own "
                   "copy of the weights and loading takes longer. Default: off (both graphs read the one "
                   "memory-mapped weights.bin), on for an export that uses onnxruntime's MatMulNBits or QMoE "
                   "(--quantized-ops onnxruntime: they need it).")
@click.option("--decode-only", is_flag=True,
              help="Load only the decode graph and feed the prompt through it a token at a time: one prepacked copy of "
                   "the weights instead of two, where they are prepacked (a model near the machine's memory).")
@click.option("--token-healing/--no-token-healing", default=True, show_default=True,
              help="A --prompt ending part-way through a token (e.g. 'def ', ending in the lone space token) is fed "
                   "without its last token, and the first generated token must start with that token's text.")
@click.option("--stop", multiple=True, callback=lambda ctx, param, value: tuple(_utf8(v) for v in value),
              help="End the completion where its text first holds this string, which is not printed (repeatable; "
                   "needs the export's tokenizer). The export's stop tokens end it as well.")
@_session_config_option
@_speculation_options
@_ray_address_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text (with the "
              "draft tokens proposed and accepted).")
def run(export_dir, prompt, prompt_ids, max_new_tokens, temperature, top_k, top_p, min_p, repetition_penalty, seed,
        provider, threads, check_weights, prepack, decode_only, token_healing, stop, session_config, speculative,
        draft_tokens, ray_address, as_json):
    """Generate from EXPORT_DIR, streaming the text as it is produced."""
    from .manifest import is_staged, read_manifest, require_whole
    from .runtime import ExportedModel, RuntimeOptions
    from .runtime.complete import complete

    if (prompt is None) == (prompt_ids is None):
        raise click.UsageError("give one of --prompt TEXT or --prompt-ids IDS" + (", not both" if prompt else ""))
    ids = _parse_ids(prompt_ids) if prompt_ids is not None else None
    given = _sampling_given(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            repetition_penalty=repetition_penalty, seed=seed)
    speculation = _speculation(speculative, draft_tokens)
    if decode_only and speculative == "auto":
        speculation = _speculation("off", draft_tokens)  # a decode-only model holds no verify graph
    options = RuntimeOptions(provider=provider, threads=threads, check_weights="full" if check_weights else "sampled",
                             prepack=prepack, session_config=session_config)
    manifest = read_manifest(export_dir)
    require_whole(export_dir, manifest, "run")  # before any graph loads
    staged = is_staged(manifest)
    if ray_address is not None and not staged:
        raise click.UsageError("--ray-address: only a staged export (export --stages N) runs on Ray; this one runs "
                               "in this process (leave the option out)")
    if staged:
        _no_staged_speculation(speculative)
        if decode_only:
            raise click.UsageError("--decode-only: a staged export's stages prefill with their prefill graphs; leave "
                                   "the option out")
        from .runtime.stages import StagedModel

        with StagedModel(export_dir, options, address=ray_address) as model:
            stages = ", ".join(f"stage {p['index']} RSS {p['rss_bytes'] / 1e9:.2f} GB" for p in model.placement)
            result = complete(model, prompt, ids, max_new_tokens, model.generation.override(**given),
                              None if as_json else (lambda s: click.echo(s, nl=False)), token_healing=token_healing,
                              stop=stop)
        if as_json:
            click.echo(json.dumps({**result, "stages": model.placement}))
            return
        click.echo() if "text" in result else click.echo(" ".join(map(str, result["token_ids"])))
        click.echo(f"[{len(result['token_ids'])} tokens, prefill {result['prefill_ms']:.1f} ms, decode "
                   f"{result['decode_tokens_per_s']:.1f} tok/s; {len(model.placement)} stages on Ray: {stages}]",
                   err=True)
        return
    model = ExportedModel(export_dir, options, graphs=("decode",) if decode_only else ("prefill", "decode"))
    sampling = model.generation.override(**given)
    memory = model.load_memory
    on_text = None if as_json else (lambda s: click.echo(s, nl=False))
    result = complete(model, prompt, ids, max_new_tokens, sampling, on_text, speculation, token_healing, stop)
    if as_json:
        result["load"] = {"seconds": round(model.load_seconds, 3), "memory": memory.to_dict() if memory else None}
        click.echo(json.dumps(result))
        return
    if "text" in result:
        click.echo()  # the text streamed already; end its line
    else:
        click.echo(" ".join(map(str, result["token_ids"])))
    spec = result["speculation"]
    drafts = "" if not spec else f", {spec['mode']}: " + (
        f"{spec['accepted']}/{spec['proposed']} draft tokens accepted" if spec["proposed"]
        else "no drafts proposed (the policy found none that would pay)")
    click.echo(f"[{len(result['token_ids'])} tokens, prefill {result['prefill_ms']:.1f} ms, decode "
               f"{result['decode_tokens_per_s']:.1f} tok/s{drafts}; loaded in {model.load_seconds:.1f} s"
               + (f", {memory.describe()}" if memory else "") + "]", err=True)


@main.command()
@click.argument("export_dir", type=click.Path(path_type=Path))
@click.option("--system", default=None, callback=lambda ctx, param, value: _utf8(value),
              help="A system message the conversation starts with.")
@click.option("--chat-template", default=None,
              help="A Jinja chat template used in place of the export's (tokenizer_config.json chat_template): a "
                   "file, or the template itself.")
@click.option("-n", "--max-new-tokens", type=click.IntRange(min=1), default=512, show_default=True,
              help="The most tokens a reply generates; the oldest turns are dropped to leave this much room in the "
                   "context, so a value near the context's length keeps little history.")
@_sampling_options
@click.option("--provider", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--threads", type=click.IntRange(min=0), default=0, show_default=True,
              help="onnxruntime intra-op threads; 0 is one per physical core.")
@_session_config_option
@_speculation_options
@click.option("--cache-reuse", type=click.IntRange(min=0), default=0, show_default=True,
              help="Once the context fills and the oldest turns are dropped, move the later turns' cache entries up "
                   "past them (their roped keys re-rotated) instead of prefilling them again: runs of at least N "
                   "tokens; an approximation (they were computed seeing the dropped turns), as llama.cpp's "
                   "--cache-reuse. 0: off.")
def chat(export_dir, system, chat_template, max_new_tokens, temperature, top_k, top_p, min_p, repetition_penalty,
         seed, provider, threads, session_config, speculative, draft_tokens, cache_reuse):
    """Chat with EXPORT_DIR in the terminal, through its chat template: a line is a message (end a line with \\ to
    go on to the next), /reset starts again, /exit or Ctrl-D ends, /help lists the commands. A turn prefills only
    its new tokens: the conversation before it stays in the cache; its oldest turns make room when the context
    cannot hold it and a reply of -n tokens. Ctrl-C ends a reply where it is."""
    from .manifest import is_staged, read_manifest, require_whole
    from .runtime import ExportedModel, RuntimeOptions
    from .runtime.chat import ChatTemplate
    from .runtime.conversation import Conversation
    from .terminal_chat import chat_loop

    given = _sampling_given(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            repetition_penalty=repetition_penalty, seed=seed)
    speculation = _speculation(speculative, draft_tokens)
    manifest = read_manifest(export_dir)
    require_whole(export_dir, manifest, "chat")  # before any graph loads
    if is_staged(manifest):
        raise click.UsageError(f"{export_dir}: a staged export (export --stages N) chats through `mla-deploy serve` "
                               "and OpenAI's chat route; chat runs a whole export in this process")
    model = ExportedModel(export_dir, RuntimeOptions(provider=provider, threads=threads, session_config=session_config))
    template = None if chat_template is None else ChatTemplate.from_export(export_dir, chat_template)
    conversation = Conversation(model, model.generation.override(**given), max_new_tokens, system, template,
                                speculation, cache_reuse)
    click.echo(f"[{export_dir}: loaded in {model.load_seconds:.1f} s; /help lists the commands]", err=True)
    chat_loop(conversation)


@main.command(name="inspect")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def inspect_command(path, as_json):
    """What PATH (an export or a checkpoint) holds: parameters, bytes read per decode token, graphs, cache sizes."""
    from .inspection import format_report, inspect_path

    report = inspect_path(path)
    click.echo(json.dumps(report) if as_json else "\n".join(format_report(report)))
    if report.get("damage"):  # reported, and the exit status says so, as `check` does
        raise SystemExit(1)


@main.command()
@click.argument("export_dir", type=click.Path(path_type=Path))
def check(export_dir):
    """Check EXPORT_DIR's files against its manifest: graph hashes and every 1 MiB block of weights.bin."""
    from .inspection import size_text
    from .manifest import check_export

    report = check_export(export_dir)
    click.echo(f"OK: {export_dir}: graphs and {report['blocks']} weight blocks ({size_text(report['bytes'])}) "
               f"match the manifest ({report['seconds']:.2f} s)")


@main.command()
@click.argument("export_dir", type=click.Path(path_type=Path))
@click.option(
    "--checkpoint", type=click.Path(path_type=Path), default=None, help="Source checkpoint (default: the one exported)."
)
@click.option("--steps", type=click.IntRange(min=1), default=None,
              help="Teacher-forced decode steps to compare (after the prefill); default 8, fewer on an export too "
                   "short for 8.")
@click.option("--provider", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where the export runs (the torch source runs on the CPU).")
def verify(export_dir, checkpoint, steps, provider):
    """Compare EXPORT_DIR with its torch source: logits per graph and step, and generated tokens."""
    from .verify import verify_export

    report = verify_export(export_dir, checkpoint, steps=steps, provider=provider)
    for line in report.lines:
        click.echo(line)
    if not report.passed:
        sys.exit(1)


@main.command(name="eval")
@click.argument("export_dir", type=click.Path(path_type=Path))
@click.option("--text", "text_file", type=click.Path(path_type=Path), default=None, help="Text file to score.")
@click.option("--ids", "ids_file", type=click.Path(path_type=Path), default=None,
              help="Token ids to score, separated by whitespace or commas (an export without a tokenizer).")
@click.option("--window", type=click.IntRange(min=1), default=256, show_default=True, help="Tokens per scored window.")
@click.option(
    "--checkpoint", type=click.Path(path_type=Path), default=None, help="Source checkpoint (default: the one exported)."
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
def eval_command(export_dir, text_file, ids_file, window, checkpoint, as_json):
    """Loss and perplexity of a text through the export and through the torch source, side by side."""
    if (text_file is None) == (ids_file is None):
        raise click.UsageError("give one of --text FILE or --ids FILE" + (", not both" if text_file else ""))
    from .evaluate import evaluate

    report = evaluate(export_dir, text_file, window, checkpoint, progress=_progress(), ids_file=ids_file)
    if as_json:
        click.echo(json.dumps({**report.to_dict(), "window": window}))
    else:
        for line in report.lines():
            click.echo(line)
    if not report.passed:
        click.echo("error: export and torch source disagree by more than 1e-4 (EvalReport.TOLERANCE)", err=True)
        sys.exit(1)


@main.command()
@click.option("--quick", is_flag=True, help="ctx 128 and 4k, batch 1, four engines: a few minutes.")
@click.option(
    "--preset",
    default="v2lite-2L",
    show_default=True,
    help="Preset to build and benchmark (mla_deploy/models/presets).",
)
@click.option(
    "--checkpoint", type=click.Path(path_type=Path), default=None, help="Benchmark this checkpoint instead of a preset."
)
@click.option("--contexts", default=None, help="Comma-separated context lengths (default 128,1024,4096,16384).")
@click.option("--batches", default=None, help="Comma-separated batch sizes (default 1,8).")
@click.option("--engines", default=None, help="Comma-separated engines (default: all): onnx-fused, onnx-factored, "
              "onnx-mha-baseline, torch-absorbed, torch-naive, transformers.")
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Timed decode steps per point.")
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--workdir", type=click.Path(path_type=Path), default=Path("benchmarks/work"), show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Where results.json and results.png go (benchmarks/results holds the README's figures). "
                   "Default: WORKDIR/results.")
@click.option("--speculative", "speculative_modes", default=None, metavar="MODES",
              help="Also compare speculative decoding's modes, e.g. off,lookup,mtp: greedy generations per mode over "
                   "the same prompts, decode tokens/s and draft acceptance (README, Speculative decoding).")
@click.option("--draft-tokens", type=click.IntRange(1, MAX_DRAFT_TOKENS), default=4, show_default=True,
              help="Most tokens proposed per step in the --speculative comparison.")
def bench(quick, preset, checkpoint, contexts, batches, engines, steps, threads, workdir, out, speculative_modes,
          draft_tokens):
    """Benchmark engines side by side: decode speed vs context, prefill, memory, bandwidth limit."""
    from .bench import BenchConfig, run_bench
    from .bench.report import check_destination, save, table

    overrides = {k: v for k, v in dict(
        preset=preset, checkpoint=checkpoint, threads=threads, workdir=workdir, steps=steps,
        contexts=_parse_ints(contexts, "--contexts"), batches=_parse_ints(batches, "--batches"),
        engines=tuple(engines.split(",")) if engines else None,
        speculative=_parse_modes(speculative_modes), draft_tokens=draft_tokens).items() if v is not None}
    overrides["contexts_named"] = contexts is not None
    cfg = BenchConfig.quick(**overrides) if quick else BenchConfig(**overrides)
    if out is not None:  # before the run, not after it (the default, in --workdir, is checked with it)
        check_destination(out)
    result = run_bench(cfg, progress=_progress())
    click.echo(table(result))
    json_path, png = save(result, out or workdir / "results", "quick" if quick else "results")
    click.echo(f"saved {json_path}" + (f" and {png}" if png else "; no chart: matplotlib is not installed "
                                                                 f"({install_command('bench')})"))


@main.command()
@click.argument("export_dir", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to bind (0.0.0.0: every interface).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--max-batch", type=click.IntRange(min=1), default=16, show_default=True,
              help="Cache rows: requests decoded together in one batch.")
@click.option("--max-queue", type=click.IntRange(min=1), default=256, show_default=True,
              help="Requests waiting for a row before new ones get 429 with Retry-After.")
@click.option("--prefill-chunk", type=click.IntRange(min=1), default=256, show_default=True,
              help="Prompt tokens prefilled per scheduler step, between decode steps of the running requests.")
@click.option("--prefix-caching/--no-prefix-caching", default=True, show_default=True,
              help="Start a prompt from the cache slots a row holds for its first tokens (a chat's earlier turns, a "
                   "shared system prompt); off: every prompt prefilled whole, its numbers independent of what ran "
                   "before. A staged export prefills every prompt whole.")
@click.option("--cache-reuse", type=click.IntRange(min=0), default=0, show_default=True,
              help="With prefix caching, also reuse runs of at least N cached tokens that a prompt continues with "
                   "after dropping some (a client's chat history cut from the front): moved up, their roped keys "
                   "re-rotated, as llama.cpp's --cache-reuse; an approximation, as they were computed seeing the "
                   "dropped tokens. 0: off; CPU provider only.")
@click.option("--chat-template", default=None,
              help="A Jinja chat template used in place of the export's (tokenizer_config.json chat_template): a "
                   "file, or the template itself, as vLLM's --chat-template; e.g. one that renders the request's "
                   "tools.")
@click.option("--reasoning-parser", type=click.Choice(["deepseek_r1"]), default=None,
              help="Send a thinking model's reasoning (DeepSeek-R1's, closed by </think>) as the chat message's "
                   "reasoning_content, apart from its content, as vLLM's option of that name.")
@click.option("--api-key", default=None, envvar="MLA_DEPLOY_API_KEY",
              help="Require Authorization: Bearer KEY on every route but /health (or set MLA_DEPLOY_API_KEY).")
@click.option("--model-name", default=None, help="The model id clients send (default: the export directory's name).")
@click.option("--allowed-origins", "allowed_origins", multiple=True, metavar="ORIGIN",
              help="A web origin (scheme://host[:port]) whose pages may call the routes from a browser (CORS), "
                   "repeatable; '*': any. None by default: a page on any site could otherwise reach this server.")
@click.option("--threads", type=click.IntRange(min=0), default=0, show_default=True,
              help="onnxruntime threads per graph (0: one per physical core).")
@click.option("--prepack/--no-prepack", default=True, show_default=True,
              help="Prepacked MatMul weights: faster batched steps, a second copy of the weights per graph.")
@click.option("--spin/--no-spin", default=False, show_default=True,
              help="Let onnxruntime's threads spin between ops (fastest alone; steals the HTTP loop's CPU).")
@click.option("--ray-replicas", type=click.IntRange(min=1), default=None,
              help="Serve N replicas on Ray Serve (the 'ray' extra) instead of one process.")
@click.option("--provider", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where the graphs run; on cuda the batch's caches stay in GPU memory.")
@_session_config_option
@_speculation_options
@_ray_address_option
@click.option("--micro-batches", type=click.IntRange(min=1), default=None,
              help="A staged export: groups of rows in flight through the stages together (default: one per stage).")
def serve(export_dir, host, port, max_batch, max_queue, prefill_chunk, prefix_caching, cache_reuse, chat_template,
          reasoning_parser, api_key, model_name, allowed_origins, threads, prepack, spin, ray_replicas, provider,
          session_config, speculative, draft_tokens, ray_address, micro_batches):
    """Serve EXPORT_DIR over HTTP with OpenAI's completions and chat routes, batching requests continuously."""
    from .runtime import RuntimeOptions

    options = RuntimeOptions(provider=provider, threads=threads, prepack=prepack, spin=spin,
                             session_config=session_config)
    from .manifest import is_staged, read_manifest

    staged = is_staged(read_manifest(export_dir))
    if ray_replicas is not None and staged:
        raise click.UsageError("--ray-replicas copies a whole export per replica; a staged export already runs as "
                               "one Ray actor per stage (serve it without --ray-replicas)")
    if staged:
        _no_staged_speculation(speculative)
    if cache_reuse and (staged or not prefix_caching or provider != "cpu"):
        raise click.UsageError("--cache-reuse moves cached tokens of a row on the CPU provider with prefix caching; "
                               + ("a staged export prefills every prompt whole" if staged else
                                  "--no-prefix-caching reuses none" if not prefix_caching else
                                  f"--provider {provider} keeps the caches in device memory"))
    if micro_batches is not None and not staged:
        raise click.UsageError("--micro-batches: only a staged export (export --stages N) has stages to pipeline")
    if ray_address is not None and not (staged or ray_replicas):
        raise click.UsageError("--ray-address: only a staged export (export --stages N) or --ray-replicas runs on "
                               "Ray; this one is served from this process (leave the option out)")
    if ray_replicas is not None:
        from .serve.ray import serve_on_ray

        serve_on_ray(export_dir, ray_replicas, host, port, max_batch, max_queue, api_key, model_name, options,
                     _speculation(speculative, draft_tokens), ray_address, prefill_chunk, prefix_caching,
                     chat_template, reasoning_parser, cache_reuse, allowed_origins)
        return
    from .serve.server import build_service, listening_socket
    from .serve.server import serve as run_server

    sock = listening_socket(host, port)  # a port in use is said before the model loads
    try:
        service = build_service(export_dir, max_batch, max_queue, api_key, model_name, options, prefill_chunk,
                                _speculation(speculative, draft_tokens), ray_address, micro_batches, prefix_caching,
                                chat_template, reasoning_parser, cache_reuse, allowed_origins)
    except BaseException:
        sock.close()
        raise
    url_host = f"[{host}]" if ":" in host else host
    click.echo(f"serving {service.model_name!r} on http://{url_host}:{sock.getsockname()[1]}/v1 (max batch "
               f"{max_batch}, max queue {max_queue}{', API key required' if api_key else ''})", err=True)
    run_server(service, sock)


@main.command()
@click.argument("name")
@click.option("-o", "--output", "out", required=True, type=click.Path(path_type=Path))
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option(
    "--layers", type=click.IntRange(min=1), default=None,
    help="Keep only the first N decoder layers (a cut of the full model)."
)
def preset(name, out, seed, layers):
    """Write a random-weight checkpoint for preset NAME (mla_deploy/models/presets/NAME.json: v2lite, v2lite-2L,
    tiny-v3), in the dtype and shards its file names."""
    from .presets import build_preset

    click.echo(build_preset(name, out, seed, layers, note=lambda text: click.echo(text, err=True)))


if __name__ == "__main__":
    main()
