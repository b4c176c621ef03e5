"""The base of each method's and controller's ``Options``: a dataclass of typed fields (``qklab.fields``:
``option``, the ranges ``between``/``at_least``/``above``) declared with the section its keys sit in.
``Options.validate`` checks each field's range and choices (``qklab.fields.check_fields``), then the rules
across fields a range cannot state (``check``). methods/ never imports the config.
"""

from __future__ import annotations

from typing import Any, ClassVar

from qklab.fields import check_fields


class Options:
    """Base of a method's or controller's ``Options`` dataclass, declared with the section its keys sit in
    (``class SoftCapOptions(Options, section="qk.softcap")``): ``validate`` checks each field against its
    range and choices, then the rules across fields (``check``)."""

    section: ClassVar[str] = ""

    def __init_subclass__(cls, section: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.section = section or cls.section

    def validate(self) -> None:
        """Raise ValueError (``ConfigError`` for a range or a choice), one line naming the key, for the first
        broken rule; ``qklab.config`` and ``qklab.methods.build`` pass it on as a ``ConfigError``."""
        check_fields(self.section, self)
        self.check()

    def check(self) -> None:
        """The rules across fields that no single field's range states; raise ValueError (one line)."""
