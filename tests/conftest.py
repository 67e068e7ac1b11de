"""Shared fixtures: the tiny generated Glm5Next checkpoint and a loaded CPU reference engine (once per session)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight bf16 Glm5Next checkpoint (seed 0, the demo's shape) with the GLM tokenizer."""
    from glm53.fixture.hf import write_hf_checkpoint

    return write_hf_checkpoint(tmp_path_factory.mktemp("hf-tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def reference_engine(hf_model_dir: Path) -> Iterator:
    """A loaded ReferenceEngine on hf_model_dir. Shared: don't close it or change its settings in a test."""
    from glm53.engine.reference import ReferenceEngine

    engine = ReferenceEngine(hf_model_dir, max_running=8)
    engine.load()
    yield engine
    engine.close()
