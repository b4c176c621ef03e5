"""The one validation of the methods' options (``qklab.methods.options``, ``qklab.fields``): each field's range
and choices from its metadata and type, then the rules across fields, one line naming the key."""

from __future__ import annotations

import pytest

from qklab.fields import between
from qklab.methods import CONTROLLERS, METHODS
from qklab.methods.base import NoOptions
from qklab.methods.options import Options
from qklab.methods.qkclip import QKClipOptions
from qklab.methods.qknorm import QKNormOptions
from qklab.methods.quack import QuacKOptions


def test_every_options_class_validates_under_its_own_section():
    for name, cls in {**METHODS, **CONTROLLERS}.items():
        if cls.Options is not NoOptions:
            assert issubclass(cls.Options, Options) and cls.Options.section == f"qk.{name}", name
            cls.Options().validate()  # the defaults are valid


@pytest.mark.parametrize("opts, says", [
    (QuacKOptions(clamp=0.5), r"qk.quack.clamp=0.5 is out of range: it must be 0 \(off\) or >= 1"),
    (QKClipOptions(gqa="max"), "qk.qkclip.gqa='max': use min or exact"),
    (QKNormOptions(stats="flat", k_group=2), "qk.qknorm.stats=flat already takes one key statistic over all heads"),
])
def test_a_broken_rule_is_one_line_naming_the_key(opts, says):
    with pytest.raises(ValueError, match=f"^{says}") as e:  # ConfigError for a range or a choice
        opts.validate()
    assert "\n" not in str(e.value)


def test_between_opens_either_end_on_request():
    ok, text = between(0, 1, lo_open=True)
    assert text == "in (0, 1]" and [ok(v) for v in (0, 0.5, 1, 1.5)] == [False, True, True, False]
    ok, text = between(0, 1, hi_open=True, note=", e.g. 0.9")
    assert text == "in [0, 1), e.g. 0.9" and [ok(v) for v in (0, 1)] == [True, False]
