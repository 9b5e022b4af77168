"""Shared fixtures: the tiny random model (fast tests) and the real default model (integration tests)."""

from __future__ import annotations

import pytest

from tests.factories import make_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def real_model_path():
    """The default GGUF; `make test` pulls it first. Skips only if it is genuinely absent."""
    from stratum.models.registry import DEFAULT_MODEL, model_path

    path = model_path(DEFAULT_MODEL)
    if not path.exists():
        pytest.skip(f"{path} missing: run `stratum pull`")
    return path
