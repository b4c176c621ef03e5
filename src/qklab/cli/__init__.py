"""The command line: argument parsing, and each command one call into the rooms below (``qklab --help``).

    main.py    the parser, the commands, how an error becomes one line and an exit code
    study.py   qklab study run|status
    demo.py    qklab demo (the main job)
    sweep.py   qklab sweep (a study from command-line variants)
"""

from qklab.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
