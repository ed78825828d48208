"""`engram-ray` console script: dispatches to `engram_ray.commands.<name>`.

Errors a user can cause print one line on stderr and exit with code 2, never a traceback; a
reader that closes the pipe early (`engram-ray plan --json | head`) ends the command quietly.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from engram_ray import __version__
from engram_ray.commands import COMMANDS
from engram_ray.errors import EngramRayError

USAGE_ERROR = 2
# What a shell reports for a process killed by SIGPIPE (128 + 13): `cmd | head` looks the same
# whichever way the writer ended.
BROKEN_PIPE_EXIT = 141


class HelpFormatter(argparse.HelpFormatter):
    """Appends `(default: X)` to options whose help does not state their default already.
    Flags (default False) and options without a default stay as they are."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if ("default" in text or default in (None, False, argparse.SUPPRESS)
                or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)".lstrip()


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):  # argparse's default also exits 2; keep it to one line
        self.exit(USAGE_ERROR, f"engram-ray: error: {message}\n")


def _command_name(argv: list[str]) -> str | None:
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = _Parser(prog="engram-ray", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"engram-ray {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    wanted = _command_name(argv)
    for name, module_name in COMMANDS.items():
        if wanted is not None and wanted != name and wanted in COMMANDS:
            sub.add_parser(name)  # listed, but its module is not imported
            continue
        module = importlib.import_module(f"engram_ray.commands.{module_name}")
        module.configure(sub.add_parser(name, help=module.HELP, description=module.HELP))
        sub.choices[name].set_defaults(func=module.run)
    return parser


def _quiet_stdout() -> None:
    """After EPIPE: point stdout at /dev/null so the interpreter's final flush stays silent."""
    try:
        fileno = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (captured in tests)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fileno)
    os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = None
    try:
        args = build_parser(argv).parse_args(argv)
        code = args.func(args) or 0
        sys.stdout.flush()  # inside the try: a closed pipe shows here, not at exit
        return code
    except BrokenPipeError:
        _quiet_stdout()
        return BROKEN_PIPE_EXIT
    except EngramRayError as exc:
        print(f"engram-ray {getattr(args, 'command', '')}: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
