"""Dropout: autopar's position-hashed masks against torch's own dropout, as loss curves.

    .venv/bin/python benchmarks/dropout_curve.py [--steps 300] [--p 0.1]

GPT-2 (2 layers, hidden 64, vocab 128, eager attention) with dropout p on the embeddings, the
attention weights and the residuals, AdamW lr 1e-3, 8 fixed batches of 4 x 16 tokens in turn:

- eager PyTorch on one process (torch's generator draws the masks);
- autopar fsdp on 2 gloo ranks (autopar/dropout.py draws them);
- both with p = 0 (the curve dropout changes).

The masks differ, so the curves differ step by step; what must agree is the distribution: the
mean loss over windows of the run, within the spread of the step-to-step noise. Prints a table.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from autopar.testing import DistPool

SEQ, BATCH, VOCAB, N_BATCHES = 16, 4, 128, 8


def _build(p: float):
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=4, resid_pdrop=p,
                                  embd_pdrop=p, attn_pdrop=p, use_cache=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
               for _ in range(N_BATCHES)]
    return model, batches


def _ce(logits, y):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def eager(p: float, steps: int) -> list[float]:
    model, batches = _build(p)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(7)
    out = []
    for i in range(steps):
        x, y = batches[i % N_BATCHES]
        loss = _ce(model(x).logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def autopar_job(p: float, steps: int) -> list[float]:
    import autopar

    model, batches = _build(p)
    pm = autopar.compile(model, autopar.mesh(dp=2), example_inputs=batches[0], loss_fn=_ce, plan={"dp": "fsdp"},
                         capture_eval=False)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    out = []
    for i in range(steps):
        out.append(pm.train_step(*batches[i % N_BATCHES]).item())
        opt.step()
        opt.zero_grad()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--p", type=float, default=0.1)
    a = ap.parse_args()
    torch.set_num_threads(1)
    pool = DistPool(2)
    try:
        runs = {f"eager p={a.p}": eager(a.p, a.steps), f"autopar fsdp p={a.p}": pool.run(autopar_job, a.p, a.steps),
                "eager p=0": eager(0.0, a.steps), "autopar fsdp p=0": pool.run(autopar_job, 0.0, a.steps)}
    finally:
        pool.close()
    w = a.steps // 6
    windows = [(i * w, (i + 1) * w) for i in range(6)]
    print("| run | " + " | ".join(f"steps {lo}-{hi - 1}" for lo, hi in windows) + " |")
    print("|---|" + "---|" * len(windows))
    for name, losses in runs.items():
        cells = [f"{statistics.mean(losses[lo:hi]):.4f} ± {statistics.stdev(losses[lo:hi]) / (hi - lo) ** 0.5:.4f}"
                 for lo, hi in windows]
        print(f"| {name} | " + " | ".join(cells) + " |")
    e, d = runs[f"eager p={a.p}"], runs[f"autopar fsdp p={a.p}"]
    tail = slice(a.steps // 2, a.steps)
    diff = [x - y for x, y in zip(d[tail], e[tail])]
    print(f"\nsecond half, autopar - eager at p={a.p}: mean {statistics.mean(diff):+.4f}, "
          f"sd of the step differences {statistics.stdev(diff):.4f} (standard error of the mean "
          f"{statistics.stdev(diff) / len(diff) ** 0.5:.4f}); at p=0 the two runs differ by "
          f"{max(abs(x - y) for x, y in zip(runs['eager p=0'], runs['autopar fsdp p=0'])):.1e} at most")


if __name__ == "__main__":
    main()
