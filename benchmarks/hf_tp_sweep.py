"""Every causal-LM architecture of transformers under derived tensor parallelism, on a fake mesh.

For each ``model_type`` in transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (189 in 5.23), in a
process of its own (a time limit each): build it from its config class with the tiny sizes of
autopar/models/hf_archs.py (``COMMON``, the MoE fields, the sweep's own extras where hf_archs names
the family), run one eager forward + backward (an architecture that does not is "not buildable" with
the error), then compile it under ``{"tp": "megatron"}`` on a fake tp=2 mesh (capture, the derived
placements, propagation, localize: the whole compile, no numerics) and report the share of the
repeated blocks' matrix parameters sharded on tp (``hf_archs.tp_sharded``), and the same share
weighed by each matrix's size at the architecture's own default sizes (``own_sizes_share``). The
numerics against one process are benchmarks/hf_breadth.py's, for the 34 families it trains.

    .venv/bin/python benchmarks/hf_tp_sweep.py [--jobs 2] [--timeout 240] [--out FILE.md] [--tiny-only] [--fsdp]
        [TYPE ...]

(``--tiny-only``: the share at the tiny sizes alone, the headline's measure; the own-sizes column
builds each default config on meta too and takes about three times as long. ``--fsdp``: the same
under ``{"dp": "fsdp", "tp": "megatron"}`` on a fake dp=2 x tp=2 mesh.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))


def one(model_type: str, own_sizes: bool = True, fsdp: bool = False) -> dict:
    """Build, run eagerly, compile on a fake tp=2 mesh (``fsdp``: dp=2 x tp=2 under fsdp + megatron);
    what happened, as a dict."""
    import transformers

    import autopar
    from autopar.mesh import fake_mesh
    from autopar.models import hf_archs

    transformers.logging.set_verbosity_error()
    extra = next((e for t, e in hf_archs.ARCHS.values() if t == model_type), {})
    t0 = time.time()
    try:
        model, x, y, loss_fn = _runs(model_type, extra)
    except Exception:  # noqa: BLE001 - maybe a latent-attention family: DeepSeek-V3's fields on top
        try:
            model, x, y, loss_fn = _runs(model_type, {**hf_archs.ARCHS["DeepSeek-V3"][1], **extra})
        except Exception as e:  # noqa: BLE001 - the architecture cannot be built or run at these sizes
            return {"type": model_type, "status": "not buildable", "why": f"{type(e).__name__}: {str(e)[:160]}"}
    try:
        axes, plan = hf_archs.MORE_PLANS["fsdp+megatron"] if fsdp else hf_archs.PLANS["megatron"]
        with fake_mesh(axes, 0) as mesh:
            pm = autopar.compile(model, mesh, example_inputs=(x, y), loss_fn=loss_fn, plan=plan, capture_eval=False)
        share = hf_archs.tp_sharded(pm)
        try:
            own = own_sizes_share(model_type, extra, model.config, pm) if own_sizes else None
        except Exception as e:  # noqa: BLE001 - the default config does not build; said per architecture
            own = f"{type(e).__name__}: {str(e)[:80]}"
        left = sorted({d.why.split(" at ")[0][:90] for n, d in pm.ctx.plan.derived["tp"].decisions.items()
                       if d.role == "replicated" and len(pm.module.get_parameter(n).shape) >= 2
                       and hf_archs_block(n)})
        return {"type": model_type, "status": "ok", "share": share, "own_sizes": own, "s": round(time.time() - t0, 1),
                "replicated": left[:3], "derived_ops": len(pm.ctx.derived_rules)}
    except Exception as e:  # noqa: BLE001 - reported per architecture
        return {"type": model_type, "status": "compile failed", "why": f"{type(e).__name__}: {str(e)[:200]}",
                "s": round(time.time() - t0, 1)}


# what makes the tiny model's blocks look like the real one's, kept from the tiny config: the number
# of layers and which kind each is (a hybrid's pattern is built from the count)
STRUCTURE = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "layer_types", "layers_block_type",
             "hybrid_override_pattern", "attn_layer_indices", "mlp_only_layers", "first_k_dense_replace")


def own_sizes_share(model_type: str, extra: dict, tiny_cfg, pm) -> float | None:
    """The share of the blocks' matrix elements sharded on tp at the architecture's own sizes: the
    tiny compile's decision for each parameter (for a weight cut into parts, the share of its parts
    sharded), weighed by that parameter's size in the model built on the meta device from the
    config class's defaults, with the tiny model's layers (count and kinds). The tiny sizes give
    every matrix nearly the same size (hidden 64, ffn 128), so a small side matrix of the real model
    (Gemma 4's 256-wide per-layer input, RWKV's feed-forward receptance) counts as much as the
    attention there; this weighs each as the real model would."""
    import torch
    from torch.distributed.tensor.placement_types import Replicate
    from transformers import AutoConfig, AutoModelForCausalLM

    from autopar.ir import info
    from autopar.modpath import block_of
    from autopar.parts import part_of

    ctx = pm.ctx
    i = ctx.axis_names.index("tp")
    read = {info(p).role[1] for p in pm.program.graph.nodes
            if p.op == "placeholder" and p.users and (info(p).role or ("",))[0] == "param"}
    frac: dict[str, list[float]] = {}  # the real model's parameter name -> [sharded, all] elements at the tiny sizes
    fused = part_of(pm.module)  # a cut weight's part -> (the fused weight's name, offset, dim)
    for n, p in pm.module.named_parameters():
        if n not in read or not block_of(n) or sum(s > 1 for s in p.shape) < 2:
            continue
        f = frac.setdefault(fused[n][0] if n in fused else n, [0.0, 0.0])
        f[1] += p.numel()
        if not isinstance(ctx.placed.compute[n][i], Replicate):
            f[0] += p.numel()
    keep = {k: getattr(tiny_cfg, k) for k in STRUCTURE if hasattr(tiny_cfg, k)
            and not isinstance(getattr(type(tiny_cfg), k, None), property)}  # (computed from the others)
    fields = {k: v for k, v in extra.items() if k in STRUCTURE}
    try:
        cfg = AutoConfig.for_model(model_type, **{**keep, **fields}, use_cache=False)
    except (AttributeError, TypeError, ValueError):  # a pattern field the class derives itself: the count alone
        cfg = AutoConfig.for_model(model_type, **{k: v for k, v in keep.items() if "layers" in k and
                                                  isinstance(v, int)}, use_cache=False)
    with torch.device("meta"):
        real = AutoModelForCausalLM.from_config(cfg)
    sizes = dict(real.named_parameters())
    missing = [n for n in frac if n not in sizes]
    if missing or not frac:
        raise KeyError(f"{len(missing)} of the tiny model's block matrices not in the default-size one "
                       f"({missing[:1]})" if missing else "no block matrices")
    total = sum(sizes[n].numel() for n in frac)
    return sum(sizes[n].numel() * sh / al for n, (sh, al) in frac.items()) / total


def _runs(model_type: str, extra: dict):
    """(model, tokens, targets, loss_fn) of ``model_type`` at the sweep's tiny sizes (dropout off),
    after one eager forward + backward ran."""
    import torch
    from transformers import AutoModelForCausalLM

    from autopar.models import hf_archs

    cfg = hf_archs.hf_config(model_type, {**hf_archs._MOE, **extra})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(1)
    vocab = min(int(getattr(cfg, "vocab_size", hf_archs.VOCAB) or hf_archs.VOCAB), hf_archs.VOCAB)
    x = torch.randint(3, vocab, (hf_archs.BATCH, hf_archs.SEQ), generator=g)
    y = torch.randint(0, vocab, (hf_archs.BATCH, hf_archs.SEQ), generator=g)

    def loss_fn(out, t):
        return torch.nn.functional.cross_entropy(hf_archs._logits(out).flatten(0, 1).float(), t.flatten(0, 1))

    loss_fn(model(x), y).backward()
    model.zero_grad()
    return model, x, y, loss_fn


def hf_archs_block(name: str) -> bool:
    from autopar.modpath import block_of

    return bool(block_of(name))


def _run(model_type: str, timeout: float, tiny_only: bool = False, fsdp: bool = False) -> dict:
    cmd = ([sys.executable, os.path.abspath(__file__), "--one", model_type] + (["--tiny-only"] if tiny_only else [])
           + (["--fsdp"] if fsdp else []))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=os.path.dirname(HERE))
    except subprocess.TimeoutExpired:
        return {"type": model_type, "status": "timeout", "why": f"over {timeout:.0f} s"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    last = (p.stderr.strip().splitlines() or [""])[-1][:200]
    killed = p.returncode in (-9, 137)  # the kernel's OOM killer: a sub-config (a vision tower) at full size
    return {"type": model_type, "status": "not buildable" if killed else "crashed",
            "why": "killed (out of memory building it)" if killed else f"exit {p.returncode}: {last}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("types", nargs="*")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--out")
    ap.add_argument("--tiny-only", action="store_true", help="skip the share weighed at each architecture's own sizes")
    ap.add_argument("--fsdp", action="store_true", help="fsdp + megatron on a fake dp=2 x tp=2 mesh (4 ranks)")
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one, own_sizes=not a.tiny_only, fsdp=a.fsdp)))
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    types = a.types or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    t0 = time.time()
    def run(t):  # each row printed as it comes (a sweep stopped midway keeps what it had)
        r = _run(t, a.timeout, a.tiny_only, a.fsdp)
        print(json.dumps(r), flush=True)
        return r
    with ThreadPoolExecutor(a.jobs) as ex:
        rows = list(ex.map(run, types))
    ok = [r for r in rows if r["status"] == "ok"]
    built = [r for r in rows if r["status"] != "not buildable"]
    most = [r for r in ok if r["share"] is not None and r["share"] >= 0.9]
    own = [r for r in ok if isinstance(r.get("own_sizes"), float)]
    own_most = [r for r in own if r["own_sizes"] >= 0.9]
    lines = ["| model_type | status | share of the blocks' matrices sharded on tp | the same at its own sizes | "
             "replicated (first reasons) / error |", "|---|---|---|---|---|"]
    for r in rows:
        share = f"{100 * r['share']:.0f}%" if r.get("share") is not None else ""
        o = r.get("own_sizes")
        o = f"{100 * o:.0f}%" if isinstance(o, float) else (o or "")
        why = "; ".join(r.get("replicated", [])) if r["status"] == "ok" else r.get("why", "")
        lines.append(f"| {r['type']} | {r['status']} | {share} | {o.replace('|', '/')} | {why.replace('|', '/')} |")
    lines += ["", f"{len(types)} architectures, {len(built)} buildable at the tiny sizes, {len(ok)} compiled under "
              f"{'fsdp + megatron on a fake dp=2 x tp=2' if a.fsdp else 'megatron on a fake tp=2'} mesh, "
              f"{len(most)} of them with at least 90% of their blocks' matrices sharded "
              f"({100 * len(most) / max(1, len(built)):.1f}% of the buildable); at their own sizes "
              f"(`own_sizes_share`) {len(own_most)} of the {len(own)} whose default config built on meta; "
              f"{time.time() - t0:.0f} s"]
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
