"""The ``opguard`` command line.

The CLI is built by :func:`create_cli` from a plugin manager, or from a function that
makes one, so plugins can add commands (``opguard_register_commands``) without
import-time side effects. ``--disable-plugin`` is read from the arguments *before*
any plugin is loaded. Plugins are loaded only when a command needs them: ``opguard
--version`` and ``opguard run --help`` load none, and import neither pluggy,
structlog, msgspec nor rich (start-up: docs/performance.md).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from opguard_core import __version__
from opguard_core.cli.options import (
    check_executor,
    check_fraction,
    unknown_disabled,
)
from opguard_core.errors import ExitCode, OpGuardError, PluginError, one_line
from opguard_core.files.output_dirs import OutputLocationError, prepare_output_dir
from opguard_core.logs import configure_logging
from opguard_core.model import (
    DEFAULT_CONTEXT_DEPTH,
    DEFAULT_MIN_COUNT,
    DEFAULT_MIN_FRACTION,
    DEFAULT_SKEW,
    STAGES,
    RunOptions,
)
from opguard_core.plugin.names import BUILTIN_PLUGINS, disabled_from_env

if TYPE_CHECKING:
    from opguard_core.plugin.manager import OpGuardPluginManager
    from opguard_core.run.runner import Runner

DISABLE_OPTION = "--disable-plugin"


def disabled_from_args(args: Sequence[str]) -> list[str]:
    """Values of ``--disable-plugin NAME`` / ``--disable-plugin=NAME`` anywhere in ``args``."""
    names = []
    for index, arg in enumerate(args):
        if arg == "--":
            break
        if arg == DISABLE_OPTION and index + 1 < len(args):
            names.append(args[index + 1])
        elif arg.startswith(DISABLE_OPTION + "="):
            names.append(arg.split("=", 1)[1])
    return names


def spread_inputs(args: Sequence[str]) -> list[str]:
    """Rewrite ``--input A B C`` as ``--input A --input B --input C``.

    The shell expands ``X_rank*.json`` into several words after one ``--input``;
    this keeps them, in order, as inputs of their own.
    """
    out: list[str] = []
    taking = False
    for arg in args:
        if arg == "--":
            taking = False
        elif arg in ("--input", "-i"):
            out.append(arg)
            taking = False
            out.append("\0")  # placeholder: the value follows
            continue
        elif taking and not arg.startswith("-"):
            out += ["--input", arg]
            continue
        else:
            taking = False
        if out and out[-1] == "\0":
            out[-1] = arg
            taking = not arg.startswith("-")
            continue
        out.append(arg)
    if out and out[-1] == "\0":
        out.pop()
    return out


class RunCommand(click.Command):
    """``opguard run``: accepts several words after one ``--input``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, spread_inputs(args))


def _disable_option(func: click.decorators.FC) -> click.decorators.FC:
    return click.option(
        DISABLE_OPTION,
        "disable_plugin",
        multiple=True,
        metavar="NAME",
        help="Block a plugin before it loads (repeatable; also $OPGUARD_DISABLE_PLUGINS).",
        expose_value=False,
        is_eager=True,
    )(func)


#: ``--base-dir``, shared by ``opguard run`` and ``opguard check``
base_dir_option = click.option(
    "--base-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("."),
    show_default=True,
    help="Directory that relative inputs resolve against.",
)


def basic_options(func: click.decorators.FC) -> click.decorators.FC:
    """``--basic`` and ``--basic-list``, shared by ``opguard run`` and ``opguard filter``."""
    func = click.option(
        "--basic-list",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="YAML file replacing the basic filter's list of torch utilities.",
    )(func)
    return click.option("--basic", is_flag=True, help="Run the built-in basic filter.")(func)


def check_basic(manager: OpGuardPluginManager, basic: bool) -> None:
    """``--basic`` with the basic filter disabled is a usage error."""
    if basic and "basic_filter" in manager.disabled:
        raise click.UsageError("--basic needs the basic_filter plugin, which is disabled")


class PluginCommandGroup(click.Group):
    """The ``opguard`` group: its own commands (``run``, ``plugins``) resolve without
    loading a plugin; any other name, or listing the commands, loads the plugins and
    adds the commands they register (``opguard_register_commands``) first."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.plugin_commands: Callable[[], None] = lambda: None

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands:
            self.plugin_commands()
        return super().get_command(ctx, cmd_name)

    def list_commands(self, ctx: click.Context) -> list[str]:
        self.plugin_commands()
        return super().list_commands(ctx)


class ManagerHandle:
    """The plugin manager, made on first use from ``make`` (or given made)."""

    def __init__(self, source: OpGuardPluginManager | Callable[[], OpGuardPluginManager]) -> None:
        self._made: OpGuardPluginManager | None = None if callable(source) else source
        self._make = source if callable(source) else None

    def get(self) -> OpGuardPluginManager:
        if self._made is None:
            assert self._make is not None
            self._made = self._make()
        return self._made

    def disabled(self, args_disabled: Sequence[str]) -> list[str]:
        """The disabled names, without loading plugins when the manager is not made."""
        if self._made is not None:
            return list(self._made.disabled)
        return [*args_disabled, *disabled_from_env()]


def create_cli(
    manager_source: OpGuardPluginManager | Callable[[], OpGuardPluginManager],
    args_disabled: Sequence[str] = (),
) -> click.Group:
    """Build the ``opguard`` command group around a plugin manager, or around a
    function that makes one when a command first needs it (``args_disabled``: the
    ``--disable-plugin`` names that function blocks)."""
    handle = ManagerHandle(manager_source)

    @click.group(cls=PluginCommandGroup, context_settings={"help_option_names": ["-h", "--help"]})
    @click.version_option(__version__, prog_name="opguard")
    @click.option(
        "--log-format",
        type=click.Choice(["console", "json"]),
        default=None,
        help="Log format on stderr (default: console on a terminal, JSON otherwise).",
    )
    @click.option("-v", "--verbose", count=True, help="More detail in logs.")
    @_disable_option
    @click.pass_context
    def cli(ctx: click.Context, log_format: str | None, verbose: int) -> None:
        """OpGuard: which code issues which torch operators on which streams."""
        ctx.ensure_object(dict)
        ctx.obj["log_format"] = log_format
        ctx.obj["verbose"] = verbose
        configure_logging(log_format, verbose)
        for name in unknown_disabled(handle.disabled(args_disabled), BUILTIN_PLUGINS):
            click.echo(f"opguard: warning: {DISABLE_OPTION} {name!r}: no such plugin", err=True)

    @cli.command(cls=RunCommand)
    @click.option(
        "--input",
        "-i",
        "input_options",
        multiple=True,
        metavar="FILE|PATTERN",
        help="A trace file or a quoted glob; shell-expanded rank files may follow it "
        "(repeatable). Relative to --base-dir.",
    )
    @base_dir_option
    @click.option(
        "--output-base",
        type=click.Path(path_type=Path),
        default=None,
        help="Trace output directory for the run directory "
        "(default: $OPGUARD_TRACE_OUTPUT_BASE, else ./opguard_traces).",
    )
    @click.option("-v", "--verbose", count=True, help="Per-stage detail; tracebacks on failure.")
    @basic_options
    @click.option(
        "--skip",
        multiple=True,
        type=click.Choice([s for s in STAGES if s != "discover"]),
        help="Do not run this stage (repeatable); stages that need its output are skipped too.",
    )
    @click.option(
        "--min-count",
        type=click.IntRange(min=1),
        default=DEFAULT_MIN_COUNT,
        show_default=True,
        help="Subtree pruning: fold subtrees with fewer ops than this.",
    )
    @click.option(
        "--min-fraction",
        type=click.FloatRange(min=0.0, max=1.0),
        callback=lambda _ctx, param, value: check_fraction("--min-fraction", value),
        default=DEFAULT_MIN_FRACTION,
        show_default=True,
        help="Subtree pruning: fold subtrees below this fraction of all ops.",
    )
    @click.option(
        "--chains/--no-chains",
        default=True,
        show_default=True,
        help="Fold linear chains of frames.",
    )
    @click.option(
        "--hide",
        multiple=True,
        metavar="REGEX",
        help="Also hide frames whose module:qualname matches REGEX whole (repeatable).",
    )
    @click.option(
        "--focus",
        multiple=True,
        metavar="REGEX",
        help="Keep only callsites with a frame, api or op matching REGEX whole (repeatable).",
    )
    @click.option(
        "--ignore",
        multiple=True,
        metavar="REGEX",
        help="Drop callsites with a frame, api or op matching REGEX whole (repeatable).",
    )
    @click.option(
        "--no-default-hide", is_flag=True, help="Do not hide the default plumbing frames."
    )
    @click.option(
        "--context-depth",
        type=click.IntRange(min=0),
        default=DEFAULT_CONTEXT_DEPTH,
        show_default=True,
        help="How many enclosing nodes an entry's context lists.",
    )
    @click.option(
        "--compressor", default=None, metavar="NAME", help="Use this plugin's compressor."
    )
    @click.option(
        "--executor",
        default="local",
        show_default=True,
        metavar="NAME",
        help="Combine executor: local, or one a plugin provides (e.g. dask).",
    )
    @click.option(
        "--jobs",
        "-j",
        type=click.IntRange(min=0),
        default=0,
        show_default=True,
        help="Processes for combine; 0 picks one per CPU for large multi-file entries.",
    )
    @click.option(
        "--clean-stale",
        is_flag=True,
        help="Remove the temporaries of runs killed in the output base (and mark them "
        "abandoned); without --input, only that.",
    )
    @click.option(
        "--skew",
        type=click.FloatRange(min=0.0),
        default=DEFAULT_SKEW,
        show_default=True,
        metavar="F",
        help="Divergence: report a function whose ops on a rank differ from the median "
        "over ranks by more than F times the median.",
    )
    @click.option(
        "--fail-on-divergence",
        is_flag=True,
        help="Exit 4 when a divergence finding is an error (a collective mismatch).",
    )
    @_disable_option
    @click.pass_context
    def run(
        ctx: click.Context,
        input_options: tuple[str, ...],
        base_dir: Path,
        output_base: Path | None,
        verbose: int,
        basic: bool,
        basic_list: Path | None,
        skip: tuple[str, ...],
        min_count: int,
        min_fraction: float,
        chains: bool,
        hide: tuple[str, ...],
        focus: tuple[str, ...],
        ignore: tuple[str, ...],
        no_default_hide: bool,
        context_depth: int,
        compressor: str | None,
        executor: str,
        jobs: int,
        clean_stale: bool,
        skew: float,
        fail_on_divergence: bool,
    ) -> None:
        """Preprocess callsite traces into instrumentation configs."""
        from opguard_core.run.runner import Runner
        from opguard_core.run.stale import clean_stale_runs

        manager = handle.get()
        inputs = list(input_options)
        if not inputs and not clean_stale:
            raise click.UsageError("give at least one --input")
        _refuse_configs(inputs)
        verbose = verbose + ctx.obj.get("verbose", 0)
        if verbose:
            configure_logging(ctx.obj.get("log_format"), verbose)
        if compressor is not None:
            plugin = manager.get_plugin(compressor)
            if plugin is None or "opguard_compress" not in [
                h.name for h in manager.get_hookcallers(plugin) or []
            ]:
                raise click.UsageError(f"--compressor {compressor}: no such compressor plugin")
        check_basic(manager, basic)
        for option, patterns in (("--hide", hide), ("--focus", focus), ("--ignore", ignore)):
            _check_regexes(patterns, option)
        check_executor(executor, manager.get_plugins())
        base = _output_base(output_base)
        if clean_stale:
            for stale in clean_stale_runs(base):
                click.echo(
                    f"opguard: cleaned stale run directory {str(stale.run_dir)!r}: "
                    f"removed {len(stale.temporaries)} temporary file(s)",
                    err=True,
                )
            if not inputs:
                return
        options = RunOptions(
            base_dir=base_dir,
            min_count=min_count,
            min_fraction=min_fraction,
            chains=chains,
            hide=tuple(hide),
            focus=tuple(focus),
            ignore=tuple(ignore),
            default_hide=not no_default_hide,
            context_depth=context_depth,
            basic=basic,
            basic_list=basic_list,
            compressor=compressor,
            executor=executor,
            jobs=jobs,
            verbose=bool(verbose),
            skew=skew,
            fail_on_divergence=fail_on_divergence,
        )
        runner = Runner(manager, inputs, options, skip=skip, output_base=base)
        try:
            code = runner.run()
        except OutputLocationError as exc:
            click.echo(f"opguard: error: {exc}", err=True)
            ctx.exit(int(ExitCode.USAGE_ERROR))
        except OpGuardError as exc:
            click.echo(f"opguard: error: {exc}", err=True)
            ctx.exit(int(ExitCode.STAGE_FAILED))
        failed = [r for r in runner.recorder.records if r.status == "failed"]
        for record in failed:
            where = f"{record.stage}" + (f" [{one_line(record.entry)}]" if record.entry else "")
            click.echo(f"opguard: {where} failed: {record.error}", err=True)
        if runner.summary_error is not None:
            click.echo(f"opguard: summary not written: {runner.summary_error}", err=True)
        _print_summary(runner)
        click.echo(str(runner.run_dir))
        ctx.exit(int(code))

    @cli.command()
    @click.option("--all", "show_all", is_flag=True, help="Include built-in plugins.")
    @click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
    @_disable_option
    def plugins(show_all: bool, as_json: bool) -> None:
        """List installed plugins: name, distribution, version and hooks."""
        manager = handle.get()
        infos = [p for p in manager.describe() if show_all or not p.builtin]
        if as_json:
            click.echo(
                json.dumps(
                    [
                        {
                            "name": p.name,
                            "distribution": p.distribution,
                            "version": p.version,
                            "hooks": p.hooks,
                            "builtin": p.builtin,
                        }
                        for p in infos
                    ],
                    indent=2,
                )
            )
            return
        if not infos:
            click.echo("no third-party plugins installed (use --all to list built-ins)")
        origins = {p.name: f"{p.distribution or '?'} {p.version or ''}".strip() for p in infos}
        name_width = max((len(p.name) for p in infos), default=0)
        origin_width = max((len(o) for o in origins.values()), default=0)
        for p in infos:
            click.echo(
                f"{p.name:<{name_width}}  {origins[p.name]:<{origin_width}}  {', '.join(p.hooks)}"
            )
        if manager.disabled:
            click.echo(f"disabled: {', '.join(manager.disabled)}")

    def register_plugin_commands() -> None:
        from opguard_core.plugin.manager import call_impl

        cli.plugin_commands = lambda: None  # once
        manager = handle.get()
        for impl in manager.implementations("opguard_register_commands"):
            try:
                call_impl(impl, {"cli": cli, "manager": manager})
            except Exception as exc:
                raise PluginError(
                    f'plugin "{impl.plugin_name}": opguard_register_commands failed: {exc}'
                ) from exc

    assert isinstance(cli, PluginCommandGroup)
    cli.plugin_commands = register_plugin_commands
    if not callable(manager_source):
        register_plugin_commands()  # a manager given made: its commands at once
    return cli


def _output_base(explicit: Path | None) -> Path:
    """The run's output base, checked: one line and exit 2 when it cannot be used."""
    from opguard_core.files.output_dirs import OUTPUT_BASE_ENV, trace_output_base

    base = trace_output_base(explicit)
    what = "--output-base" if explicit is not None else f"${OUTPUT_BASE_ENV}"
    if explicit is None and not os.environ.get(OUTPUT_BASE_ENV):
        what = "output base"
    try:
        return prepare_output_dir(base, what)
    except OutputLocationError as exc:
        click.echo(f"opguard: error: {exc}", err=True)
        sys.exit(int(ExitCode.USAGE_ERROR))


def _print_summary(runner: Runner) -> None:
    """The end-of-run summary: lines for a person on a console, one record in JSON."""
    from opguard_core.logs import current_format, get_logger
    from opguard_core.run.summary import summary_fields, summary_lines

    if runner.run_dir is None:
        return
    summary = runner.summary(final=True)
    if current_format() == "console":
        click.echo("\n".join(summary_lines(summary)), err=True)
    else:
        get_logger().info("run summary", **summary_fields(summary))


def _check_regexes(patterns: Sequence[str], option: str) -> None:
    """Compile each pattern on its own; a bad one is a usage error naming it."""
    from opguard_core.configs.selection import PatternError, compile_patterns

    try:
        compile_patterns(patterns, option)
    except PatternError as exc:
        raise click.UsageError(str(exc)) from None


CONFIG_SUFFIXES = (".yaml", ".yml")


def _refuse_configs(inputs: Sequence[str]) -> None:
    """``run`` reads traces; a YAML config given as input is a usage error that names
    the commands made for configs."""
    for spec in inputs:
        if spec.lower().endswith(CONFIG_SUFFIXES):
            raise click.UsageError(
                f"--input {spec}: a YAML config, not a callsite trace; "
                "use opguard compare, merge, filter or show on configs"
            )


def cli_for(args: Sequence[str]) -> click.Group:
    """The CLI for ``args``: plugins named by ``--disable-plugin`` are blocked first;
    the plugins load when a command needs them."""
    disabled = disabled_from_args(args)

    def make() -> OpGuardPluginManager:
        from opguard_core.plugin.manager import create_plugin_manager

        return create_plugin_manager(disabled)

    return create_cli(make, disabled)


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        cli_for(args).main(args, prog_name="opguard")
    except OpGuardError as exc:  # loading the plugins failed
        from opguard_core.plugin.manager import EssentialPluginError

        if isinstance(exc, EssentialPluginError):
            click.echo(f"Usage error: {exc}", err=True)
            sys.exit(int(ExitCode.USAGE_ERROR))
        if not isinstance(exc, PluginError):
            raise
        click.echo(f"opguard: error: {exc}", err=True)
        sys.exit(int(ExitCode.PLUGIN_ERROR))


if __name__ == "__main__":
    main()
