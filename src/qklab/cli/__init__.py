"""The command line: argument parsing, and each command one call into the rooms below (``qklab --help``).

    commands.py  the parser, the commands, how an error becomes one line and an exit code
    study.py     qklab study run|status
    demo.py      qklab demo (the main job)
    sweep.py     qklab sweep (a study from command-line variants)
    pipe.py      a closed stdout pipe (`qklab ... | head`): exit 141, quietly

``qklab --version`` answers here, before the parser's imports bring torch in.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if list(args) == ["--version"]:
        from qklab.version import version_line

        try:
            print(version_line(), flush=True)
        except BrokenPipeError:
            from qklab.cli.pipe import closed_pipe

            return closed_pipe()
        return 0
    from qklab.cli.commands import main as run

    return run(argv)


def build_parser() -> argparse.ArgumentParser:
    from qklab.cli.commands import build_parser as build

    return build()


__all__ = ["build_parser", "main"]
