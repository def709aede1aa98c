"""The performance bars on a GPU: Qwen3-0.6B (dummy bf16 weights at the real config), minisgl with all
switches on against SGLang measured on the same kind of card.

- W1 (offline throughput) output tokens/s >= 0.6x SGLang's;
- W2 (one request at a time) time per output token <= 1.5x SGLang's;
- the report JSON (notebook 09, `autograder/report.py`) holds the ablation table.

Baselines: `autograder/baselines/<gpu>.json` for known GPUs (shipped: NVIDIA H200); on another GPU with
`sglang` installed, the fixture measures SGLang first (`autograder/measure_sglang.py`, minutes) and saves the
file. Everything here skips on a machine without a CUDA GPU, saying why.
"""

from __future__ import annotations

import os

import adapters
import pytest
import report
import torch

pytestmark = pytest.mark.gpu
MODEL = "qwen3-0.6b"


@pytest.fixture(scope="module")
def gpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU here: the performance bars (W1 throughput >= 0.6x SGLang, W2 TPOT <= 1.5x "
                    "SGLang on Qwen3-0.6B) are graded on a GPU; run `python -m pytest autograder/graders -m gpu` there")
    return torch.cuda.get_device_name()


@pytest.fixture(scope="module")
def baseline(gpu):
    data = report.find_baseline(gpu)
    if data is None:
        try:
            import sglang  # noqa: F401
        except ImportError:
            pytest.skip(f"no SGLang baseline for {gpu!r} in autograder/baselines/ and sglang is not installed: "
                        "install sglang and run `python autograder/measure_sglang.py` on this GPU")
        import measure_sglang

        data = measure_sglang.measure_and_save(gpu)
    row = data.get("sglang", {}).get(MODEL, {}).get("default")
    if not row:
        pytest.skip(f"the baseline for {gpu!r} has no sglang.{MODEL}.default row")
    return row


@pytest.fixture(scope="module")
def measured(gpu):
    """minisgl (the student's package) on W1 and W2 with every switch on (the defaults)."""
    scale = float(os.environ.get("MINISGL_GRADER_SCALE", "1.0"))
    llm = adapters.llm(str(report.ROOT / "assets" / "configs" / MODEL), load_format="dummy", dtype="bfloat16")
    w1 = adapters.run_workload(llm, "w1", scale=scale)
    w2 = adapters.run_workload(llm, "w2", scale=scale)
    return {"w1_output_tok_per_s": w1["output_tok_per_s"], "w2_ttft_ms": w2["ttft_ms_median"],
            "w2_tpot_ms": w2["tpot_ms_median"], "scale": scale}


def test_throughput_bar(measured, baseline):
    ours, theirs = measured["w1_output_tok_per_s"], baseline["w1_output_tok_per_s"]
    assert ours >= report.THROUGHPUT_BAR * theirs, (
        f"W1: {ours:.0f} output tok/s is {ours / theirs:.2f}x SGLang's {theirs:.0f}; the bar is "
        f"{report.THROUGHPUT_BAR}x")


def test_tpot_bar(measured, baseline):
    ours, theirs = measured["w2_tpot_ms"], baseline["w2_tpot_ms"]
    assert ours <= report.TPOT_BAR * theirs, (
        f"W2: TPOT {ours:.3f} ms is {ours / theirs:.2f}x SGLang's {theirs:.3f} ms; the bar is {report.TPOT_BAR}x")


def test_report_has_ablation_table(gpu):
    data = report.load_report()
    assert data is not None, f"no report at {report.report_path()} (notebook 09 writes it; $MINISGL_REPORT moves it)"
    problems = report.report_problems(data)
    assert not problems, "the report is incomplete:\n" + "\n".join(problems)
