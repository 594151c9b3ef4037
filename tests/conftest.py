import jax
import pytest


# The suite runs with 64-bit mode on, so float64 is available everywhere; the few tests
# about what happens without it ask for the `x64_off` fixture.
jax.config.update("jax_enable_x64", True)


@pytest.fixture
def x64_off():
    with jax.enable_x64(False):
        yield
