"""Checkpoints (autopar/runtime/checkpoint.py) on real gloo groups: exact resume, resharding across
meshes and plans, atomic writes, and the errors a wrong or unfinished checkpoint gives.

One run of 5 AdamW steps (fsdp on dp=2) writes the checkpoints the other tests read:
step 2 (async: training goes on while it is written), step 3, step 5 (CheckpointManager, keep=2).
The chain fsdp dp=2 -> megatron tp=2 -> one process continues the same run on other meshes; the
losses match the uninterrupted run's to reduction-order tolerance.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import autopar
from autopar.runtime.checkpoint import MARKER, CheckpointManager, read_marker
from autopar.testing import build_model
from autopar.runtime.common import full_tensor

STEPS = 5
LR = 1e-2


def _compile(axes: dict, plan: dict, name: str = "llama", seed: int = 0, **options):
    model, _, loss_fn = build_model(name, seed=seed)
    _, batches, _ = build_model("llama")  # the run's data, whatever the initial weights
    pm = autopar.compile(model, autopar.mesh(**axes), example_inputs=batches[0], loss_fn=loss_fn, plan=plan,
                         capture_eval=False, **options)
    return pm, torch.optim.AdamW(pm.parameters(), lr=LR), batches


def _step(pm, opt, batches) -> float:
    """Step ``pm.steps + 1`` of the run (the batch follows the step count, as a data loader's
    position restored from ``extra`` would)."""
    loss = pm.train_step(*batches[pm.steps % len(batches)]).item()
    opt.step()
    opt.zero_grad()
    return loss


def _full(pm) -> dict[str, torch.Tensor]:
    return {n: full_tensor(p.detach()).clone() for n, p in pm.named_parameters()}  # (Replicate: no copy)


def fsdp_job(root: str) -> dict:
    """5 steps on dp=2 with checkpoints; then step 2 reloaded into the program (weights zeroed, a
    fresh optimizer, the RNG moved on) and steps 3..5 replayed."""
    import torch.distributed as dist

    pm, opt, batches = _compile({"dp": 2}, {"dp": "fsdp"})
    mgr = CheckpointManager(root, keep=2)
    torch.manual_seed(100 + dist.get_rank())  # each rank its own RNG stream
    out = {"losses": []}
    for _ in range(STEPS):
        out["losses"].append(_step(pm, opt, batches))
        if pm.steps == 2:
            out["params_2"], rng_2 = _full(pm), torch.get_rng_state()
            fut = mgr.save(pm, optimizer=opt, extra={"next_batch": 2}, async_save=True)
            torch.rand(3)  # the RNG and the training move on while the shards are written
        if pm.steps == 3:
            out["async_done_before"] = fut.done()
            fut.result()
            mgr.save(pm, optimizer=opt, extra={"next_batch": 3})
            out["params_3"] = _full(pm)
    try:
        pm.save(mgr.path_of(3))
    except autopar.InputError as e:
        out["exists_error"] = str(e)
    if dist.get_rank() == 0:  # a writer killed before its rename, and a folder without its marker
        os.makedirs(os.path.join(root, "step-000009.tmp-dead"))
        os.makedirs(os.path.join(root, "step-000010"))
    dist.barrier()
    out["latest_before"] = os.path.basename(mgr.latest())

    with torch.no_grad():
        for p in pm.parameters():
            p.zero_()
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    out["extra"] = pm.load(mgr.path_of(2), opt)
    out["steps_after_load"] = pm.steps
    out["params_equal"] = all(torch.equal(v, out["params_2"][n]) for n, v in _full(pm).items())
    out["rng_equal"] = torch.equal(torch.get_rng_state(), rng_2)
    out["resumed"] = [_step(pm, opt, batches) for _ in range(pm.steps, STEPS)]
    mgr.save(pm, optimizer=opt)  # step 5: step 2 and the dead writer's folder go
    dist.barrier()
    out["listing"] = sorted(os.listdir(root))
    out["marker"] = read_marker(mgr.path_of(5))
    return out


def reshard_job(root: str, axes: dict, plan: dict, src: str, params: dict, dst: str | None) -> dict:
    """Load ``src`` (with the optimizer) on another mesh / plan, compare the weights, take the
    run's next step; save it to ``dst``."""
    pm, opt, batches = _compile(axes, plan, seed=1)
    extra = pm.load(os.path.join(root, src), opt)
    loaded = _full(pm)
    out = {"extra": extra, "steps": pm.steps, "owned": len(loaded), "loss": _step(pm, opt, batches),
           "params_equal": all(torch.equal(v, params[n]) for n, v in loaded.items()) if params else None}
    if dst is not None:
        pm.save(os.path.join(root, dst), optimizer=opt, extra={"next_batch": pm.steps})
        if pm.pipelined:  # round trip: each pipeline rank reads back only the stages it holds
            after = _full(pm)
            with torch.no_grad():
                for p in pm.parameters():
                    p.zero_()
            pm.load(os.path.join(root, dst), torch.optim.AdamW(pm.parameters(), lr=LR))
            out["round_trip"] = all(torch.equal(v, after[n]) for n, v in _full(pm).items())
    return out


def tied_job(root: str) -> dict:
    """A tied embedding / LM head across pipeline stages: 2 steps on pp=2 (one copy per stage),
    saved, loaded into fsdp on dp=2 (one parameter), 2 more steps; and 4 steps on ddp, uninterrupted."""
    out = {}
    pm, opt, batches = _compile({"pp": 2}, {"pp": "1f1b"}, name="llama_tied")
    out["pp"] = [_step(pm, opt, batches) for _ in range(2)]
    pm.save(os.path.join(root, "tied-pp"), optimizer=opt)
    pm, opt, batches = _compile({"dp": 2}, {"dp": "fsdp"}, name="llama_tied", seed=1)
    pm.load(os.path.join(root, "tied-pp"), opt)
    out["fsdp"] = [_step(pm, opt, batches) for _ in range(2)]
    out["keys"] = sorted(pm.state_dict())
    pm, opt, batches = _compile({"dp": 2}, {"dp": "ddp"}, name="llama_tied")
    out["ddp"] = [_step(pm, opt, batches) for _ in range(4)]
    return out


def fused_job(root: str, axes: dict, plan: dict, src: str | None, dst: str | None, steps: int, seed: int,
              arch: str = "GPT-2") -> dict:
    """Hugging Face GPT-2 (q, k and v in one Conv1D, split by heads under megatron: a strided shard),
    or ``arch``: load ``src``, take ``steps`` AdamW steps of the run (batches of seed 0), save to
    ``dst``."""
    from autopar.models.hf_archs import build_hf
    from autopar.testing import parity_optimizer
    from autopar.torch_compat import StridedShard

    model, _, loss_fn = build_hf(arch, seed=seed, num_hidden_layers=1)
    _, batches, _ = build_hf(arch, seed=0, num_hidden_layers=1)
    pm = autopar.compile(model, autopar.mesh(**axes), example_inputs=batches[0], loss_fn=loss_fn, plan=plan,
                         capture_eval=False)
    opt = parity_optimizer(pm.parameters(), LR)
    if src is not None:
        pm.load(os.path.join(root, src), opt)
    losses = [_step(pm, opt, batches) for _ in range(steps)]
    if dst is not None:
        pm.save(os.path.join(root, dst), optimizer=opt)
    strided = sorted(n for n, p in pm.named_parameters()
                     if any(isinstance(pl, StridedShard) for pl in getattr(p, "placements", ())))
    cut = sorted(n for n, _ in pm.named_parameters() if ".parametrizations." in n)
    return {"losses": losses, "strided": strided, "cut": cut, "keys": sorted(pm.state_dict())}


def errors_job(root: str) -> dict:
    """One process: an unfinished folder, another model's checkpoint, a checkpoint without the
    optimizer's state; the fp16 loss scaler and an optimizer saved before its first step."""
    out = {}
    pm, opt, _ = _compile({"dp": 1}, {"dp": "ddp"}, name="gpt", precision="fp16")
    pm.save(os.path.join(root, "gpt-no-optimizer"))
    for key, path in [("incomplete", "step-000010"), ("other_model", "step-000005"),
                      ("no_optimizer", "gpt-no-optimizer")]:
        try:
            pm.load(os.path.join(root, path), opt)
        except autopar.InputError as e:
            out[key] = str(e)
    pm.scaler.scale, pm.scaler.growth_tracker, pm.scaler.skipped_steps = 512.0, 7, 3
    pm.save(os.path.join(root, "gpt16"), optimizer=torch.optim.AdamW(pm.parameters(), lr=0.02))
    pm.scaler.scale, pm.scaler.growth_tracker, pm.scaler.skipped_steps = 65536.0, 0, 0
    opt = torch.optim.AdamW(pm.parameters(), lr=0.5)
    pm.load(os.path.join(root, "gpt16"), opt)
    out["scaler"] = (pm.scaler.scale, pm.scaler.growth_tracker, pm.scaler.skipped_steps)
    out["optimizer"] = (opt.param_groups[0]["lr"], len(opt.state))  # hyperparameters back, no state made
    return out


@pytest.fixture(scope="module")
def fsdp_run(pools, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    return root, pools(2).run(fsdp_job, root)


def test_resume_is_exact_and_saves_are_atomic(fsdp_run):
    _, out = fsdp_run
    assert out["steps_after_load"] == 2 and out["extra"] == {"next_batch": 2}
    assert out["params_equal"] and out["rng_equal"]
    assert out["resumed"] == out["losses"][2:], (out["resumed"], out["losses"])  # bit for bit
    assert "already exists" in out["exists_error"] and "step-000003" in out["exists_error"]
    assert out["latest_before"] == "step-000003"  # the folder without its marker is skipped
    assert out["listing"] == ["step-000003", "step-000005", "step-000010"]  # keep=2; the dead writer removed
    m = out["marker"]
    assert (m["step"], m["world_size"], m["mesh"], m["plan"]) == (5, 2, {"dp": 2}, "dp=fsdp")
    assert any(f.endswith(".distcp") for f in m["files"]) and ".metadata" in m["files"]


def test_reshard_fsdp_to_megatron_to_one_process(pools, fsdp_run):
    root, run = fsdp_run
    tp = pools(2).run(reshard_job, root, {"tp": 2}, {"tp": "megatron"}, "step-000003", run["params_3"], "tp-4")
    assert tp["params_equal"] and tp["steps"] == 3 and tp["extra"] == {"next_batch": 3}
    assert tp["loss"] == pytest.approx(run["losses"][3], rel=1e-5)
    one = pools(1).run(reshard_job, root, {"dp": 1}, {"dp": "ddp"}, "tp-4", {}, None)
    assert one["steps"] == 4 and one["extra"] == {"next_batch": 4}
    assert one["loss"] == pytest.approx(run["losses"][4], rel=1e-5)


def test_pipeline_loads_only_its_stages(pools, fsdp_run):
    root, run = fsdp_run
    pp = pools(2).run(reshard_job, root, {"pp": 2}, {"pp": "1f1b"}, "step-000003", run["params_3"], "pp-4")
    assert pp["params_equal"] and 0 < pp["owned"] < len(run["params_3"])
    assert pp["loss"] == pytest.approx(run["losses"][3], rel=1e-5)
    assert pp["round_trip"]


def test_tied_weights_reshard_from_pipeline(pools, tmp_path):
    out = pools(2).run(tied_job, str(tmp_path))
    assert out["pp"] + out["fsdp"] == pytest.approx(out["ddp"], rel=1e-5)
    assert "lm_head.weight" in out["keys"]  # (the module's state_dict keeps both names, as torch's does)


def test_a_fused_projection_split_by_heads_reshards(pools, tmp_path):
    """GPT-2's fused q / k / v under megatron is a strided shard, which DCP cannot record as one
    chunk per rank (it refused the save before ``_plain_shards``): one process -> megatron tp=2
    (loaded into the strided layout, saved from it) -> one process, against 3 steps uninterrupted."""
    root = str(tmp_path)
    ref = pools(1).run(fused_job, root, {"dp": 1}, {"dp": "ddp"}, None, None, 3, 0)
    pools(1).run(fused_job, root, {"dp": 1}, {"dp": "ddp"}, None, "one-1", 1, 0)
    tp = pools(2).run(fused_job, root, {"tp": 2}, {"tp": "megatron"}, "one-1", "tp-2", 1, 1)
    assert "transformer.h.0.attn.c_attn.weight" in tp["strided"]
    one = pools(1).run(fused_job, root, {"dp": 1}, {"dp": "ddp"}, "tp-2", None, 1, 1)
    assert tp["losses"] + one["losses"] == pytest.approx(ref["losses"][1:], rel=1e-5)


def test_a_fused_projection_cut_into_parts_reshards(pools, tmp_path):
    """Phi-3's [q | k | v] with fewer key / value heads: under megatron one parameter per part
    (autopar/unfuse.py), each split by its heads; the checkpoint holds the fused weight whole under
    its own name, so one process -> tp=2 (parts) -> one process gives the uninterrupted losses,
    AdamW's state included."""
    root = str(tmp_path)
    ref = pools(1).run(fused_job, root, {"dp": 1}, {"dp": "ddp"}, None, None, 3, 0, "Phi-3")
    one = pools(1).run(fused_job, root, {"dp": 1}, {"dp": "ddp"}, None, "one-1", 1, 0, "Phi-3")
    assert not one["cut"]  # (one process, no tensor parallelism: nothing cut)
    tp = pools(2).run(fused_job, root, {"tp": 2}, {"tp": "megatron"}, "one-1", "tp-2", 1, 1, "Phi-3")
    w = "model.layers.0.self_attn.qkv_proj"
    assert tp["cut"] == [f"{w}.parametrizations.weight.original{i}" for i in range(3)], tp["cut"]
    assert f"{w}.weight" in tp["keys"] and not any(".parametrizations." in k for k in tp["keys"])
    back = pools(1).run(fused_job, root, {"dp": 1}, {"dp": "ddp"}, "tp-2", None, 1, 1, "Phi-3")
    assert tp["losses"] + back["losses"] == pytest.approx(ref["losses"][1:], rel=1e-5)


@pytest.mark.slow  # (4 ranks, 10 s; the tp=2 chain above in CI)
def test_a_fused_projection_in_a_pipeline_stage_reshards(pools, tmp_path):
    """The same through a pipeline: pp=2 x tp=2, each rank writing its stage's strided shards (the
    other stage's parameters are not its to write) -> one process."""
    root = str(tmp_path)
    ref = pools(1).run(fused_job, root, {"dp": 1}, {"dp": "ddp"}, None, None, 3, 0)
    pools(1).run(fused_job, root, {"dp": 1}, {"dp": "ddp"}, None, "one-1", 1, 0)
    pp = pools(4).run(fused_job, root, {"pp": 2, "tp": 2}, {"pp": "1f1b", "tp": "megatron"}, "one-1", "pp-2", 1, 1)
    assert pp["strided"]  # (rank 0's stage)
    one = pools(1).run(fused_job, root, {"dp": 1}, {"dp": "ddp"}, "pp-2", None, 1, 1)
    assert pp["losses"] + one["losses"] == pytest.approx(ref["losses"][1:], rel=1e-5)


def test_wrong_or_unfinished_checkpoints_are_refused(pools, fsdp_run):
    root, _ = fsdp_run
    out = pools(1).run(errors_job, root)
    assert f"no {MARKER} marker" in out["incomplete"] and "step-000010" in out["incomplete"]
    other = out["other_model"]
    assert "layers.0.self_attn.k_proj.weight has shape [64, 64] here but [32, 64]" in other, other
    assert "no entry for" in other and "up_proj.bias" in other
    assert "this model does not have" in other and "gate_proj.weight" in other
    assert "no optimizer state" in out["no_optimizer"]
    assert out["scaler"] == (512.0, 7, 3) and out["optimizer"] == (0.02, 0)


def test_damaged_checkpoint_names_the_file(fsdp_run, tmp_path):
    root, _ = fsdp_run
    copy = tmp_path / "copy"
    shutil.copytree(os.path.join(root, "step-000005"), copy)
    shard = min(f for f in os.listdir(copy) if f.endswith(".distcp"))
    with open(copy / shard, "r+b") as f:
        f.truncate(10)
    with pytest.raises(autopar.InputError, match=f"{shard} is 10 bytes"):
        read_marker(str(copy))
    with pytest.raises(autopar.InputError, match="no checkpoint at"):
        read_marker(str(tmp_path / "nothing"))
