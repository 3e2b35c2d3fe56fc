"""Predicted vs allocator-measured peak memory and predicted vs process-group-counted bytes, 2 gloo ranks:
    .venv/bin/python benchmarks/memory_vs_prediction.py"""
import sys
from autopar.testing import DistPool, parity_job
from autopar.ir import bytes_by_collective


def main():
    pool = DistPool(2)
    cases = [("fsdp dp=2", {"dp": 2}, {"dp": "fsdp"}, {}), ("megatron tp=2", {"tp": 2}, {"tp": "megatron"}, {}),
             ("fsdp dp=2 accumulate=2", {"dp": 2}, {"dp": "fsdp"}, {"accumulate": 2})]
    print("| plan | predicted step peak | allocator step peak (w/o gloo buffers) | ratio | predicted tensor peak | op-output peak | ratio | predicted bytes/step | counted bytes/step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, axes, plan, opts in cases:
        out = pool.run(parity_job, "llama", axes, plan, **opts)
        p, m = out["predicted_memory"], out["memory"]
        step = m["parameters"] + m["optimizer_state"] + m["program_peak_without_backend"]
        pb = sum(bytes_by_collective(out["records"]).values())
        mb = sum(v["wire_bytes"] for v in out["measured"].values()) / out["steps"]
        print(f"| {label} | {p['step_peak']:,} | {step:,} | {step / p['step_peak']:.3f} | {p['tensor_peak']:,} | "
              f"{m['tensor_peak']:,} | {m['tensor_peak'] / p['tensor_peak']:.3f} | {pb:,.0f} | {mb:,.0f} |")
        sys.stdout.flush()
    pool.close()


if __name__ == "__main__":
    main()
