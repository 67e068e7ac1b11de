"""Shared fixtures: the tiny generated Glm5Next checkpoint and a loaded CPU reference engine (once per session)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings as hypothesis_settings

# CI replays the same examples on every run (a red run must be reproducible, and must not depend on luck);
# local runs keep exploring new ones, which is where the property tests find bugs.
hypothesis_settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    hypothesis_settings.load_profile("ci")


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight bf16 Glm5Next checkpoint (seed 0, the demo's shape) with the GLM tokenizer and the
    chat template that behaves like the real GLM-5.3-Flash one."""
    from glm53.fixture.hf import write_hf_checkpoint

    return write_hf_checkpoint(tmp_path_factory.mktemp("hf-tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def hf_model_dir_glm45(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same checkpoint carrying the GLM-4.5-shaped chat template (the second template variant)."""
    from glm53.fixture.hf import write_hf_checkpoint

    return write_hf_checkpoint(tmp_path_factory.mktemp("hf-tiny-glm45") / "model", seed=0, template="glm45")


def make_test_engine(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory, template: str):
    """The engine the server suites run against (not loaded). By default the CPU ReferenceEngine on `hf_dir`.
    With GLM53_TEST_ENGINE=exl3 (the GPU machine) the exllamav3 engine in exact mode on a tiny generated EXL3
    checkpoint carrying the same template, with a quarter of each layer's experts in VRAM so the PCIe lane and
    evictions are exercised too."""
    if os.environ.get("GLM53_TEST_ENGINE", "reference") == "exl3":
        from specs import spec_for

        from glm53.engine.exl3_engine import Exl3Engine
        from glm53.fixture.exl3 import write_exl3_checkpoint

        path = write_exl3_checkpoint(tmp_path_factory.mktemp(f"exl3-tiny-{template}") / "model", seed=0,
                                     template=template)
        return Exl3Engine(path, spec_for(path, "exact", 4, device="cuda:0", max_concurrency=8))
    from glm53.engine.reference import ReferenceEngine

    return ReferenceEngine(hf_dir, max_running=8)


@pytest.fixture(scope="session")
def reference_engine(hf_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """The loaded engine the server suites run against (see make_test_engine), on the GLM-5.3-shaped template.
    Shared: don't close it or change its settings in a test."""
    engine = make_test_engine(hf_model_dir, tmp_path_factory, "glm53")
    engine.load()
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def exl3():
    """exllamav3 on a CUDA GPU (the GPU machine's tests), else the test is skipped."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return pytest.importorskip("exllamav3")
