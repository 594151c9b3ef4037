import os

import hypothesis
import jax
import pytest


# The suite runs with 64-bit mode on, so float64 is available everywhere; the few tests
# about what happens without it ask for the `x64_off` fixture.
jax.config.update("jax_enable_x64", True)


# In CI the property tests draw the same examples every run, so a CI failure can be
# reproduced from the log; a local run draws new ones (and keeps failures in
# `.hypothesis/`), which is how new failures are found.
hypothesis.settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    hypothesis.settings.load_profile("ci")


@pytest.fixture
def x64_off():
    with jax.enable_x64(False):
        yield


# The example runs train real models (in subprocesses, too): seconds each, so the whole
# file is in the slow tier. Marked here rather than in the file, which other features'
# owners edit.
_SLOW_FILES = ("test_examples.py",)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in _SLOW_FILES:
            item.add_marker(pytest.mark.slow)
