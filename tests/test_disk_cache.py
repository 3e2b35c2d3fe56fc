"""The capture cache's entries on disk (autopar/disk_cache.py): another process (another hash
seed) reads the traces and compiles the same program, and says so in its report; a file the
trace ran code from, edited since, is traced again with the new code; what has no name that holds
across processes (a class made in a function, an object compared by identity) has no key on disk."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import torch
from torch import nn

from autopar import capture_cache as cc
from autopar import disk_cache as disk
from autopar.capture import capture_graph

_JOB = r'''
import json
from autopar import disk_cache
from autopar.testing import build_model
import test_disk_cache as t

model, batches, loss_fn = build_model("hf_llama")
print(json.dumps({"stats": disk_cache.STATS, **t.compiled(model, batches, loss_fn)}))
'''


def compiled(model, batches, loss_fn) -> dict:
    """The model compiled on a fake dp=2 x tp=2 mesh: its per-rank program's digest and its report."""
    import hashlib

    import autopar
    from autopar.mesh import fake_mesh

    with fake_mesh({"dp": 2, "tp": 2}, 0) as mesh:
        pm = autopar.compile(model, mesh, example_inputs=batches[0], loss_fn=loss_fn,
                             plan={"dp": "fsdp", "tp": "megatron"})
        text = "\n".join(f"{n.name} {n.op} {n.target} {n.args} {n.meta.get('val')}"
                         for n in pm.program.local.graph.nodes)
        return {"program": hashlib.sha1(text.encode()).hexdigest(), "report": pm.report()}


def test_another_process_reads_the_traces_and_compiles_the_same_program(tmp_path, monkeypatch):
    from autopar.passes import propagate
    from autopar.testing import build_model

    # this process traces (nothing in memory, an empty directory) and writes ...
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("AUTOPAR_DISK_CACHE", raising=False)
    monkeypatch.setattr(propagate, "_SHARED_STRATEGIES", {})
    monkeypatch.setattr(disk, "_READ_MEMOS", {})
    cc.clear()
    disk.STATS.clear()
    first = compiled(*build_model("hf_llama"))
    assert disk.STATS == {"capture written": 1, "joint written": 1, "strategies written": 1}, disk.STATS
    assert "trace cache" not in first["report"]
    # ... and another, with another hash seed (a value a process derives from a string's hash, as
    # Hugging Face's GenerationConfig keeps its own, must not make the key differ), reads
    env = {**os.environ, "PYTHONHASHSEED": "7", "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__)] + sys.path)}
    out = subprocess.run([sys.executable, "-c", _JOB], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    second = json.loads(out.stdout.strip().splitlines()[-1])
    assert second["stats"] == {"capture read": 1, "joint read": 1, "strategies read": 1}, second["stats"]
    assert second["program"] == first["program"]
    assert (f"read from autopar's trace cache ({tmp_path / 'traces-1'}), made by an earlier process from the same "
            "model, code and torch: dynamo's capture, the joint graph, DTensor's strategies") in second["report"]


def _fresh(monkeypatch, tmp_path, on: bool = True):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("AUTOPAR_DISK_CACHE", "1" if on else "0")
    cc.clear()  # (as a new process: nothing in memory)
    disk.STATS.clear()


def _helper():
    return sys.modules["autopar_disk_cache_helper"]


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return _helper().scale(self.lin(x))  # (code in another file, reached through a global)


def _loss(out, y):
    return ((out - y) ** 2).mean()


def _constants(gm) -> set:
    return {a for n in gm.graph.nodes for a in n.args if isinstance(a, float)}


def _written(path, text: str, before_start: float | None) -> None:
    """``text`` into ``path``, dated ``before_start`` seconds before this process began (a file as
    another process would have found it) or now (None: an edit while this process runs)."""
    path.write_text(text)
    if before_start is not None:
        t = disk._started() - before_start
        os.utime(path, (t, t))


def _helper_module(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    helper = src / "autopar_disk_cache_helper.py"
    _written(helper, "def scale(x):\n    return x * 2.0\n", before_start=60)
    monkeypatch.syspath_prepend(str(src))
    sys.modules.pop("autopar_disk_cache_helper", None)  # (an earlier test's, from its own directory)
    monkeypatch.setitem(sys.modules, "autopar_disk_cache_helper", importlib.import_module("autopar_disk_cache_helper"))
    return helper


def test_a_file_the_trace_ran_edited_since_is_traced_again(tmp_path, monkeypatch):
    helper = _helper_module(tmp_path, monkeypatch)
    inputs = (torch.randn(2, 8), torch.randn(2, 8))

    _fresh(monkeypatch, tmp_path, on=False)
    capture_graph(_Scaled(), inputs, _loss)
    assert not (tmp_path / "cache").exists()  # (switched off: nothing written)

    _fresh(monkeypatch, tmp_path)
    assert 2.0 in _constants(capture_graph(_Scaled(), inputs, _loss))
    assert disk.STATS == {"capture written": 1}
    _fresh(monkeypatch, tmp_path)
    assert 2.0 in _constants(capture_graph(_Scaled(), inputs, _loss))
    assert disk.STATS == {"capture read": 1}

    # edited between two processes (here: dated before this one, and loaded again)
    _written(helper, "def scale(x):\n    return x * 3.25\n", before_start=30)
    importlib.reload(sys.modules["autopar_disk_cache_helper"])
    _fresh(monkeypatch, tmp_path)
    got = _constants(capture_graph(_Scaled(), inputs, _loss))
    assert 3.25 in got and 2.0 not in got
    assert disk.STATS == {"capture stale": 1, "capture written": 1}


def test_a_file_edited_while_the_process_runs_is_neither_read_nor_written(tmp_path, monkeypatch):
    # the process runs the code it loaded, which the file no longer says: an entry made from the
    # file (by another process) is not this process's trace, nor is this process's trace the file's
    helper = _helper_module(tmp_path, monkeypatch)
    inputs = (torch.randn(2, 8), torch.randn(2, 8))
    _fresh(monkeypatch, tmp_path)
    capture_graph(_Scaled(), inputs, _loss)
    assert disk.STATS == {"capture written": 1}
    _written(helper, "def scale(x):\n    return x * 4.5\n", before_start=None)  # (not loaded again)
    _fresh(monkeypatch, tmp_path)
    assert 2.0 in _constants(capture_graph(_Scaled(), inputs, _loss))
    assert disk.STATS == {"capture stale": 1, "capture edited": 1}


def test_what_has_no_name_across_processes_has_no_key_on_disk():
    from autopar.capture import _WithLoss

    def make(k: float):
        class Local(nn.Module):  # (its body could close over anything: ``k`` here; no attribute holds it)
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(8, 8)

            def forward(self, x):
                return self.lin(x) * k

        return Local()

    inputs = (torch.randn(2, 8), torch.randn(2, 8))

    def key(model):
        return disk.key_of(*cc.module_key("capture", _WithLoss(model, _loss, None), inputs, False))

    assert key(_Scaled()) is not None and key(_Scaled()) == key(_Scaled())
    assert key(make(2.0)) is None
    held = _Scaled()
    held.__dict__["other"] = nn.Linear(2, 2)  # (a module held as a plain attribute: compared by identity)
    assert key(held) is None


@torch.library.custom_op("autopar_test_disk::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_twice.register_fake
def _(x):
    return torch.empty_like(x)


_twice.register_autograd(lambda ctx, grad: grad * 2)


_LIB = torch.library.Library("autopar_test_disk2", "DEF")
_LIB.define("scale(Tensor x) -> Tensor")
_LIB.impl("scale", lambda x: x * 3.0, "CompositeImplicitAutograd")  # (decomposed into aten by AOTAutograd)


class _Applies(nn.Module):
    """A linear layer, then the class's ``op`` (not an attribute of the module: the key would hold it)."""

    op = None

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return type(self).op(self.lin(x))


class _Twice(_Applies):
    op = staticmethod(_twice)


class _Composite(_Applies):
    op = staticmethod(torch.ops.autopar_test_disk2.scale)


def test_a_graph_with_a_users_custom_op_is_not_written(tmp_path, monkeypatch):
    # (its fake kernel and backward live in a file no key names: a change there would go unseen)
    _fresh(monkeypatch, tmp_path)
    capture_graph(_Twice(), (torch.randn(2, 8), torch.randn(2, 8)), _loss)
    assert disk.STATS == {"capture custom op": 1}
    assert not list((tmp_path / "cache").glob("traces-*/capture/*"))
    # nor DTensor's answer for it (a rule the user registers for it lives in such a file too)
    import pickle

    import autopar
    from autopar import trace_share
    from autopar.mesh import fake_mesh
    from autopar.passes import propagate

    monkeypatch.setattr(propagate, "_SHARED_STRATEGIES", {})
    monkeypatch.setattr(disk, "_READ_MEMOS", {})
    with fake_mesh({"dp": 2, "tp": 2}, 0) as mesh:
        autopar.compile(_Twice(), mesh, example_inputs=(torch.randn(4, 8), torch.randn(4, 8)), loss_fn=_loss,
                        plan={"dp": "ddp", "tp": "megatron"})
    asked = {str(k[1][0]) for k in propagate._SHARED_STRATEGIES}
    files = (tmp_path / "cache").glob("traces-*/strategies/*")
    kept = {str(k[1][0]) for f in files for k in trace_share.decode(pickle.loads(f.read_bytes())["payload"])}
    assert "autopar_test_disk.twice.default" in asked and kept and "autopar_test_disk.twice.default" not in kept


def test_a_joint_graph_made_from_a_users_op_is_not_written(tmp_path, monkeypatch):
    # (its graph is all aten, but the op's Python code, in a file no key names, made it)
    from autopar.capture import joint_program

    _fresh(monkeypatch, tmp_path)
    model, inputs = _Composite(), (torch.randn(2, 8), torch.randn(2, 8))
    joint_program(capture_graph(model, inputs, _loss), inputs, model)
    assert disk.STATS == {"capture custom op": 1}, disk.STATS
    assert not list((tmp_path / "cache").glob("traces-*/*/*"))


class _NoRepr:
    def __repr__(self):
        raise RuntimeError("no repr")


def _loss_with_default(out, y, weight=_NoRepr()):
    return _loss(out, y)


def test_what_the_trace_reads_besides_the_model_is_in_the_key():
    from autopar.capture import _WithLoss

    inputs = (torch.randn(2, 8), torch.randn(2, 8))

    def key(loss=_loss):
        got = cc.module_key("capture", _WithLoss(_Scaled(), loss, None), inputs, False)
        return disk.key_of(*got)

    plain = key()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = key()
    with torch.autocast("cpu", dtype=torch.float16):
        fp16 = key()
    assert len({plain, bf16, fp16}) == 3 and None not in {plain, bf16, fp16}
    assert key(_loss_with_default) is None  # (a default that cannot be written: no key, no error)
