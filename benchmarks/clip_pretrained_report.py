"""The figures behind tests/test_clip.py and tests/test_pretrained.py, as tables (same jobs):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/clip_pretrained_report.py

- clip_grad_norm_ against torch.nn.utils.clip_grad_norm_ on one process: the relative difference
  of the total norm (orders 2 at both steps, 3, inf), of the replicated gradients' norm alone, and
  the largest differences of the clipped gradients and of the parameters after 2 AdamW steps;
- load_pretrained against from_pretrained: the first step's loss and gradients, bytes read per rank.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import test_clip  # noqa: E402
import test_pretrained  # noqa: E402

from autopar.testing import DistPool  # noqa: E402


def _rel(a, b) -> float:
    return abs(a - b) / abs(b) if b else abs(a)


def _maxdiff(xs: dict, ys: dict) -> float:
    return max(float((xs[k] - ys[k]).abs().max()) for k in ys)


def clip_table(pools) -> None:
    print("| plan | ranks | total norm, step 1 / 2 (rel. diff) | order 3 | inf | replicated grads alone | "
          "clipped grads (max abs diff) | params after 2 AdamW steps (max abs diff) |")
    print("|---|---|---|---|---|---|---|---|")
    for cid, name, axes, plan, options, world in test_clip.CASES:
        ref = test_clip.reference(name, options.get("precision", "fp32"))
        out = pools[world].run(test_clip.clip_job, name, axes, plan, ref["max_norm"], **options)
        totals = " / ".join(f"{_rel(out['totals'][i][0][0], ref['total'][i]):.1e}" for i in range(test_clip.STEPS))
        rep = torch.nn.utils.get_total_norm([ref["raw"][k] for k in out["replicated"]], 2.0).item() \
            if out["replicated"] else 0.0
        grads = max(_maxdiff(out["grads"][i], ref["grads"][i]) for i in range(test_clip.STEPS))
        print(f"| {cid} | {world} | {totals} | {_rel(out['p3'], ref['p3']):.1e} | {_rel(out['inf'], ref['inf']):.1e} | "
              f"{_rel(out['replicated_norm'], rep):.1e} ({len(out['replicated'])} tensors) | {grads:.1e} | "
              f"{_maxdiff(out['params'], ref['params']):.1e} |")
        sys.stdout.flush()


def pretrained_table(pools) -> None:
    import pathlib
    import shutil

    root = tempfile.mkdtemp(prefix="autopar-hf-report-")
    ckpts = test_pretrained.make_checkpoints(pathlib.Path(root))
    print("| plan | built with | checkpoint | loss rel. diff | max grad abs diff | max grad rel. diff | "
          "bytes read per rank / checkpoint |")
    print("|---|---|---|---|---|---|---|")
    for cid, ckpt, axes, plan, build in test_pretrained.CASES:
        ref = ckpts["ref"][ckpt]
        out = pools[2].run(test_pretrained.pretrained_job, ckpts[ckpt], axes, plan, ckpt == "tied", build)
        rel = max(float(((out["grads"][k] - g).abs() / g.abs().clamp_min(1e-6)).max()) for k, g in ref["grads"].items())
        per = ", ".join(f"{b:,}" for b, _ in out["report"]["per_rank"])
        print(f"| {cid} | {build} | {ckpt} | {_rel(out['loss'], ref['loss']):.1e} | "
              f"{_maxdiff(out['grads'], ref['grads']):.1e} | {rel:.1e} | {per} / {out['report']['model_bytes']:,} |")
        sys.stdout.flush()
    shutil.rmtree(root, ignore_errors=True)


def main():
    torch.set_num_threads(1)
    pools = {2: DistPool(2), 4: DistPool(4)}
    try:
        clip_table(pools)
        print()
        pretrained_table(pools)
    finally:
        for p in pools.values():
            p.close()


if __name__ == "__main__":
    main()
