"""QK-Norm's gain initialisation sets its initial logit bound: a key equal to the query gets
g0^2 sqrt(d_head), the largest logit the normalised vectors allow."""

import math

import pytest
import torch

from qklab.config import ConfigError, load_config
from qklab.methods import AttnShape
from qklab.methods.qknorm import QKNorm, QKNormOptions
from qklab.model.rope import Rope


@pytest.mark.parametrize("g0", [1.0, math.sqrt(2.0)])
def test_gain_init_sets_the_logit_bound(g0):
    d = 32
    m = QKNorm(AttnShape(192, 6, 6, d, 0, 4), QKNormOptions(gain_init=g0))
    m.reset_parameters()
    z = torch.randn(1, 6, 5, d) * 7.0
    q, k = m.map_qk(z, z, Rope(64, 10000.0), 0)
    s = (q * k).sum(-1) * m.scale(d)  # (1, 6, 5): each query against its own key
    torch.testing.assert_close(s, torch.full_like(s, g0**2 * math.sqrt(d)), rtol=1e-5, atol=1e-5)
    other = (q[..., :1, :] * k[..., 1:, :]).sum(-1) * m.scale(d)
    assert (other.abs() <= g0**2 * math.sqrt(d) + 1e-4).all()


def test_gain_init_must_be_positive():
    with pytest.raises(ConfigError, match="gain_init must be > 0"):
        load_config("tiny", ["qk.method=qknorm", "qk.qknorm.gain_init=0"])
