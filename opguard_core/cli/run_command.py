"""``opguard run``: preprocess traces into instrumentation configs.

Its options map one to one onto :class:`~opguard_core.model.RunOptions` fields
(:func:`run_options`); the runner (:mod:`opguard_core.run.runner`) is imported only
when the command runs, so ``opguard run --help`` stays fast.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from opguard_core.cli import exits
from opguard_core.cli.checks import check_executor
from opguard_core.cli.options import (
    FiniteFloatRange,
    InputsCommand,
    base_dir_option,
    basic_options,
    check_basic,
    disable_option,
    input_option,
    selection_options,
    verbose_option,
)
from opguard_core.errors import ExitCode, InputError, one_line
from opguard_core.formats import names_a_config
from opguard_core.logs import configure_logging
from opguard_core.model import (
    DEFAULT_CONTEXT_DEPTH,
    DEFAULT_MIN_COUNT,
    DEFAULT_MIN_FRACTION,
    DEFAULT_SKEW,
    STAGES,
    RunOptions,
)

if TYPE_CHECKING:
    from opguard_core.plugin.manager import OpGuardPluginManager
    from opguard_core.run.runner import Runner

CODES: exits.Codes = {
    ExitCode.OK: "every stage ok",
    ExitCode.STAGE_FAILED: "a stage failed for some entry (the others went on)",
    ExitCode.DIVERGENCE: None,
    ExitCode.INTERRUPTED: None,
}


_OPTIONS: tuple[Callable[[Any], Any], ...] = (
    input_option,
    base_dir_option,
    click.option(
        "--output-base",
        type=click.Path(),
        callback=lambda _ctx, _param, value: _not_empty(value),
        default=None,
        help="Where the run directory goes "
        "(default: $OPGUARD_TRACE_OUTPUT_BASE, else ./opguard_traces).",
    ),
    verbose_option,
    basic_options,
    click.option(
        "--skip",
        multiple=True,
        type=click.Choice([s for s in STAGES if s != "discover"]),
        help="Do not run this stage (repeatable); stages that need its output are skipped too.",
    ),
    click.option(
        "--min-count",
        type=click.IntRange(min=1),
        default=DEFAULT_MIN_COUNT,
        show_default=True,
        help="Subtree pruning: fold subtrees with fewer ops than this.",
    ),
    click.option(
        "--min-fraction",
        type=FiniteFloatRange(min=0.0, max=1.0),
        default=DEFAULT_MIN_FRACTION,
        show_default=True,
        help="Subtree pruning: fold subtrees below this fraction of all ops.",
    ),
    click.option(
        "--chains/--no-chains", default=True, show_default=True, help="Fold linear chains."
    ),
    click.option(
        "--hide",
        multiple=True,
        metavar="REGEX",
        help="Also hide frames whose module:qualname matches REGEX whole (repeatable).",
    ),
    selection_options("callsites with a frame, api or op"),
    click.option(
        "--no-default-hide", is_flag=True, help="Do not hide the default plumbing frames."
    ),
    click.option(
        "--context-depth",
        type=click.IntRange(min=0),
        default=DEFAULT_CONTEXT_DEPTH,
        show_default=True,
        help="How many enclosing nodes an entry's context lists.",
    ),
    click.option(
        "--compressor", default=None, metavar="NAME", help="Use this plugin's compressor."
    ),
    click.option(
        "--executor",
        default="local",
        show_default=True,
        metavar="NAME",
        help="Combine executor: local, or one a plugin provides (e.g. dask).",
    ),
    click.option(
        "--jobs",
        "-j",
        type=click.IntRange(min=0),
        default=0,
        show_default=True,
        help="Processes for combine; 0 picks one per CPU for large multi-file entries.",
    ),
    click.option(
        "--clean-stale",
        is_flag=True,
        help="Remove the temporaries of runs killed in the output base (and mark them "
        "abandoned); without --input, only that.",
    ),
    click.option(
        "--skew",
        type=FiniteFloatRange(min=0.0),
        default=DEFAULT_SKEW,
        show_default=True,
        metavar="F",
        help="Divergence: report a function whose ops on a rank differ from the median "
        "over ranks by more than F times the median.",
    ),
    click.option(
        "--fail-on-divergence",
        is_flag=True,
        help="Exit 4 when a divergence finding is an error (a collective mismatch).",
    ),
    disable_option,
)


def _not_empty(value: str | None) -> Path | None:
    """``--output-base ""`` is refused: it went to the current directory (a Path of
    ``""`` is ``.``), where an empty ``$OPGUARD_TRACE_OUTPUT_BASE`` means the default."""
    if value is not None and not value.strip():
        raise click.BadParameter("give a directory (leave the option out for the default)")
    return None if value is None else Path(value)


def run_options(params: dict[str, Any]) -> RunOptions:
    """The RunOptions of ``opguard run``'s parsed options (one field per option, but
    ``--no-default-hide``, which is ``default_hide`` turned round)."""
    fields = {name for name in RunOptions.__dataclass_fields__ if name != "extra"}
    values: dict[str, Any] = {k: v for k, v in params.items() if k in fields}
    values["default_hide"] = not params["no_default_hide"]
    values["verbose"] = bool(params["verbose"])
    return RunOptions(**values)


def make_run_command(
    manager: Callable[[], OpGuardPluginManager], disabled: Callable[[], Sequence[str]]
) -> click.Command:
    """``opguard run``, loading the plugins (``manager()``) only when it runs."""

    def run(**params: Any) -> ExitCode:
        """Preprocess callsite traces into instrumentation configs."""
        from opguard_core.run.runner import Runner
        from opguard_core.run.stale import clean_stale_runs

        ctx = click.get_current_context()
        inputs = list(params.pop("input_options"))
        if not inputs and not params["clean_stale"]:
            raise click.UsageError("give at least one --input")
        _refuse_configs(inputs)
        params["verbose"] += (ctx.obj or {}).get("verbose", 0)
        if params["verbose"]:
            configure_logging((ctx.obj or {}).get("log_format"), params["verbose"])
        plugins = manager()
        _check_compressor(plugins, params["compressor"])
        check_basic(disabled(), params["basic"], params["basic_list"])
        for option in ("hide", "focus", "ignore"):
            _check_regexes(params[option], f"--{option}")
        check_executor(params["executor"], plugins.get_plugins())
        if params["fail_on_divergence"]:
            _check_stage_runs(plugins, params["skip"], "--fail-on-divergence", "divergence")
        if params["basic"]:
            _check_stage_runs(plugins, params["skip"], "--basic", "filter")
        options = run_options(params)
        try:
            plugins.hook.opguard_check_options(options=options)
        except InputError as exc:  # before any directory is made: nothing written
            raise click.UsageError(one_line(str(exc))) from None
        base = _output_base(params["output_base"])
        if params["clean_stale"]:
            for stale in clean_stale_runs(base):
                click.echo(
                    f"opguard: cleaned stale run directory {str(stale.run_dir)!r}: "
                    f"removed {len(stale.temporaries)} temporary file(s)",
                    err=True,
                )
            if not inputs:
                return ExitCode.OK
        runner = Runner(plugins, inputs, options, params["skip"], base)
        exits.end_without_teardown()  # the runner leaves its last entry to the exit
        code = runner.run()
        for record in runner.recorder.records:
            where = record.stage + (f" [{one_line(record.entry)}]" if record.entry else "")
            if record.status == "failed":
                click.echo(f"opguard: {where} failed: {record.error}", err=True)
            elif code == ExitCode.DIVERGENCE and record.stage == "divergence":
                errors = record.counts.get("errors")
                if errors:  # why the run ends with 4 (--fail-on-divergence)
                    log = ", ".join(o for o in record.outputs if o.endswith(".log"))
                    click.echo(f"opguard: {where}: {errors} error finding(s); see {log}", err=True)
        if runner.summary_error is not None:
            click.echo(f"opguard: summary not written: {runner.summary_error}", err=True)
        _print_summary(runner)
        click.echo(str(runner.run_dir))
        return code

    for option in reversed(_OPTIONS):
        run = option(run)
    return exits.command("run", CODES, cls=InputsCommand)(run)


def _check_compressor(manager: OpGuardPluginManager, compressor: str | None) -> None:
    if compressor is not None and not manager.implements(compressor, "opguard_compress"):
        raise click.UsageError(f"--compressor {compressor}: no such compressor plugin")


def _check_stage_runs(
    manager: OpGuardPluginManager, skip: Sequence[str], option: str, stage: str
) -> None:
    """``option`` where the ``stage`` it needs would not run (skipped, after a skipped
    stage it needs, or disabled) is a usage error: ``--fail-on-divergence`` would pass
    whatever the ranks did, ``--basic`` would filter nothing."""
    from opguard_core.run.steps import skip_reasons, unanswered

    reason = skip_reasons(skip, unanswered=unanswered(manager)).get(stage)
    if reason is not None:
        raise click.UsageError(f"{option} needs the {stage} stage, which would not run: {reason}")


def _output_base(explicit: Path | None) -> Path:
    """The run's output base, checked (:class:`OutputLocationError`, exit 2)."""
    from opguard_core.files.output_dirs import (
        OUTPUT_BASE_ENV,
        prepare_output_dir,
        trace_output_base,
    )

    what = "--output-base" if explicit is not None else f"${OUTPUT_BASE_ENV}"
    if explicit is None and not os.environ.get(OUTPUT_BASE_ENV):
        what = "output base"
    return prepare_output_dir(trace_output_base(explicit), what)


def _print_summary(runner: Runner) -> None:
    """The end-of-run summary: lines for a person on a console, one record in JSON."""
    from opguard_core.logs import current_format, get_logger
    from opguard_core.run.summary import summary_fields, summary_lines

    if runner.run_dir is None:
        return
    summary = runner.summary(final=True)
    if current_format() == "console":
        click.echo("\n".join(one_line(line) for line in summary_lines(summary)), err=True)
    else:
        get_logger().info("run summary", **summary_fields(summary))


def _check_regexes(patterns: Sequence[str], option: str) -> None:
    """Compile each pattern on its own; a bad one is a usage error naming it."""
    from opguard_core.configs.selection import PatternError, compile_patterns

    try:
        compile_patterns(patterns, option)
    except PatternError as exc:
        raise click.UsageError(str(exc)) from None


def _refuse_configs(inputs: Sequence[str]) -> None:
    """``run`` reads traces; a YAML config or a run directory given as input is a
    usage error that names the commands made for them."""
    from opguard_core.files.lookup import is_regular_file
    from opguard_core.run.summary import RUN_DIR_INSTEAD, SUMMARY_FILE

    for spec in inputs:
        if names_a_config(spec):
            raise click.UsageError(
                f"--input {spec}: a YAML config, not a callsite trace; "
                "use opguard compare, merge, filter or show on configs"
            )
        if is_regular_file(Path(spec) / SUMMARY_FILE):
            raise click.UsageError(f"--input {spec}: {RUN_DIR_INSTEAD}")


__all__ = ["make_run_command", "run_options"]
