"""Beam's DaskRunner with its bundle bug fixed: outputs a DoFn emits in `finish_bundle` are kept.

    python -m beam_jobs.curate ... --runner=beam_jobs.dask_runner.DaskRunner \\
        --dask_client_address=tcp://127.0.0.1:8786

Beam 2.77's DaskRunner (`apache_beam.runners.dask`) runs each Dask partition as a bundle,
but collects the bundle's outputs *before* it calls `finish_bundle`, so whatever a DoFn
emits there is silently dropped. The curation job buffers in three DoFns and flushes in
`finish_bundle` (its sorted spill runs, its LSH band keys, its per-bundle counters), so on
the upstream runner it wrote incomplete shards and a stats.json of zeros. This runner is the
upstream one with that one function corrected (the bundle's outputs are taken after
`finish_bundle`); everything else (the Dask client, options, graph) is Beam's. The other
limit found (tagged outputs, `ParDo.with_outputs`) is avoided in the job itself
(`beam_jobs.transforms.SplitTagged`); docs/curation.md has both.
"""

from __future__ import annotations

from typing import Any

import apache_beam as beam
from apache_beam.runners.common import DoFnInvoker
from apache_beam.runners.dask import dask_runner
from apache_beam.runners.dask import transform_evaluator as upstream


def apply_dofn_to_bundle(
    items: Any, do_fn_invoker_args: Any, do_fn_invoker_kwargs: Any, tagged_receivers: Any
) -> list[Any]:
    """Run a DoFn over one Dask partition as one bundle (upstream's, in the right order).

    Module level, so Dask pickles it by reference: the workers import this module."""
    invoker = DoFnInvoker.create_invoker(*do_fn_invoker_args, **do_fn_invoker_kwargs)
    invoker.invoke_setup()
    invoker.invoke_start_bundle()
    for item in items:
        invoker.invoke_process(item)
    invoker.invoke_finish_bundle()  # its outputs reach the receivers too
    invoker.invoke_teardown()
    return [v.value for v in tagged_receivers.values]


class ParDo(upstream.ParDo):
    """Upstream's ParDo translation, building its partitions with the function above."""

    def apply(self, input_bag: Any, side_inputs: Any = None) -> Any:
        original = upstream.apply_dofn_to_bundle
        upstream.apply_dofn_to_bundle = apply_dofn_to_bundle  # read by upstream's apply
        try:
            return super().apply(input_bag, side_inputs)
        finally:
            upstream.apply_dofn_to_bundle = original


class DaskRunner(dask_runner.DaskRunner):
    """`apache_beam.runners.dask.dask_runner.DaskRunner` with `ParDo` translated above."""

    def run_pipeline(self, pipeline: Any, options: Any) -> Any:
        translations = upstream.TRANSLATIONS  # the table the upstream visitor reads
        original = translations[beam.ParDo]
        translations[beam.ParDo] = ParDo
        try:
            return super().run_pipeline(pipeline, options)
        finally:
            translations[beam.ParDo] = original
