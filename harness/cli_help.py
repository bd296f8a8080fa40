"""How the command line's ``--help`` shows its options: a flag reads as a flag (``--check``), never as an option
that takes a ``<bool>``, and an argument that takes several values names the type of one (``configs...
<path>``, not ``<list[Path]>``). One rule for every command, the built-in ``--help`` among them."""

from __future__ import annotations

import re

import typer.core


def plain_params(command, ctx) -> None:
    """Show ``command``'s flags without a type and its many-valued arguments by the type of one value."""
    params = list(command.params)
    help_option = command.get_help_option(ctx)
    if help_option is not None:
        params.append(help_option)
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""  # a flag takes no value: the help shows none
        elif param.nargs != 1 and hasattr(param, "display_type_rich"):
            shown = param.display_type_rich(ctx=ctx)
            one = re.fullmatch(r"<list\[(\w+)\]>(\.\.\.)?", str(shown or ""))
            if one:  # the "..." after the argument's name already says it takes several
                param.display_type_rich = lambda ctx, text=f"<{one.group(1).lower()}>": text


class HelpGroup(typer.core.TyperGroup):
    """A command group whose own help and every subcommand's show options by :func:`plain_params`."""

    def get_command(self, ctx, cmd_name):
        command = super().get_command(ctx, cmd_name)
        if command is not None and not isinstance(command, HelpGroup):
            plain_params(command, ctx)
        return command

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)
        if option is not None and option.metavar is None:
            option.metavar = ""
        return option
