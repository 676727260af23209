"""The `asyncrl` command line. Thin: every heavy import happens inside the command that needs it,
so `asyncrl --help` and `asyncrl --version` start instantly."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ui.common import fail, require_state_dir

app = typer.Typer(
    name="asyncrl",
    help="Asynchronous RL post-training of LLMs: campaigns, stability gates, promotion, tracking.",
    no_args_is_help=True,
    add_completion=False,
)
algorithms_app = typer.Typer(help="Inspect the off-policy algorithms library.",
                             no_args_is_help=True)
app.add_typer(algorithms_app, name="algorithms")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version  # ~0.04 s: only for --version

    try:
        return version("asyncrl")
    except PackageNotFoundError:  # running from a source tree without an install
        return "0+unknown"


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"asyncrl {_version()}")
        raise typer.Exit()


@app.callback()
def main(
    version_: bool = typer.Option(
        False, "--version", callback=_version_callback, is_eager=True,
        help="Print the asyncrl version and exit.",
    ),
) -> None:
    """asyncrl command line. State (registry, MLflow, Prefect, runs, caches) lives in
    $ASYNCRL_HOME, default ~/.asyncrl."""
    from training.paths import legacy_state_note

    note = legacy_state_note()
    if note:
        typer.echo(note, err=True)


@algorithms_app.command("list")
def list_algorithms() -> None:
    """List the registered policy losses, advantage estimators, KL estimators, rollout-correction
    presets and IS correction methods."""
    from rich.console import Console
    from rich.table import Table

    from training import algorithms as alg

    table = Table("family", "names")
    table.add_row("policy losses", ", ".join(alg.POLICY_LOSSES.names()))
    table.add_row("loss aggregation", ", ".join(alg.LOSS_AGG_MODES))
    table.add_row("advantage estimators", ", ".join(alg.ADVANTAGE_ESTIMATORS.names()))
    table.add_row("KL estimators", ", ".join(alg.KL_ESTIMATORS.names()))
    table.add_row("rollout-correction presets", ", ".join(alg.PRESETS))
    table.add_row("rejection-sampling modes", ", ".join(alg.RS_MODES))
    table.add_row("CompIS source methods", ", ".join(alg.CORRECTION_METHODS))
    Console().print(table)


@algorithms_app.command("diagnose")
def diagnose_metrics(
    metrics_file: Path = typer.Argument(
        ..., metavar="METRICS_JSON",
        help="JSON file: a flat {metric: value} dict, or {metric: [values, oldest first]}.",
    ),
) -> None:
    """Run seed 001's A–F decision tree on logged metrics and print causes, evidence and fixes."""
    from training.algorithms.decision_tree import diagnose

    try:
        data = json.loads(metrics_file.read_text())
    except (FileNotFoundError, IsADirectoryError):
        fail(f"{metrics_file} is not a file; pass the path of a metrics JSON file")
    except json.JSONDecodeError as e:
        fail(f"{metrics_file} is not valid JSON ({e.msg} at line {e.lineno}); fix the file")
    if not isinstance(data, dict):
        fail(f"{metrics_file} must hold a JSON object {{metric: value}}")
    latest: dict[str, float] = {}
    history: dict[str, list[float]] = {}
    for key, value in data.items():
        if isinstance(value, list):
            if not value or not all(isinstance(v, int | float) for v in value):
                fail(f"metric {key!r} must be a number or a non-empty list of numbers")
            history[key] = [float(v) for v in value]
            latest[key] = float(value[-1])
        elif isinstance(value, int | float):
            latest[key] = float(value)
        else:
            fail(f"metric {key!r} must be a number or a non-empty list of numbers")
    result = diagnose(latest, history=history)
    if result.healthy:
        typer.echo("healthy: no meaningful drift (seed 001, step 1)")
    elif not result.findings:
        typer.echo("no cause matched")
    for f in result.findings:
        typer.echo(f"Cause {f.cause} — {f.title}")
        for ev in f.evidence:
            typer.echo(f"  evidence: {ev}")
        typer.echo(f"  fix: {f.fix}")
    if result.escalation:
        typer.echo(f"escalation: {result.escalation}")
    if result.missing:
        typer.echo(f"not measured: {', '.join(result.missing)}")


# ------------------------------------------------------------------------------------------------
# asyncrl engine … (rollout engine; Engineer B, issue 3)
# ------------------------------------------------------------------------------------------------
engine_app = typer.Typer(help="Rollout engines: serve the embedded SGLang-compatible server.",
                         no_args_is_help=True)
app.add_typer(engine_app, name="engine")


@engine_app.command("serve", add_help_option=False, context_settings={
    "allow_extra_args": True, "ignore_unknown_options": True})
def engine_serve(ctx: typer.Context) -> None:
    """Serve a checkpoint over SGLang's HTTP API (/generate, /update_weights_from_disk, …) with
    continuous batching on CPU."""
    # the options are ServerConfig's fields, parsed and validated by the server's own entry point
    # (one definition; importing it here would slow every other command's start)
    from training.engines.embedded.server import main as serve_main

    raise typer.Exit(serve_main(ctx.args, prog="asyncrl engine serve"))


# ------------------------------------------------------------------------------------------------
# asyncrl warmstart … (supervised warm start; Engineer A, issue 3)
# ------------------------------------------------------------------------------------------------
def _parse_task_arg(item: str) -> tuple[str, int | float | str]:
    key, sep, raw = item.partition("=")
    if not sep or not key:
        fail(f"--task-arg {item!r} must look like KEY=VALUE (e.g. max_k=6, path=data.jsonl)")
    for convert in (int, float):
        try:
            return key, convert(raw)
        except ValueError:
            pass
    return key, raw


def _check_writable(out: Path) -> None:
    """Fail fast (before training) if ``out`` cannot be created or written."""
    import tempfile

    if out.exists() and not out.is_dir():
        fail(f"--out {out} is a file; pass a directory path")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out.parent, prefix=f".{out.name}.probe-"):
            pass
    except OSError as e:
        fail(f"cannot write --out {out} ({e.strerror or e}); pass a writable directory path")


@app.command("warmstart")
def warmstart(
    task: str = typer.Argument(..., help="Registered task name: sum_digits, jsonl, calc_chain."),
    out: Path = typer.Option(..., "--out", help="Directory for the HF-format checkpoint."),
    task_arg: list[str] = typer.Option(
        [], "--task-arg", help="Task setting KEY=VALUE, repeatable: max_k=6 (sum_digits); "
        "path=data.jsonl, reward=numeric (jsonl); max_k=4, tool=calc (calc_chain)."),
    steps: int = typer.Option(700, help="Optimisation steps."),
    seed: int = typer.Option(0, help="Seeds the weights, the task split and the batches."),
    batch_size: int = typer.Option(64, help="Sequences per step."),
    lr: float = typer.Option(2e-3, help="Peak learning rate (warm-up, then cosine decay to 0; "
                             "torch threads are sized to the free cores)."),
    eval_n: int = typer.Option(400, help="Eval-split examples for the final greedy evaluation."),
    moe_experts: int = typer.Option(0, help="0 = dense; else upcycle to this many experts."),
    moe_top_k: int = typer.Option(2, help="Experts per token of the upcycled MoE model."),
    moe_finetune_steps: int = typer.Option(
        100, help="Supervised steps after upcycling, so the copied experts drift apart (routing "
        "then matters)."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Retrain even if a checkpoint with "
                                  "this exact config is cached (with --moe-experts, the dense "
                                  "one too)."),
) -> None:
    """Supervised warm start so RL starts with reward signal: train, evaluate per difficulty,
    write an HF checkpoint. Cached by config hash under $ASYNCRL_HOME/cache/warmstart."""
    _check_writable(out)
    require_state_dir()  # the warm-start cache lives there
    task_args = tuple(sorted(dict(_parse_task_arg(a) for a in task_arg).items()))
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from training.engines.warmstart import WarmStartConfig, warm_start

    try:
        cfg = WarmStartConfig(task=task, task_args=task_args, steps=steps, seed=seed,
                              batch_size=batch_size, lr=lr, eval_n=eval_n,
                              moe_experts=moe_experts, moe_top_k=moe_top_k,
                              moe_finetune_steps=moe_finetune_steps)
        cfg.build_task()  # an unknown task or a bad task argument fails before any training
    except KeyError as e:
        fail(str(e.args[0]) if e.args else str(e))
    except (TypeError, ValueError, OSError) as e:
        fail(f"task {task!r}: {e}")

    console = Console()
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
                  TimeElapsedColumn(), console=console) as bar:
        bars: dict[str, object] = {}

        def on_event(event) -> None:
            if event.phase not in bars:
                bars[event.phase] = bar.add_task(event.phase, total=event.total or None, info="")
            info = "" if event.phase == "eval" else f"loss {event.loss:.3f} lr {event.lr:.1e}"
            bar.update(bars[event.phase], completed=event.step, info=info)

        try:
            result = warm_start(cfg, out, use_cache=not no_cache, progress=on_event)
        except (FileExistsError, OSError, ValueError) as e:
            fail(str(e))
    _print_warmstart(console, result)


def _print_warmstart(console, result) -> None:
    from rich.table import Table

    meta = result.meta
    table = Table("difficulty", "n", "accuracy", "mean tokens", "truncated",
                  title=f"greedy accuracy on the eval split ({meta['task']['name']})")
    for row in meta.get("eval", []):
        table.add_row(str(row["difficulty"]), str(row["n"]), f"{row['accuracy']:.3f}",
                      f"{row['mean_response_tokens']:.1f}", f"{row['truncated_fraction']:.2f}")
    console.print(table)
    seconds = meta.get("train_seconds", meta.get("moe_finetune_seconds"))
    source = "cache hit (no training)" if result.cache_hit else f"trained in {seconds}s"
    console.print(f"checkpoint {result.path} · {source} · config {result.config_hash} · "
                  f"{meta.get('parameters')} parameters")


# ---------------------------------------------------------------- check-mismatch


@app.command("check-mismatch")
def check_mismatch(
    checkpoint: Path = typer.Option(..., "--checkpoint", help="HF-format checkpoint directory."),
    engine: str | None = typer.Option(
        None, "--engine", help="URL of a rollout engine already serving this checkpoint; by "
        "default an embedded server is started (and stopped) for the check."),
    prompts: int = typer.Option(64, help="Eval prompts of the checkpoint's task."),
    samples: int = typer.Option(1, help="Responses sampled per prompt."),
    temperature: float = typer.Option(1.0, help="Sampling temperature (both engines use it)."),
    max_new_tokens: int | None = typer.Option(None, help="Default: the task's response bound."),
    dtype: str = typer.Option("bf16", help="Embedded server precision: bf16, fp32 or fp8."),
    logit_noise: float = typer.Option(0.0, help="Embedded server logit noise σ (simulated)."),
    task: str | None = typer.Option(None, help="Task to draw prompts from (default: the "
                                    "checkpoint's own, else sum_digits)."),
    seed: int = typer.Option(0, help="Prompt and sampling seed."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Same weights, same prompts: rollout engine vs train engine log-probs (seed 001's
    zero-staleness check). Prints the mismatch metrics and the decision-tree verdict."""
    from training.engines.hf_io import CheckpointError
    from training.engines.mismatch import TABLE_ROWS, run_mismatch_check
    from training.engines.rollout import RolloutEngineError

    if dtype not in ("bf16", "fp32", "fp8"):
        fail(f"--dtype must be bf16, fp32 or fp8, got {dtype!r}")
    try:
        report = run_mismatch_check(
            checkpoint, engine, prompts=prompts, samples_per_prompt=samples,
            max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, dtype=dtype,
            logit_noise=logit_noise, task=task)
    except (CheckpointError, RolloutEngineError, ValueError, KeyError) as e:
        fail(str(e).strip("'\""))
    if as_json:
        typer.echo(json.dumps(report.to_json(), indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("metric", "value", title=f"engine mismatch — {report.engine} vs fp32 trainer, "
                  f"{report.sequences} sequences, {report.tokens} tokens")
    for key, label in TABLE_ROWS:
        if key in report.metrics:
            table.add_row(label, f"{report.metrics[key]:.4g}")
    console = Console()
    console.print(table)
    console.print(f"verdict: {report.verdict}")
    for f in report.diagnosis.findings:
        for ev in f.evidence:
            console.print(f"  evidence: {ev}")
        console.print(f"  fix: {f.fix}")



# ------------------------------------------------------------------------------------------------
# asyncrl schema … / asyncrl train …
# ------------------------------------------------------------------------------------------------
schema_app = typer.Typer(help="JSON schemas of the YAML files asyncrl reads (for editors).",
                         no_args_is_help=True)
app.add_typer(schema_app, name="schema")

def _register_platform_commands() -> None:
    from ui.campaign_cli import register as register_campaign
    from ui.dashboard_cli import register as register_dashboard
    from ui.gates_cli import register as register_gates
    from ui.gc_cli import register as register_gc
    from ui.registry_cli import register as register_registry
    from ui.services_cli import register as register_services
    from ui.simulate_cli import register as register_simulate
    from ui.validate_cli import register as register_validate

    register_campaign(app, schema_app)
    register_registry(app)
    register_gates(app)
    register_services(app)
    register_validate(app)
    register_gc(app)
    register_dashboard(app)
    register_simulate(app)


_register_platform_commands()


@schema_app.command("recipe")
def schema_recipe(
    out: Path | None = typer.Option(None, "--out", help="Write the schema to this file instead "
                                    "of printing it."),
) -> None:
    """The recipe JSON schema (every field, its bounds and description). Point an editor at it,
    e.g. `# yaml-language-server: $schema=recipe.schema.json` at the top of a recipe."""
    from training.recipe import recipe_json_schema

    text = json.dumps(recipe_json_schema(), indent=2) + "\n"
    if out is None:
        typer.echo(text, nl=False)
        return
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    except OSError as e:
        fail(f"cannot write --out {out} ({e.strerror or e}); pass a writable file path")
    typer.echo(f"wrote {out}")


_SCI_FLOAT = r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+"


def _parse_overrides(items: list[str]) -> dict[str, object]:
    """``--set KEY=VALUE`` items → one nested override mapping for ``load_recipe``.

    The value is YAML (``4``, ``true``, ``null``, ``[1, 2]``, ``{kind: compis}``), and ``1e-4`` is
    a number, not YAML 1.1's string. Dotted keys are nested (``async.mode=sync`` →
    ``{"async": {"mode": "sync"}}``) so that a changed variant tag (``async.mode``,
    ``algorithm.correction.kind``) starts from the new variant whatever order the items come in,
    instead of keeping the old variant's fields."""
    import re

    import yaml

    from training.yamlfile import StrictSafeLoader, short_repr

    overrides: dict[str, object] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        parts = [p.strip() for p in key.split(".")]
        if not sep or not all(parts):
            fail(f"--set {short_repr(item)} must look like KEY=VALUE (e.g. optim.lr=1e-4, "
                  "async.mode=fully_async)")
        try:  # the recipe file's rules: no aliases, tags, dates, yes/no or 5000-digit ints
            value = yaml.load(raw, Loader=StrictSafeLoader)
        except yaml.YAMLError as e:
            fail(f"--set {short_repr(item)}: the value is not valid YAML "
                  f"({getattr(e, 'problem', None) or 'syntax error'}); quote or fix it")
        if isinstance(value, str) and re.fullmatch(_SCI_FLOAT, value.strip()):
            value = float(value)
        node = overrides
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    return overrides


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "—" if value is None else str(value)


@app.command("train")
def train(
    recipe_path: Path = typer.Argument(..., metavar="RECIPE.yaml",
                                       help="Recipe file (see recipes/)."),
    steps: int | None = typer.Option(None, "--steps", min=1,
                                     help="Trainer steps (default: the recipe's `steps`)."),
    out: Path | None = typer.Option(
        None, "--out", help="Run directory (default: $ASYNCRL_HOME/runs/<recipe "
        "name>-<YYYYmmdd-HHMMSS>)."),
    resume: Path | None = typer.Option(
        None, "--resume", help="Continue the run in this directory from its last checkpoint."),
    ray_address: str | None = typer.Option(
        None, "--ray-address", help="Join this Ray cluster (e.g. ray://host:10001) instead of "
        "starting a local one."),
    checkpoint_every: int = typer.Option(10, "--checkpoint-every", min=0,
                                         help="Trainer steps between checkpoints (0 = only at "
                                         "the end)."),
    set_: list[str] = typer.Option(
        [], "--set", help="Override a recipe field, KEY=VALUE with a dotted key and a YAML "
        "value; repeatable: --set optim.lr=1e-4 --set async.mode=fully_async."),
    verbose: bool = typer.Option(False, "--verbose", "-v",
                                 help="Also print one metrics line per step and INFO logs."),
) -> None:
    """Train one recipe: warm start (cached), rollout engines, trainer, metrics, checkpoints.
    Writes the run directory (recipe.yaml, metrics.jsonl, checkpoint/, final/hf/, summary.json)
    and prints a summary. Ctrl-C stops at the current step; --resume continues it."""

    from training.recipe import RecipeError, load_recipe

    overrides = _parse_overrides(set_)
    try:
        recipe = load_recipe(recipe_path, overrides)
    except RecipeError as e:
        fail(str(e))
    require_state_dir()  # warm-start cache and engine logs live there, whatever --out says
    if resume is not None:
        if out is not None and out.resolve() != resume.resolve():
            fail("--out and --resume disagree: a resumed run continues in its own directory; "
                  "drop --out")
        run_dir = resume
    elif out is not None:
        run_dir = out
    else:
        from training.runtime.run import default_run_dir

        run_dir = default_run_dir(recipe)
    if resume is None:
        _check_writable(run_dir)
        if (run_dir / "recipe.yaml").exists():
            fail(f"{run_dir} already holds a run; continue it with --resume {run_dir} or pass "
                  "another --out")

    import logging

    from rich.console import Console
    from rich.logging import RichHandler
    from rich.markup import escape
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from training.engines.hf_io import CheckpointError
    from training.runtime.run import RunError, run_recipe
    from training.runtime.sinks import ConsoleSink

    console = Console()
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(name)s: %(message)s",
                        handlers=[RichHandler(console=console, show_path=False)])
    total = steps if steps is not None else recipe.steps
    console.print(f"recipe [bold]{escape(recipe.name)}[/] ({recipe.hash()}) · mode "
                  f"{recipe.mode} · {total} steps · {'resuming ' if resume else ''}run dir "
                  f"{escape(str(run_dir))}")
    sinks = [ConsoleSink(every=1)] if verbose else []
    shown = {"reward": "—", "logprob_diff": "—", "staleness": "—"}
    keys = {"reward": "rollout/reward_mean",
            "logprob_diff": "mismatch/train_rollout/logprob_abs_diff/mean",
            "staleness": "async/staleness/mean"}
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("reward {task.fields[reward]}"),
               TextColumn("|Δlogp| {task.fields[logprob_diff]}"),
               TextColumn("staleness {task.fields[staleness]}"),
               TimeElapsedColumn(), TextColumn("/"), TimeRemainingColumn())
    with Progress(*columns, console=console) as bar:
        task = bar.add_task("starting", total=total, **shown)
        first = [True]

        def on_step(step: int, total_steps: int, metrics: dict[str, float]) -> None:
            for name, key in keys.items():
                if key in metrics:
                    shown[name] = _fmt(metrics[key])
            if first[0] and step > 1:  # a resumed run: start the clock at its first step
                bar.reset(task, total=total_steps, completed=step - 1)
            first[0] = False
            bar.update(task, description="training", completed=step, total=total_steps,
                       **shown)

        try:
            if resume is None:  # the warm start (cached after the first time) gets its own bar
                from training.runtime.run import initial_checkpoint

                def on_warm(ev) -> None:
                    if ev.total:
                        bar.update(task, description=f"warm start ({ev.phase} {ev.step}/"
                                   f"{ev.total})")

                initial_checkpoint(recipe, progress=on_warm)
                bar.update(task, description="starting engines")
            result = run_recipe(recipe, out=None if resume else run_dir, steps=steps,
                                resume=resume, ray_address=ray_address, sinks=sinks,
                                progress=on_step, checkpoint_every=checkpoint_every)
        except (RecipeError, RunError, CheckpointError) as e:
            bar.stop()
            fail(str(e))
        except KeyboardInterrupt:
            bar.stop()
            hint = (f"; resume with: asyncrl train {recipe_path} --resume {run_dir}"
                    if (run_dir / "checkpoint").is_dir() else " before the first checkpoint")
            typer.echo(f"interrupted{hint}", err=True)
            raise typer.Exit(130) from None
    _print_run_summary(console, result, total, recipe_path)
    if result.interrupted:
        raise typer.Exit(130)


def _print_run_summary(console, result, total: int, recipe_path: Path) -> None:
    from rich.markup import escape
    from rich.table import Table

    state = "interrupted" if result.interrupted else "finished"
    table = Table("metric", "value", title=f"{state} after {result.steps_done}/{total} steps")
    for key, value in result.summary.items():
        table.add_row(escape(str(key)), _fmt(value))
    console.print(table)
    missing = "" if result.final_hf.exists() else " (not written)"
    for label, path, note in (("run dir", result.run_dir, ""),
                              ("final HF checkpoint", result.final_hf, missing),
                              ("metrics JSONL", result.metrics_path, "")):
        console.print(f"{label:<20} {escape(str(path))}{note}")
    if result.interrupted:
        console.print(f"resume with: asyncrl train {escape(str(recipe_path))} --resume "
                      f"{escape(str(result.run_dir))}")


if __name__ == "__main__":
    app()
