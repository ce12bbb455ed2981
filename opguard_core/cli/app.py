"""The ``opguard`` command line.

The CLI is built by :func:`create_cli` from a plugin manager, or from a function that
makes one, so plugins can add commands (``opguard_register_commands``) without
import-time side effects. ``--disable-plugin`` is read from the arguments *before*
any plugin is loaded. Plugins are loaded only when a command needs them: ``opguard
--version`` and ``opguard run --help`` load none, and import neither pluggy,
structlog, msgspec nor rich (start-up: docs/performance.md).
"""

from __future__ import annotations

import errno
import json
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import click

from opguard_core import __version__
from opguard_core.cli import exits
from opguard_core.cli.checks import unknown_disabled
from opguard_core.cli.exits import code_of
from opguard_core.cli.options import DISABLE_OPTION, disable_option
from opguard_core.cli.run_command import make_run_command
from opguard_core.errors import ExitCode, PluginError, UsageProblem
from opguard_core.logs import configure_logging
from opguard_core.plugin.names import BUILTIN_PLUGINS, disabled_from_env

if TYPE_CHECKING:
    from opguard_core.plugin.manager import OpGuardPluginManager


#: the group's options that take a value (the value is not the command's name)
_GROUP_VALUE_OPTIONS = ("--log-format", DISABLE_OPTION)
#: the commands that take ``--disable-plugin`` after their name too
_COMMANDS_DISABLING = ("run", "plugins")


def disabled_from_args(args: Sequence[str]) -> list[str]:
    """Values of ``--disable-plugin NAME`` / ``--disable-plugin=NAME`` before the
    command's name, and after it for ``run`` and ``plugins``: what follows any other
    command is its own (``opguard trace python job.py --disable-plugin x`` passes the
    option to the program)."""
    names = []
    command = None
    index = 0
    while index < len(args):
        arg = args[index]
        if arg == "--":
            break
        if arg == DISABLE_OPTION and index + 1 < len(args):
            names.append(args[index + 1])
        elif arg.startswith(DISABLE_OPTION + "="):
            names.append(arg.split("=", 1)[1])
        elif command is None and not arg.startswith("-"):
            command = arg
            if command not in _COMMANDS_DISABLING:
                break
        if command is None and arg in _GROUP_VALUE_OPTIONS:
            index += 1  # its value
        index += 1
    return names


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
    @disable_option
    @click.pass_context
    def cli(ctx: click.Context, log_format: str | None, verbose: int) -> None:
        """OpGuard: which code issues which torch operators on which streams."""
        ctx.ensure_object(dict)
        ctx.obj["log_format"] = log_format
        ctx.obj["verbose"] = verbose
        configure_logging(log_format, verbose)
        for name in unknown_disabled(handle.disabled(args_disabled), BUILTIN_PLUGINS):
            click.echo(f"opguard: warning: {DISABLE_OPTION} {name!r}: no such plugin", err=True)

    cli.add_command(make_run_command(handle.get, lambda: handle.disabled(args_disabled)))

    @click.option("--all", "show_all", is_flag=True, help="Include built-in plugins.")
    @click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
    @disable_option
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

    cli.add_command(exits.command("plugins", {ExitCode.OK: None})(plugins))

    def register_plugin_commands() -> None:
        from opguard_core.plugin.manager import call_impl

        cli.plugin_commands = lambda: None  # once
        manager = handle.get()
        for impl in manager.implementations("opguard_register_commands"):
            try:
                call_impl(impl, {"cli": cli, "manager": manager})
            except PluginError:
                raise
            except Exception as exc:
                raise PluginError(
                    f'plugin "{impl.plugin_name}": opguard_register_commands failed: {exc}'
                ) from exc

    assert isinstance(cli, PluginCommandGroup)
    cli.plugin_commands = register_plugin_commands
    if not callable(manager_source):
        register_plugin_commands()  # a manager given made: its commands at once
    return cli


def cli_for(args: Sequence[str]) -> click.Group:
    """The CLI for ``args``: plugins named by ``--disable-plugin`` are blocked first;
    the plugins load when a command needs them."""
    disabled = disabled_from_args(args)

    def make() -> OpGuardPluginManager:
        from opguard_core.plugin.manager import create_plugin_manager

        return create_plugin_manager(disabled)

    return create_cli(make, disabled)


#: what writing standard output may fail with: a full disk or quota, an I/O error
_OUTPUT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG})


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point (``argv``: called in a process of the caller's, as
    tests do, which never ends without teardown: :func:`exits.watch_exit`)."""
    if argv is None:  # the console script, or python -m: this process is ours to end
        exits.watch_exit()
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        cli_for(args).main(args, prog_name="opguard")
    except (PluginError, UsageProblem) as exc:  # loading the plugins failed
        click.echo(f"opguard: error: {exc}", err=True)
        exits.exit_code_known(int(code_of(exc)))
        sys.exit(int(code_of(exc)))
    except SystemExit as exc:  # how click ends every command
        exits.exit_code_known(exc.code)
        raise
    except OSError as exc:
        if exc.filename is not None or exc.errno not in _OUTPUT_ERRNOS:
            raise  # a bug: its traceback
        # standard output could not be written (a full disk, /dev/full): click's own
        # handling covers only a closed pipe
        click.echo(f"opguard: error: cannot write standard output: {exc.strerror}", err=True)
        exits.exit_code_known(int(ExitCode.STAGE_FAILED))
        sys.exit(int(ExitCode.STAGE_FAILED))


if __name__ == "__main__":
    main()
