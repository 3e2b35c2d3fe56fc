"""benchmarks/gpu_check.py, the GPU machine's one run, on what a CPU can check quickly: the budget
(a section's timeout, nothing started late), a section's process killed at its timeout or dying
midway (recorded, the run goes on), one whole-step variant in this process on the tiny Llama, and
the summary. The whole script on tiny shapes: ``.venv/bin/python benchmarks/gpu_check.py --out DIR
--smoke`` (minutes: every section in its own process, Inductor's CPU compiles)."""

import importlib.util
import json
import os
import sys

import pytest

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "gpu_check.py")


@pytest.fixture(scope="module")
def gc():
    spec = importlib.util.spec_from_file_location("gpu_check", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # (dataclasses look their module up)
    spec.loader.exec_module(mod)
    yield mod
    del sys.modules["gpu_check"]


def test_a_sections_timeout_is_its_cap_or_what_is_left_and_nothing_starts_late(gc):
    now = [0.0]
    budget = gc.Budget(420, min_start=20, clock=lambda: now[0])
    assert budget.timeout_for(90) == 90
    now[0] = 380.0
    assert budget.timeout_for(90) == 40
    now[0] = 401.0
    assert budget.timeout_for(90) is None


def _run(gc, tmp_path, code: str, timeout: float = 20) -> dict:
    result = tmp_path / "r.json"
    return gc.run_section([sys.executable, "-c", code.replace("RESULT", repr(str(result)))], timeout,
                          str(tmp_path / "logs" / "s.log"), str(result))


def test_a_section_killed_or_dying_midway_is_recorded_with_its_stage_and_log(gc, tmp_path):
    (tmp_path / "logs").mkdir()
    stage = ("import json; json.dump({'status': 'running', 'stage': 'first step', 'result': {'compile_s': 3}}, "
             "open(RESULT, 'w')); ")
    # (the child must start and write its stage before the timeout: a Python start took over 2 s
    # on this machine under 4 busy loops beside the suite, 2026-11-27)
    slow = _run(gc, tmp_path, stage + "print('compiling', flush=True); import time; time.sleep(60)", timeout=6)
    assert slow["status"] == "timed out" and slow["result"] == {"compile_s": 3}
    assert "timed out after 6 s, during: first step" in slow["error"] and "compiling" in slow["error"]
    died = _run(gc, tmp_path, stage + "import os; os._exit(3)")
    assert died["status"] == "crashed" and died["rc"] == 3 and "exit status 3" in died["error"]
    ok = _run(gc, tmp_path, "import json; json.dump({'status': 'ok', 'result': {'x': 1}}, open(RESULT, 'w'))")
    assert ok["status"] == "ok" and ok["result"] == {"x": 1} and "error" not in ok


def test_with_no_budget_left_every_section_is_skipped_and_the_summary_still_written(gc, tmp_path):
    assert gc.main(["--out", str(tmp_path), "--smoke", "--budget-s", "0", "--commit", "abc"]) == 0
    record = json.loads((tmp_path / "summary.json").read_text())
    assert [s["status"] for s in record["sections"].values()] == ["skipped"] * len(gc.SECTIONS)
    assert record["env"]["torch"] and record["env"]["cost_model_row"] == "cpu"
    assert "not started: 0 s left of the 0 s budget" in (tmp_path / "summary.md").read_text()


def test_the_eager_step_on_the_tiny_llama_and_its_row_in_the_summary(gc, tmp_path):
    cfg = gc.config(smoke=True)
    stages = []
    out = {}
    gc.train_step(cfg, "eager", out, stages.append)
    assert stages == ["building the model", "first step", "timed steps (2 warm-up, 1 timed)",
                      "steps back to back (1 a round)"]
    assert out["step_s_back_to_back"] > 0
    assert len(out["losses"]) == 4 and out["step_s"] > 0 and out["allocator_peak"] is None
    n_dense = out["parameters"] - 256 * 64  # all but the embedding table
    assert out["flops"] == 6 * n_dense * 32 + 6 * 2 * 16 * 64 * 32 and out["flops_palm"] > out["flops"]
    fake = dict(out, system="autopar", losses=[x + 1e-3 for x in out["losses"]], allocator_peak=110 * 2**20,
                predicted={"step_s_as_run": 0.1, "step_s_op_by_op": 0.1, "step_s_inductor": 0.05,
                           "step_peak": 100 * 2**20, "step_s_ratio": 1.5, "peak_ratio": 1.1})
    record = {"meta": {"budget_s": 420, "smoke": True, "out": str(tmp_path), "model": cfg.model, "batch": 2,
                       "seq": 16, "seconds": 12}, "env": {"commit": "abc"},
              "sections": {"step-eager": {"status": "ok", "result": out},
                           "step-autopar-off": {"status": "ok", "result": fake}}}
    md = gc.summary_md(record)
    row = next(line for line in md.splitlines() if line.startswith("| autopar-off |"))
    assert "| 100.0 (100.0 / 50.0) | 1.50 | 100.00 MiB | 1.100 |" in row and row.endswith("| 1.0e-03 |")
    assert "One step under torch.profiler" not in md  # no GPU: no kernel profile
    fake["kernel_ms"] = {"wall": 101.0, "matmul": 55.0, "optimizer": 11.5, "Triton (generated)": 20.0}
    md = gc.summary_md(record)
    assert "| autopar-off | 55.0 | 0.0 | 11.5 | 20.0 | 0.0 | 86.5 | 101.0 |" in md
    assert [gc.kernel_kind(k) for k in ("nvjet_tst_128x256_64x4_1x2_h_bz_coopB_NNT", "triton_per_fused_mul_0",
                                        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop",
                                        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel",
                                        "void at::native::elementwise_kernel<128, 4>")] == \
        ["matmul", "Triton (generated)", "attention", "optimizer", "ATen elementwise / other"]
