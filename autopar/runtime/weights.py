"""Weights from outside into a compiled program's shards: a model built on the meta device,
compiled, then loaded from a Hugging Face checkpoint with every rank reading only its shards.

The workflow (docs/api.md, "Pretrained weights")::

    with autopar.init_empty_weights():           # parameters on meta, buffers real (or: torch.device("meta"))
        model = AutoModelForCausalLM.from_config(cfg)
    pm = autopar.compile(model, mesh, example_inputs=(tokens, targets), loss_fn=..., plan=...)
    pm.load_pretrained("path/to/hf-checkpoint")  # model.safetensors, or model-0000i-of-0000n + the index

- ``autopar.compile`` on a model whose parameters are meta and whose example batch is real
  (``compiler.deferred_weights``) traces on meta exactly as a planning compile does (only shapes are
  needed), but the program runs on the mesh's device: the localize pass puts the graph's meta device
  arguments (``arange(..., device=meta)``) on it. Each parameter becomes an EMPTY local shard
  (``empty_dtensor``: uninitialised memory of this rank's shard only) and ``train_step`` refuses to
  run until the weights are loaded (``load_pretrained``, or ``pm.load`` of an autopar checkpoint).
- Buffers (``materialize_buffers``): persistent ones (in the state dict) are made empty and are
  read from the checkpoint with the weights; non-persistent ones (rotary ``inv_freq``, computed in
  ``__init__``) cannot be loaded, and under ``torch.device("meta")`` their values were never
  computed: a Hugging Face model (it has a ``config``) is built once more under
  ``init_empty_weights`` (parameters on meta, so only the buffers take memory: the model's own
  ``__init__`` computes them, whatever the architecture) and its buffers are copied. Other models
  must be built under ``autopar.init_empty_weights()`` (the robust way for any model: buffers are
  never meta), else the compile says which buffers are missing.
- ``load_pretrained`` reads, for each parameter this rank holds (a pipeline rank: its stages'
  only), the slice its DTensor placements give (``compute_local_shape_and_global_offset``) with
  ``safetensors.safe_open(...).get_slice(name)[slices]``: no rank holds more than its shards plus
  one shard being converted. A placement without a contiguous slice (``_StridedShard``) reads that
  one parameter whole and keeps its part (the report names those).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import re
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate, Shard

from autopar import torch_compat as tc
from autopar.errors import InputError, PlanError
from autopar.scoped import setting
from autopar.parts import fused_shapes, part_of

# ------------------------------------------------------------------------ building on meta
_EMPTY = contextvars.ContextVar("autopar_init_empty_weights", default=False)


def _to_meta(module, name, param) -> None:
    """After ``nn.Module.register_parameter``, inside ``init_empty_weights`` (this thread only):
    the parameter just registered moved to meta."""
    if _EMPTY.get() and param is not None and not param.is_meta:
        p = module._parameters[name]
        new = type(p)(p.to("meta"), requires_grad=p.requires_grad)
        new.__dict__.update(p.__dict__)  # attributes libraries set on parameters
        module._parameters[name] = new


_REGISTER_PARAMETER = tc.register_parameter_hook(_to_meta)


@contextlib.contextmanager
def init_empty_weights():
    """Build a model with its parameters on the meta device and its buffers real (accelerate's
    ``init_empty_weights(include_buffers=False)``): each parameter is moved to meta as it is
    registered, so a layer's weight is never initialised and the model costs no memory, while
    buffers computed in ``__init__`` (rotary tables) keep their values. Compile the model, then
    ``pm.load_pretrained(path)``. ``nn.Module.register_parameter`` is patched while a block is
    open (in any thread: the patched function acts only in the thread that opened the block)."""
    with setting(_EMPTY, True, _REGISTER_PARAMETER):
        yield


# ------------------------------------------------------------------------ materializing
def _global_stride(shape) -> tuple[int, ...]:
    return tc.contiguous_strides(shape)


def empty_dtensor(p: torch.Tensor, mesh, placements, device) -> DTensor:
    """A DTensor of ``p``'s global shape and dtype with ``placements`` on ``mesh`` whose local
    shard is uninitialised memory on ``device`` (the parameter of a model built on meta)."""
    local_shape, _ = tc.compute_local_shape_and_global_offset(tuple(p.shape), mesh, placements)
    local = torch.empty(local_shape, dtype=p.dtype, device=device)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=p.shape, stride=_global_stride(p.shape))


def tied_names(module: nn.Module) -> dict[str, str]:
    """{alias: the name the program uses} for parameters registered under several names (tied
    input and output embeddings: ``lm_head.weight`` -> ``model.embed_tokens.weight``)."""
    first: dict[int, str] = {}
    out = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def _non_persistent(module: nn.Module) -> set[str]:
    out = set()
    for mod_name, mod in module.named_modules():
        for b in getattr(mod, "_non_persistent_buffers_set", ()):
            out.add(f"{mod_name}.{b}" if mod_name else b)
    return out


def _set_buffer(module: nn.Module, full_name: str, value: torch.Tensor) -> None:
    mod_name, _, attr = full_name.rpartition(".")
    mod = module.get_submodule(mod_name) if mod_name else module
    mod._buffers[attr] = value  # (keeps its persistence: _non_persistent_buffers_set is by name)


def materialize_buffers(pm) -> None:
    """The buffers of a model built on meta, on the program's device: persistent ones empty (to
    be loaded with the weights: ``pm._unloaded``), non-persistent ones recomputed (module
    docstring). An unrecoverable buffer is a PlanError naming it (the same on every rank)."""
    module, device = pm.module, pm.ctx.device
    meta = {n: b for n, b in module.named_buffers() if b is not None and b.is_meta}
    if not meta:
        return
    transient = _non_persistent(module)
    fresh = _rebuilt_buffers(module, [n for n in meta if n in transient])
    lost = []
    for name, b in meta.items():
        if name not in transient:
            _set_buffer(module, name, torch.empty(b.shape, dtype=b.dtype, device=device))
            pm._unloaded.add(name)
        elif name in fresh and tuple(fresh[name].shape) == tuple(b.shape):
            _set_buffer(module, name, fresh[name].to(device=device, dtype=b.dtype))
        else:
            lost.append(name)
    if lost:
        raise PlanError(f"{len(lost)} non-persistent buffer(s) of the model are on the meta device, so their values "
                        f"were never computed, and no checkpoint holds them: {_some(lost)}",
                        where="autopar.compile(model): " + lost[0],
                        fix="build the model under autopar.init_empty_weights() (parameters on meta, buffers "
                            "computed), instead of torch.device('meta')")


def _rebuilt_buffers(module: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """The values of buffers ``names`` as the model's own ``__init__`` computes them: a Hugging Face
    model is built again from its config under ``init_empty_weights`` (parameters on meta: only the
    buffers cost memory). {} for other models (or if that fails)."""
    config = getattr(module, "config", None)
    if not names or config is None or not hasattr(type(module), "config_class"):
        return {}
    try:
        with init_empty_weights(), torch.device("cpu"):
            twin = type(module)(config)
    except Exception:  # noqa: BLE001 - reported as the buffers it could not recompute
        return {}
    bufs = dict(twin.named_buffers())
    return {n: bufs[n] for n in names if n in bufs and bufs[n] is not None and not bufs[n].is_meta}


# ------------------------------------------------------------------------ a Hugging Face checkpoint
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def _safe_open(path: str):
    """safetensors' reader, or an error that says how to get it (the same on every rank: each
    rank's environment lacks it alike, and it is checked before anything is read or sent)."""
    try:
        from safetensors import safe_open
    except ImportError:
        raise InputError("reading a Hugging Face checkpoint needs the safetensors package, which is not "
                         "installed", where=f"load_pretrained({path!r})",
                         fix="pip install safetensors (or autopar[hf])") from None
    return safe_open


def checkpoint_files(path: str) -> dict[str, str]:
    """{tensor name: file} of the safetensors checkpoint at ``path`` (a folder with
    ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` and their index; or one
    ``.safetensors`` file), reading headers only."""
    safe_open = _safe_open(path)
    where = f"load_pretrained({path!r})"
    if os.path.isfile(path) and path.endswith(".safetensors"):
        files = [path]
    elif os.path.isfile(os.path.join(path, INDEX)):
        try:
            with open(os.path.join(path, INDEX)) as f:
                weight_map = json.load(f)["weight_map"]
        except (ValueError, KeyError) as e:
            raise InputError(f"the index {INDEX} is damaged: {e}", where=os.path.join(path, INDEX),
                             fix="save the checkpoint again (save_pretrained)") from None
        absent = sorted({f for f in weight_map.values() if not os.path.isfile(os.path.join(path, f))})
        if absent:
            raise InputError(f"the index names {len(absent)} file(s) the folder does not have: {_some(absent)}",
                             where=os.path.join(path, INDEX), fix="copy the whole checkpoint folder")
        return {k: os.path.join(path, f) for k, f in weight_map.items()}
    elif os.path.isfile(os.path.join(path, SINGLE)):
        files = [os.path.join(path, SINGLE)]
    else:
        what = "no such folder" if not os.path.exists(path) else (
            "a PyTorch .bin checkpoint (only safetensors is read)" if any(
                f.endswith(".bin") for f in os.listdir(path)) else f"no {SINGLE} or {INDEX} in it") \
            if os.path.isdir(path) or not os.path.exists(path) else "not a .safetensors file"
        raise InputError(f"no safetensors checkpoint at {path}: {what}", where=where,
                         fix="pass the folder save_pretrained(..., safe_serialization=True) wrote (a Hugging Face "
                             "download holds model.safetensors or model-0000i-of-0000n.safetensors + the index)")
    out = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for k in f.keys():
                out[k] = file
    return out


_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
             "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


@dataclass
class LoadReport:
    """What ``load_pretrained`` read, on this rank and every rank (``per_rank``)."""

    path: str
    tensors: int = 0  # tensors this rank read (whole or a slice)
    bytes_read: int = 0  # bytes of the slices this rank read, as stored in the file
    model_bytes: int = 0  # every tensor of the checkpoint the model uses, as stored
    read_whole: list = field(default_factory=list)  # parameters read whole (no contiguous slice)
    seconds: float = 0.0
    rss_before: int = 0  # this process's resident bytes before the load
    rss_peak: int = 0  # its peak during the load (VmHWM, reset before; -1 where it cannot be reset)
    rss_after: int = 0
    per_rank: list = field(default_factory=list)  # (bytes_read, rss_peak - rss_before) of every rank

    def line(self) -> str:
        mb = 1 / 2**20
        ranks = "; ".join(f"rank {r}: read {b * mb:.1f} MiB ({b / max(self.model_bytes, 1):.0%}), peak RSS "
                          + (f"+{p * mb:.1f} MiB" if p >= 0 else "n/a") for r, (b, p) in enumerate(self.per_rank))
        whole = f"; read whole: {', '.join(self.read_whole)}" if self.read_whole else ""
        return (f"load_pretrained {self.path}: model {self.model_bytes * mb:.1f} MiB in the checkpoint, "
                f"{self.seconds:.2f} s; {ranks}{whole}")


def _some(names: list[str], n: int = 6) -> str:
    return ", ".join(names[:n]) + (f" ... ({len(names) - n} more)" if len(names) > n else "")


def _proc_status(key: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return -1


def _reset_peak_rss() -> bool:
    """Reset this process's VmHWM (Linux: ``echo 5 > /proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _map_names(file_keys, model_keys, prefix: str | None) -> dict[str, str]:
    """{model name: checkpoint key}: the same names, or, for a Hugging Face base model and a
    checkpoint of its task model (or the reverse), names differing by ``base_model_prefix.``."""
    keys = set(file_keys)
    direct = {n: n for n in model_keys if n in keys}
    if direct or not prefix:
        return direct
    p = prefix + "."
    stripped = {n: p + n for n in model_keys if p + n in keys}
    added = {n: n[len(p):] for n in model_keys if n.startswith(p) and n[len(p):] in keys}
    return stripped if len(stripped) >= len(added) else added


def _local_slices(p: DTensor):
    """The slices of ``p``'s global tensor this rank holds, or None (no contiguous block)."""
    if not all(type(pl) in (Shard, Replicate) for pl in p.placements):
        return None
    shape, offset = tc.compute_local_shape_and_global_offset(tuple(p.shape), p.device_mesh, p.placements)
    return tuple(slice(o, o + s) for o, s in zip(offset, shape)), tuple(shape)


def load_pretrained(pm, path, strict: bool = True, verbose: bool = True) -> LoadReport:
    """Load a Hugging Face safetensors checkpoint into ``pm``'s parameters (and persistent
    buffers), every rank reading only the slices it holds; see the module docstring. Call on
    every rank. ``strict``: a parameter the checkpoint lacks, or a tensor it holds that the model
    does not have, is an error naming them (on every rank); ``strict=False`` loads what matches (a
    parameter left unloaded still stops ``train_step``). Tensors are converted to the parameter's
    dtype; a shape that differs is an error naming the key and both shapes."""
    path = os.fspath(path)
    safe_open = _safe_open(path)
    where = f"{type(pm).__name__}.load_pretrained({path!r})"
    t0 = time.perf_counter()
    module = pm.module
    errors: list[str] = []
    try:
        files = checkpoint_files(path)
    except InputError as e:
        files, errors = {}, [e.problem]
    transient = _non_persistent(module)
    # what the model consists of (a pipeline rank: every stage's names and global shapes)
    tied = pm._tied
    shapes = fused_shapes({n: tuple(t.shape) for n, t in module.state_dict(keep_vars=True).items() if n not in tied},
                          module)  # (a weight cut into parts, autopar/unfuse.py: under its own name)
    names = _map_names(files, list(shapes) + list(tied), getattr(module, "base_model_prefix", None))
    key_of = {}
    for n in shapes:  # a tied parameter may be stored under any of its names
        aliases = [n] + [a for a, c in tied.items() if c == n]
        found = [names[a] for a in aliases if a in names]
        if found:
            key_of[n] = found[0]
    used = set(key_of.values()) | {names[a] for a in tied if a in names}
    if files and not errors:
        missing = [n for n in shapes if n not in key_of]
        ignore = [re.compile(p) for p in getattr(module, "_keys_to_ignore_on_load_unexpected", None) or []]
        unexpected = [k for k in files if k not in used and k not in transient
                      and not any(r.search(k) for r in ignore)]
        if strict and missing:
            errors.append(f"the checkpoint has no tensor for {len(missing)} of the model's parameters/buffers: "
                          + _some(missing))
        if strict and unexpected:
            errors.append(f"the checkpoint holds {len(unexpected)} tensor(s) this model does not have: "
                          + _some(unexpected))
        headers = {}
        for file in sorted(set(files[k] for k in key_of.values())):
            with safe_open(file, framework="pt") as f:
                for k in f.keys():
                    if k in used:
                        sl = f.get_slice(k)
                        headers[k] = (tuple(sl.get_shape()), sl.get_dtype())
        for n, k in key_of.items():
            if headers[k][0] != shapes[n]:
                errors.append(f"{k} has shape {list(headers[k][0])} in the checkpoint but the model's {n} has "
                              f"shape {list(shapes[n])}")
    everyone = [None] * dist.get_world_size() if dist.is_initialized() else [errors]
    if len(everyone) > 1:  # a rank's own error would leave the others waiting in the next step
        dist.all_gather_object(everyone, errors)
    else:
        everyone = [errors]
    errors = list(dict.fromkeys(e for errs in everyone for e in errs))
    if errors:
        raise InputError(f"the checkpoint at {path} does not fit this model:" + "".join(f"\n  - {e}" for e in errors),
                         where=where, fix="load a checkpoint of this architecture and config (its parameter "
                                          "names and shapes), or pass strict=False to load the tensors that match")
    report = LoadReport(path, model_bytes=sum(
        _numel(headers[k][0]) * _ITEMSIZE.get(headers[k][1], 4) for k in set(key_of.values())))
    # what this rank holds: its parameters (a pipeline rank: its stages'), the persistent buffers
    wanted = {n: p for n, p in pm.named_parameters() if n in key_of}
    cut = {n: c for n, c in part_of(module).items() if c[0] in key_of}  # part -> (fused, offset, dim)
    wanted.update({n: p for n, p in pm.named_parameters() if n in cut})
    key_of.update({n: key_of[c[0]] for n, c in cut.items()})
    wanted.update({n: b for n, b in module.named_buffers() if n in shapes and n in key_of and not b.is_meta})
    can_reset = _reset_peak_rss()
    report.rss_before = _proc_status("VmRSS")
    by_file: dict[str, list[str]] = {}
    for n in wanted:
        by_file.setdefault(files[key_of[n]], []).append(n)
    loaded = set()
    with torch.no_grad():
        for file, ns in sorted(by_file.items()):
            with safe_open(file, framework="pt") as f:
                for n in ns:
                    k = key_of[n]
                    t = wanted[n]
                    itemsize = _ITEMSIZE.get(headers[k][1], 4)
                    if isinstance(t, DTensor):
                        got = _local_slices(t)
                        local = t.to_local()
                        if got is not None and n in cut:  # a part: its rows of the fused tensor
                            _, at, dim = cut[n]
                            sl = list(got[0])
                            sl[dim] = slice(sl[dim].start + at, sl[dim].stop + at)
                            got = tuple(sl), got[1]
                        if got is None:  # no contiguous block: this one parameter whole, then its part
                            from torch.distributed.tensor import distribute_tensor

                            full = f.get_tensor(k)
                            if n in cut:
                                full = full.narrow(cut[n][2], cut[n][1], t.shape[cut[n][2]])
                            part = distribute_tensor(full, t.device_mesh, t.placements,
                                                     src_data_rank=None).to_local()
                            report.read_whole.append(n)
                            report.bytes_read += full.numel() * itemsize
                            local.copy_(part)
                            del full, part
                        else:
                            slices, shape = got
                            if _numel(shape):
                                local.copy_(f.get_slice(k)[slices])  # (copy_ converts the dtype: no temporary)
                            report.bytes_read += _numel(shape) * itemsize
                    else:  # a buffer (replicated, small) or a parameter of a one-rank program
                        whole = f.get_tensor(k)
                        t.copy_(whole.narrow(cut[n][2], cut[n][1], t.shape[cut[n][2]]) if n in cut else whole)
                        report.bytes_read += t.numel() * itemsize
                    report.tensors += 1
                    loaded.add(n)
    report.rss_peak = _proc_status("VmHWM") if can_reset else -1
    report.rss_after = _proc_status("VmRSS")
    pm._unloaded -= loaded
    mine_left = sorted(pm._unloaded)
    report.seconds = time.perf_counter() - t0
    figures = (report.bytes_read, report.rss_peak - report.rss_before if report.rss_peak >= 0 else -1, mine_left)
    everyone = [figures]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, figures)
    report.per_rank = [(b, p) for b, p, _ in everyone]
    # the same on every rank: train_step refuses to run anywhere while any rank lacks weights
    pm._unloaded = set(n for _, _, left in everyone for n in left)
    pm.load_report = report
    if verbose and (not dist.is_initialized() or dist.get_rank() == 0):
        print(report.line(), flush=True)
    return report


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
