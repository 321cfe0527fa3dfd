"""benchmarks/decode_matmuls.py: the step's matmul shapes are the model's projections."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from decode_matmuls import step_shapes, time_rows  # noqa: E402

from pipeline.config import ModelConfig  # noqa: E402


def test_the_100m_step_multiplies_every_projection_weight_once():
    shapes = step_shapes(ModelConfig(preset="100m"))
    assert len(shapes) == 12 * 4
    # per layer: q/k/v (12 + 2 x 4 heads of 64) x 768, o 768 x 768, gate/up 2 x 2048 x
    # 768, down 768 x 2048
    assert shapes[:4] == [(1280, 768), (768, 768), (4096, 768), (768, 2048)]
    assert sum(o * i for o, i in shapes) == 12 * 6_291_456


def test_every_layout_is_timed():
    times = time_rows(step_shapes(ModelConfig(preset="tiny")), 4, "bfloat16", repeats=1)
    assert set(times) == {"feature major", "token major", "torch"}
    assert all(t > 0 for t in times.values())
