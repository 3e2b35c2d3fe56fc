"""Checkpoints on torch.distributed.checkpoint (DCP): sharded, atomic, reshardable.

``pm.save(path, optimizer)`` (autopar/runtime/base.py) writes, on every rank at once:

- the parameters this rank holds (DTensor shards: DCP records each shard's place in the global
  tensor, so a checkpoint written under one mesh / plan loads under another; a strided shard, a
  fused q / k / v split by heads, is written and read as plain shards, ``_plain_shards``; a fused
  weight cut into one parameter per part, autopar/unfuse.py, whole under its own name) and the
  buffers;
- the optimizer state keyed by parameter NAME (torch's ``get_optimizer_state_dict`` flattened:
  ``state.<name>.exp_avg``, ``param_groups.<name>.lr``), so it reshards with the parameters and a
  pipeline rank writes and reads only its stages' entries;
- every rank's torch RNG states (CPU, and CUDA when the program runs there), each under its rank;
- in the ``COMPLETE`` marker (JSON): the step, the dropout seed, the mesh, the plan, the loss scaler, the user's
  ``extra`` and the size of every file written.

Atomic: the shards go to ``path.tmp-<id>``; DCP's coordinator (rank 0) writes the metadata only
after every rank reported its shards written, then rank 0 writes ``COMPLETE`` and renames the
folder to ``path``. A folder without its marker (a killed writer) is never loaded, and a complete
checkpoint is never overwritten.

``async_save=True``: the state is copied to CPU memory (the staged copy: this rank's parameter
shards + optimizer state, about 3x its parameter bytes under AdamW, held until the write ends),
then written by a background thread on a separate gloo group while training goes on.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import uuid
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from autopar.errors import InputError
from autopar.parts import from_fused, fused_shapes, to_fused

MARKER = "COMPLETE"
FORMAT = "autopar-checkpoint/1"


# ------------------------------------------------------------------------ what is written
def _model_state(pm) -> dict[str, torch.Tensor]:
    """This rank's parameters (a pipeline: its stages' only; the others are meta tensors) and the
    module's persistent buffers, by name; DCP loads into these tensors in place."""
    out = {name: p.detach() for name, p in pm.named_parameters()}
    params = {name for name, _ in pm.module.named_parameters(remove_duplicate=False)}  # tied: every name
    for name, b in pm.module.state_dict(keep_vars=True).items():
        if name not in params:
            out[name] = b.detach()
    return out


def _model_shapes(pm) -> dict[str, tuple]:
    """Every parameter and persistent buffer of the model (a pipeline's other stages included):
    what a checkpoint of this model must hold, with its global shape. A tied weight is held once,
    under its first name."""
    return fused_shapes({name: tuple(t.shape) for name, t in pm.module.state_dict(keep_vars=True).items()
                         if name not in pm._tied}, pm.module)


def _optimizer_state(pm, optimizer, with_state: bool) -> dict:
    """``optimizer``'s state flattened by parameter name (``state.<name>.exp_avg``,
    ``param_groups.<name>.lr``); without ``with_state``, its hyperparameters only.

    Saving passes ``with_state`` only when the optimizer has stepped: creating its state would
    take a step (AdamW's count would start at 1, and the run would differ from one never saved).
    Loading a checkpoint that has state into a fresh optimizer creates it with torch's
    zero-gradient step at lr 0, so DCP has tensors of the right placement to load into
    (gradients already on the parameters are put aside meanwhile)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    if not with_state:
        names = _names_of(pm, optimizer)
        return {f"param_groups.{names[id(p)]}.{k}": v for g in optimizer.param_groups for p in g["params"]
                for k, v in g.items() if k != "params"}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    grads = [p.grad for p in params] if not optimizer.state else []
    for p in params if grads else []:
        p.grad = None
    try:
        return get_optimizer_state_dict(pm.module, optimizer,
                                        options=StateDictOptions(flatten_optimizer_state_dict=True))
    finally:
        for p, g in zip(params, grads):
            p.grad = g


def _names_of(pm, optimizer) -> dict[int, str]:
    names = {id(p): n for n, p in pm.named_parameters()}
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) not in names:
                raise InputError(f"the optimizer steps a tensor of shape {list(p.shape)} that is not one of this "
                                 "program's parameters", where="optimizer.param_groups",
                                 fix="build the optimizer on pm.parameters() (after autopar.compile)")
    return names


def _rng_state(pm) -> dict[str, torch.Tensor]:
    out = {"cpu": torch.get_rng_state()}
    if pm.ctx.device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(pm.ctx.device)
    return out


def _marker(pm, extra, optimizer) -> dict:
    mesh = pm.mesh
    plan = pm.plan.describe() if pm.pipelined else pm.ctx.plan.describe()
    if pm.pipelined:
        plan = ", ".join(x for x in (f"{pm.pp_axis}={pm.schedule.name}", plan) if x)
    s = pm.scaler
    return {"format": FORMAT, "step": pm.steps, "world_size": dist.get_world_size(),
            "mesh": dict(zip(mesh.mesh_dim_names, mesh.shape)), "plan": plan, "runtime": type(pm).__name__,
            "optimizer": type(optimizer).__name__ if optimizer is not None else None,
            "loss_scaler": {"scale": s.scale, "growth_tracker": s.growth_tracker, "skipped_steps": s.skipped_steps},
            "dropout_seed": pm.seed, "extra": extra, "torch": torch.__version__}


def _plain_shards(state: dict) -> list[tuple[dict, str, torch.Tensor]]:
    """Replace, in ``state`` (nested dicts), every DTensor with a strided shard (a fused q / k / v
    split by heads: rank r holds piece r of EACH part) by the same values laid out as plain shards
    of that dim; returns (dict, key, original) for each (``_restore`` puts the originals back).
    DCP records one contiguous chunk per rank and refuses a strided shard ("overlapping chunks",
    torch 2.13), so these are written and read in the plain layout, which any plan can reshard
    from. Costs one redistribute per such tensor (the parameter whole, one at a time, on each rank
    of its axis), at save and at load only."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Shard

    from autopar import torch_compat as tc

    pairs = []
    for key, v in state.items():
        if isinstance(v, dict):
            pairs += _plain_shards(v)
        elif isinstance(v, DTensor) and any(isinstance(pl, tc.StridedShard) for pl in v.placements):
            plain = [Shard(pl.dim) if isinstance(pl, tc.StridedShard) else pl for pl in v.placements]
            state[key] = v.redistribute(v.device_mesh, plain)
            pairs.append((state, key, v))
    return pairs


def _restore(pairs: list[tuple[dict, str, torch.Tensor]]) -> None:
    """After a load: the values read in the plain layout copied into the program's own tensors
    (in place), which go back into their dicts."""
    for d, key, orig in pairs:
        plain = d[key]
        orig.to_local().copy_(plain.redistribute(plain.device_mesh, orig.placements).to_local())
        d[key] = orig


# ------------------------------------------------------------------------ save
def save(pm, path, optimizer=None, extra=None, async_save: bool = False, on_complete=None) -> Future | None:
    """Write a checkpoint of ``pm`` (and ``optimizer``) to ``path`` on every rank; see the module
    docstring. ``async_save``: returns a Future (``.result()`` waits for the write, the marker and
    the rename; its exception is the write's). ``on_complete(path)``: run on rank 0 once the
    checkpoint is complete (CheckpointManager prunes there)."""
    import torch.distributed.checkpoint as dcp

    wait_pending(pm)
    try:
        extra = json.loads(json.dumps(extra)) if extra is not None else None
    except (TypeError, ValueError) as e:
        raise InputError(f"extra must be JSON-serializable: {e}", where=f"{type(pm).__name__}.save(extra=...)",
                         fix="pass a dict of numbers, strings, lists and dicts (e.g. the data loader's position)")
    path, tmp = _agree_on_tmp(os.fspath(path))
    state = {"model": _model_state(pm), "rng": {f"rank{dist.get_rank()}": _rng_state(pm)}}
    if optimizer is not None:
        state["optim"] = _optimizer_state(pm, optimizer, with_state=bool(optimizer.state))
    for part in ("model", "optim"):  # a weight cut into parts is written whole, under its own name
        if part in state:
            to_fused(state[part], pm.module)
    _plain_shards(state)
    marker = _marker(pm, extra, optimizer)
    writer = dcp.FileSystemWriter(tmp)
    if not async_save:
        dcp.save(state, storage_writer=writer)
        _finish(tmp, path, marker, None, on_complete)
        return None
    group = getattr(pm, "_checkpoint_group", None)
    if group is None:  # the background thread's collectives must not meet training's on one group
        group = pm._checkpoint_group = dist.new_group(backend="gloo")
    upload = dcp.async_save(state, storage_writer=writer, process_group=group)  # stages (copies) now
    upload = getattr(upload, "upload_completion", upload)
    del state
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="autopar-checkpoint")
    fut = pool.submit(lambda: (upload.result(), _finish(tmp, path, marker, group, on_complete))[1])
    pool.shutdown(wait=False)
    pm._pending_save = fut
    return fut


def wait_pending(pm) -> None:
    """Wait for ``pm``'s async save in flight, if any (two saves must not share the group at once)."""
    fut = getattr(pm, "_pending_save", None)
    if fut is not None:
        pm._pending_save = None
        fut.result()


def _agree_on_tmp(path: str) -> tuple[str, str]:
    """Rank 0's path, its fresh temporary folder, or the error every rank raises."""
    msg = None
    if dist.get_rank() == 0 and os.path.exists(path):
        msg = path
    box = [path, f"{path}.tmp-{uuid.uuid4().hex[:12]}", msg]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    path, tmp, msg = box
    if msg is not None:
        raise InputError(f"a checkpoint already exists at {msg}: autopar never overwrites one in place",
                         where=msg, fix="save to a new path (CheckpointManager numbers them by step), or "
                                        "delete the old one first")
    return path, tmp


def _finish(tmp: str, path: str, marker: dict, group, on_complete) -> None:
    """Every rank's shards and DCP's metadata are on disk (DCP's finish ran on its coordinator
    after all ranks reported): rank 0 writes the marker and renames; every rank learns the result."""
    err = None
    if dist.get_rank() == 0:
        try:
            marker = {**marker, "files": {f: os.path.getsize(os.path.join(tmp, f)) for f in sorted(os.listdir(tmp))}}
            part = os.path.join(tmp, MARKER + ".part")
            with open(part, "w") as f:
                json.dump(marker, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(part, os.path.join(tmp, MARKER))
            if os.path.exists(path):
                raise FileExistsError(f"{path} appeared while the checkpoint was written")
            os.rename(tmp, path)
            _fsync_dir(os.path.dirname(os.path.abspath(path)))
            if on_complete is not None:
                on_complete(path)
        except Exception as e:  # noqa: BLE001 - every rank raises it
            err = f"{type(e).__name__}: {e}"
    box = [err]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0, group=group)
    if box[0] is not None:
        raise InputError(f"the checkpoint could not be completed: {box[0]}", where=tmp,
                         fix="check the file system (space, permissions); the shards are left in the "
                             "temporary folder")


def _fsync_dir(d: str) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ------------------------------------------------------------------------ load
def read_marker(path: str) -> dict:
    """The ``COMPLETE`` marker of the checkpoint at ``path``, or an error naming what is missing."""
    where = f"load({path!r})"
    unfinished = sorted(glob.glob(glob.escape(path) + ".tmp-*"))
    note = f" (an unfinished write is in {unfinished[-1]})" if unfinished else ""
    if not os.path.isdir(path):
        raise InputError(f"no checkpoint at {path}{note}", where=where,
                         fix="pass the folder pm.save wrote (CheckpointManager.latest() finds the last one)")
    marker_path = os.path.join(path, MARKER)
    if not os.path.exists(marker_path):
        raise InputError(f"{path} has no {MARKER} marker: its writer did not finish (killed, or still "
                         f"writing), so its shards may be incomplete", where=marker_path,
                         fix="load an earlier checkpoint (CheckpointManager.latest() skips incomplete ones)")
    try:
        with open(marker_path) as f:
            marker = json.load(f)
    except ValueError as e:
        raise InputError(f"the {MARKER} marker of {path} is damaged: {e}", where=marker_path,
                         fix="load an earlier checkpoint") from None
    for name, size in marker.get("files", {}).items():
        f = os.path.join(path, name)
        have = os.path.getsize(f) if os.path.exists(f) else None
        if have != size:
            got = "missing" if have is None else f"{have:,} bytes"
            raise InputError(f"checkpoint file {name} is {got}, but {size:,} bytes were written: the checkpoint "
                             f"is damaged (truncated or partly copied)", where=f, fix="load an earlier checkpoint")
    return marker


def _check_keys(pm, meta, load_state: dict, optimizer) -> list[tuple[str, str]]:
    """What the checkpoint lacks or holds too much of, against this model and optimizer:
    ("model" | "optimizer", problem)."""
    stored = meta.state_dict_metadata
    errors = []
    shapes = _model_shapes(pm)
    in_ckpt = {k[len("model."):]: v for k, v in stored.items() if k.startswith("model.")}
    missing = [n for n in shapes if n not in in_ckpt]
    unexpected = [n for n in in_ckpt if n not in shapes]
    if missing:
        errors.append(("model", f"the checkpoint has no entry for {len(missing)} of the model's parameters/buffers: "
                       + _some(missing)))
    if unexpected:
        errors.append(("model", f"the checkpoint holds {len(unexpected)} entries this model does not have: "
                       + _some(unexpected)))
    for n, shape in shapes.items():
        size = getattr(in_ckpt.get(n), "size", None)
        if size is not None and tuple(size) != shape:
            errors.append(("model", f"parameter {n} has shape {list(shape)} here but {list(size)} in the checkpoint"))
    if optimizer is not None and not errors:  # (another model's optimizer state differs anyway)
        if not any(k.startswith("optim.") for k in stored):
            errors.append(("optimizer", "the checkpoint has no optimizer state (it was saved without optimizer=)"))
        else:
            lacking = [k[len("optim."):] for k in _flat_keys(load_state.get("optim", {}), "optim")
                       if k not in stored]
            if lacking:
                errors.append(("optimizer", f"the checkpoint's optimizer state lacks {len(lacking)} entries this "
                               f"optimizer ({type(optimizer).__name__}) has: " + _some(lacking)))
    return errors


def _some(names: list[str], n: int = 6) -> str:
    return ", ".join(names[:n]) + (f" ... ({len(names) - n} more)" if len(names) > n else "")


def _flat_keys(d: dict, prefix: str) -> list[str]:
    out = []
    for k, v in d.items():
        key = f"{prefix}.{k}"
        out += _flat_keys(v, key) if isinstance(v, dict) else [key]
    return out


def load(pm, path, optimizer=None) -> dict:
    """Load the checkpoint at ``path`` into ``pm`` (and ``optimizer``) on every rank, resharding
    to this program's placements; returns the ``extra`` dict saved with it. The RNG states come
    back when the world size is the checkpoint's (each rank gets its own); the loss scaler when
    both sides scale the loss."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    wait_pending(pm)
    path = os.fspath(path)
    marker = read_marker(path)
    reader = dcp.FileSystemReader(path)
    meta = reader.read_metadata()
    state = {"model": _model_state(pm)}
    has_state = any(k.startswith("optim.state.") for k in meta.state_dict_metadata)
    if optimizer is not None:
        state["optim"] = _optimizer_state(pm, optimizer, with_state=has_state)
    rank = dist.get_rank()
    rng_key = f"rank{rank}"
    same_world = marker.get("world_size") == dist.get_world_size()
    if same_world:
        state["rng"] = {rng_key: {k: v.clone() for k, v in _rng_state(pm).items()}}
    cut = {part: to_fused(state[part], pm.module, values=False) for part in ("model", "optim") if part in state}
    errors = _check_keys(pm, meta, state, optimizer)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, errors)  # a rank's own error would leave the others waiting in DCP
    errors = list(dict.fromkeys(e for errs in everyone for e in errs))  # (a pipeline's ranks differ)
    if errors:
        model = any(kind == "model" for kind, _ in errors)
        raise InputError(f"the checkpoint at {path} does not fit this {'model' if model else 'optimizer'}:"
                         + "".join(f"\n  - {e}" for _, e in errors), where=path,
                         fix="load a checkpoint of this model (same parameter names and shapes; another mesh or "
                             "plan is fine)" if model else
                             "load it without optimizer= (the model only), or build the optimizer the checkpoint's "
                             "run used")
    strided = _plain_shards(state)
    dcp.load(state, storage_reader=reader)
    _restore(strided)
    for part, undo in cut.items():
        from_fused(state[part], undo)
    if optimizer is not None and has_state:
        set_optimizer_state_dict(pm.module, optimizer, state["optim"],
                                 options=StateDictOptions(flatten_optimizer_state_dict=True))
    elif optimizer is not None:  # saved before its first step: so it is again
        optimizer.state.clear()
        names = _names_of(pm, optimizer)
        for g in optimizer.param_groups:
            for k in g:
                if k != "params":
                    g[k] = state["optim"][f"param_groups.{names[id(g['params'][0])]}.{k}"]
    if same_world:
        torch.set_rng_state(state["rng"][rng_key]["cpu"])
        if "cuda" in state["rng"][rng_key]:
            torch.cuda.set_rng_state(state["rng"][rng_key]["cuda"], pm.ctx.device)
    scaler = marker.get("loss_scaler") or {}
    if pm.scaler.scale is not None and scaler.get("scale") is not None:
        pm.scaler.scale = scaler["scale"]
        pm.scaler.growth_tracker = scaler["growth_tracker"]
        pm.scaler.skipped_steps = scaler["skipped_steps"]
    pm.steps = marker["step"]
    if marker.get("dropout_seed") is not None:  # dropout masks go on as they would have (autopar/dropout.py)
        pm.seed = marker["dropout_seed"]
    pm._unloaded.clear()  # (a model built on meta: its weights are these)
    return marker.get("extra") or {}


# ------------------------------------------------------------------------ many checkpoints
class CheckpointManager:
    """Checkpoints of one run under ``root``: ``root/step-000123``, one per ``save``; keeps the last
    ``keep`` complete ones (older ones, and folders of writers that died, are removed by rank 0
    once a newer checkpoint is complete)."""

    PATTERN = re.compile(r"^step-(\d+)$")

    def __init__(self, root, keep: int = 3, async_save: bool = False):
        if keep < 1:
            raise InputError(f"keep must be at least 1, got {keep}", where="CheckpointManager(keep=...)")
        self.root = os.fspath(root)
        self.keep = keep
        self.async_save = async_save

    def path_of(self, step: int) -> str:
        return os.path.join(self.root, f"step-{step:06d}")

    def save(self, pm, step: int | None = None, optimizer=None, extra=None, async_save: bool | None = None):
        """Save ``pm`` (and ``optimizer``) as step ``step`` (default: ``pm.steps``); returns the
        Future of an async save, else None."""
        step = pm.steps if step is None else step
        if dist.get_rank() == 0:
            os.makedirs(self.root, exist_ok=True)
        return save(pm, self.path_of(step), optimizer, extra,
                    self.async_save if async_save is None else async_save, on_complete=self._prune)

    def checkpoints(self) -> list[tuple[int, str]]:
        """(step, path) of the complete checkpoints, oldest first."""
        if not os.path.isdir(self.root):
            return []
        out = []
        for name in os.listdir(self.root):
            m = self.PATTERN.match(name)
            if m and os.path.exists(os.path.join(self.root, name, MARKER)):
                out.append((int(m.group(1)), os.path.join(self.root, name)))
        return sorted(out)

    def latest(self) -> str | None:
        """The last complete checkpoint (incomplete folders skipped), or None."""
        done = self.checkpoints()
        return done[-1][1] if done else None

    def load_latest(self, pm, optimizer=None) -> dict | None:
        """Load the last complete checkpoint (rank 0's choice, on every rank); its ``extra``, or
        None when there is none yet (a fresh start)."""
        wait_pending(pm)
        box = [self.latest()]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        return None if box[0] is None else load(pm, box[0], optimizer)

    def _prune(self, newest: str) -> None:
        done = self.checkpoints()
        for _, old in done[:-self.keep]:
            os.remove(os.path.join(old, MARKER))  # never a half-deleted folder that looks complete
            shutil.rmtree(old, ignore_errors=True)
        for name in os.listdir(self.root):  # writers that died (saves run one at a time)
            if ".tmp-" in name and self.PATTERN.match(name.split(".tmp-")[0]):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
