"""Beam test helpers: every pipeline here runs on the local FnApiRunner (offline)."""

from __future__ import annotations

import pytest


@pytest.fixture
def make_pipeline():
    """A TestPipeline factory on the FnApiRunner (the default DirectRunner may try to
    download Prism, which fails offline)."""
    from apache_beam.options.pipeline_options import PipelineOptions
    from apache_beam.testing.test_pipeline import TestPipeline

    def make() -> TestPipeline:
        return TestPipeline(options=PipelineOptions(["--runner=FnApiRunner"]))

    return make
