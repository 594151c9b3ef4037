"""Bounds per leaf on tied arrays: one array, one pair of bounds, in either form."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sciflat
from helpers import Tied


def _tied_fit(bounds):
    lin = eqx.nn.Linear(1, 1, key=jax.random.key(0))
    model = Tied(lin, lin)  # `.b` is `.a`: one weight, one bias in `p`
    loss = lambda m: jnp.sum((m(jnp.ones(1)) - 10.0) ** 2)
    return sciflat.minimize(loss, model, bounds=bounds, progress=False)


def test_the_same_bounds_for_two_tied_uses_are_accepted_in_dict_form():
    same = (-1.0, 1.0)
    both = _tied_fit({".a.weight": same, ".b.weight": same, ".a.bias": same})
    one = _tied_fit({".a.weight": same, ".a.bias": same})
    # The bounds are active (the unbounded optimum is far outside), and giving them
    # for both uses is the same problem as giving them once.
    assert both.status == "converged", both.message
    np.testing.assert_allclose(both.p, [1.0, 1.0])
    np.testing.assert_array_equal(both.p, one.p)
    arrays = (np.array([[-1.0]]), np.array([[1.0]]))  # equal values, other objects
    by_array = _tied_fit({".a.weight": arrays, ".b.weight": arrays, ".a.bias": same})
    np.testing.assert_array_equal(by_array.p, one.p)


def test_different_bounds_on_one_tied_array_are_refused_in_dict_form():
    with pytest.raises(ValueError, match=r"differ for `\.b\.weight` and `\.a\.weight`"):
        _tied_fit({".a.weight": (-1.0, 1.0), ".b.weight": (-2.0, 1.0)})
    with pytest.raises(ValueError, match=r"differ for `<lambda>` and `\.a\.bias`"):
        _tied_fit({".a.bias": (-1.0, 1.0), lambda m: m.b.bias: (-1.0, None)})
