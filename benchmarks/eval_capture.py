"""Compile time with the eval program captured on its first call (the default) against at compile
(``capture_eval="compile"``, the behaviour before 2026-12-02).

    python benchmarks/eval_capture.py [--rounds 3] [--models hf_llama,gpt,llama]

Each measurement is a fresh process (what one training job pays: dynamo's and export's first-use
set-up included), the two ways alternating within a round; one process mesh (``autopar.mesh(dp=1)``)
under fsdp. Prints, per model and way, the compile's seconds, the first ``pm(x)``'s seconds and
the eval output's largest difference from the model run eagerly; then medians and the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

_CHILD = r'''
import json, sys, time, warnings
warnings.simplefilter("ignore")
import torch, autopar
from autopar.testing import build_model
name, way = sys.argv[1], sys.argv[2]
model, batches, loss_fn = build_model(name)
eager, _, _ = build_model(name)
eager.load_state_dict(model.state_dict())
t = time.perf_counter()
pm = autopar.compile(model, autopar.mesh(dp=1), example_inputs=batches[0], loss_fn=loss_fn, plan={"dp": "fsdp"},
                     capture_eval=True if way == "first_call" else "compile")
compiled = time.perf_counter() - t
t = time.perf_counter()
out = pm(batches[0][0])
first = time.perf_counter() - t
with torch.no_grad():
    ref = eager(batches[0][0])
logits = lambda o: o.logits if hasattr(o, "logits") else o
print(json.dumps({"compile": compiled, "first_eval": first, "diff": (logits(out) - logits(ref)).abs().max().item()}))
'''


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", default="hf_llama,gpt,llama")
    args = ap.parse_args()
    ways = ("first_call", "compile")
    got = {}
    for r in range(args.rounds):
        for name in args.models.split(","):
            for way in ways if r % 2 == 0 else ways[::-1]:
                out = subprocess.run([sys.executable, "-c", _CHILD, name, way], capture_output=True, text=True,
                                     check=True)
                res = json.loads(out.stdout.strip().splitlines()[-1])
                got.setdefault((name, way), []).append(res)
                print(f"round {r} {name:9s} {way:10s} compile {res['compile']:.2f}s first pm(x) "
                      f"{res['first_eval']:.2f}s diff {res['diff']:.1e}", flush=True)
    print()
    for name in args.models.split(","):
        med = {w: {k: statistics.median(x[k] for x in got[(name, w)]) for k in ("compile", "first_eval")}
               for w in ways}
        a, b = med["first_call"], med["compile"]
        print(f"{name:9s} compile: {a['compile']:.2f}s first call vs {b['compile']:.2f}s at compile "
              f"({a['compile'] / b['compile']:.2f}x); compile + first pm(x): {a['compile'] + a['first_eval']:.2f}s vs "
              f"{b['compile'] + b['first_eval']:.2f}s ({(a['compile'] + a['first_eval']) / (b['compile'] + b['first_eval']):.2f}x)")


if __name__ == "__main__":
    main()
