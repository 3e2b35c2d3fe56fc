"""Planning a model nobody here wrote (autopar/depth.py, ``splice.find_blocks``): its repeated block
list found in the module itself and cut in a copy on the meta device, for Hugging Face Llama,
Qwen2, Mistral, GPT-2 and Mixtral built from their configs (tiny, and Llama-3-70B's full-size
shapes at 6 blocks), torch's own ``nn.TransformerEncoder``, a model whose blocks are not all
alike, and two whose blocks repeat every two (Hugging Face Gemma 2, a torch model gating every
other block: extrapolated in units). ``autopar plan``'s fixed plan extrapolated from depths 3-5
equals the whole compile figure for figure; the model without one repeated block list is
compiled whole, saying why; the search refuses it, saying what to do instead."""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest

from autopar import splice
from autopar.depth import repeated
from autopar.tools.explain import plan_main

HERE = os.path.dirname(os.path.abspath(__file__))


def _spec(name: str) -> str:
    return f"{os.path.join(HERE, 'foreign_models.py')}:{name}"


def _factory(name: str):
    from autopar.models import zoo

    return zoo.load(_spec(name))


def _plan(*argv: str) -> tuple[dict, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert plan_main(["-q", "--json", *argv]) == 0
    return json.loads(out.getvalue())[0]


@pytest.mark.parametrize("name,path,heads,kv,hidden,vocab", [
    ("hf_llama", "model.layers", 4, 2, 64, 128),
    ("hf_qwen2", "model.layers", 8, 4, 1024, 32000),
    ("hf_mistral", "model.layers", 4, 2, 64, 128),
    ("hf_gpt2", "transformer.h", 8, 4, 1024, 32000),
    ("hf_mixtral", "model.layers", 4, 2, 64, 128),
    ("hf_llama70b_shapes", "model.layers", 64, 8, 8192, 128256),
    ("torch_encoder", "encoder.layers", 8, 8, 1024, 32000),
])
def test_the_block_list_is_found_and_cut_in_a_meta_copy(name, path, heads, kv, hidden, vocab):
    from autopar.planner import info_of

    loaded = _factory(name)
    rep = repeated(loaded.model, loaded.example_inputs, loaded.loss_fn, min_blocks=6)
    assert rep.path == path and rep.layers == 6
    three = rep.at(3, batch=2)
    assert len(three.model.get_submodule(path)) == 3 and len(loaded.model.get_submodule(path)) == 6
    assert all(p.is_meta for p in three.model.parameters()) and three.example_inputs[0].shape[0] == 2
    mine = {n for n, _ in loaded.model.named_parameters()}
    assert {n for n, _ in three.model.named_parameters()} <= mine  # the same names, fewer blocks
    assert not any(p is q for p in three.model.parameters() for q in loaded.model.parameters())
    info = info_of(loaded.model, loaded.example_inputs, loaded.loss_fn, spec=name)
    assert (info.depth_field, info.layers, info.heads, info.kv_heads, info.hidden, info.vocab) == (
        path, 6, heads, kv, hidden, vocab)


def test_blocks_that_differ_are_no_block_list():
    """A list of one class whose blocks differ in a shape, or in a plain attribute other than a
    layer index (Qwen2's per-layer sliding window), is not a repeated block list; a list inside a
    block of another (experts in a decoder layer) is that block's."""
    loaded = _factory("unalike")
    why = splice.find_blocks(loaded.model, 6)
    assert why == ("the blocks of its list blocks are not alike: block 4 (_Block) differs from block 0 (_Block) in "
                   "up.weight's shape or dtype")
    qwen = _factory("hf_qwen2").model
    assert splice.block_list(qwen) is not None  # layer_idx differs block to block: an index, allowed
    qwen.model.layers[4].self_attn.sliding_window = 8
    assert "self_attn.sliding_window (None / 8)" in splice.find_blocks(qwen, 6)
    from torch import nn

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.ModuleDict({"experts": nn.ModuleList(nn.Linear(2, 2) for _ in range(8))})
                                        for _ in range(2))

    assert "has 2 (fewer than 4)" in splice.find_blocks(Experts())


def test_blocks_that_repeat_every_few_are_units():
    """Blocks alike only with the one two places before (Gemma 2 alternates a sliding-window and a
    full attention layer; a torch model gating every other block): no block list, but a list of
    units of two (``splice.find_period``), which ``autopar plan`` extrapolates unit by unit; the
    search does not take them (``repeated`` without ``periodic``)."""
    for name, path in (("hf_gemma2", "model.layers"), ("alternating", "blocks")):
        loaded = _factory(name)
        assert "are not alike: block 1" in splice.find_blocks(loaded.model, 6)
        found = splice.find_period(loaded.model, 6)
        assert found is not None and (found[0], len(found[1]), found[2]) == (path, 12, 2)
        assert splice.find_period(loaded.model, 7) is None  # 6 units of 2: too few for 7
        assert isinstance(repeated(loaded.model, loaded.example_inputs, min_blocks=6), str)
        rep = repeated(loaded.model, loaded.example_inputs, min_blocks=6, periodic=True)
        assert (rep.path, rep.period, rep.layers) == (path, 2, 6)
        assert len(rep.at(3).model.get_submodule(path)) == 6
    assert splice.find_period(_factory("unalike").model, 2) is None  # wider blocks at the end: no period


# Every figure of the plan table (bytes and calls per collective, FLOPs, parameters, memory) equal
# to the whole compile's, times within 1% (tests/test_extrapolate.py's check, on foreign models).
# torch's encoder fails the check (its first block compiles to more ops at depth 3 than at 4 and 5:
# a relayout autopar adds there) and is compiled whole, saying so: the same table.
@pytest.mark.parametrize("name,mesh,plan,extra", [
    ("hf_llama", "dp=2,tp=2", "dp=fsdp,tp=megatron", ()),
    pytest.param("hf_qwen2", "dp=2,tp=2", "dp=zero2,tp=megatron", (),  # q/k/v biases stored whole on dp: listed per block
                 marks=pytest.mark.slow),
    pytest.param("hf_mistral", "dp=2", "dp=fsdp", (), marks=pytest.mark.slow),
    pytest.param("hf_gpt2", "dp=2", "dp=fsdp", (), marks=pytest.mark.slow),  # (21 s: dropout, every depth traced)
    pytest.param("hf_mixtral", "dp=2,tp=2", "dp=fsdp,tp=megatron", (), marks=pytest.mark.slow),
    pytest.param("hf_llama70b_shapes", "dp=4,tp=8", "dp=fsdp,tp=megatron", ("--precision", "bf16"),
                 marks=pytest.mark.slow),
    ("torch_encoder", "dp=2", "dp=fsdp", ()),
    # blocks that repeat every two (extrapolated in units of two blocks, every depth traced)
    ("alternating", "dp=2", "dp=fsdp", ()),
    pytest.param("hf_gemma2", "dp=2,tp=2", "dp=fsdp,tp=megatron", (), marks=pytest.mark.slow),
])
def test_a_fixed_plan_extrapolated_equals_the_whole_compile(monkeypatch, name, mesh, plan, extra):
    from test_extrapolate import _close

    monkeypatch.setenv("AUTOPAR_PLAN_FORK", "always")  # depths 3 and 4 beside, as on the command line
    argv = [_spec(name), "--mesh", mesh, "--plan", plan, *extra]
    fast, full = _plan(*argv), _plan(*argv, "--full-depth")
    if name == "torch_encoder":
        assert fast["notes"][0].startswith("blocks not identical at depths (3, 4, 5) (") and "extrapolated" not in fast
    elif name in ("alternating", "hf_gemma2"):  # 12 blocks, 6 units of 2: compiled at 6, 8, 10 blocks
        loc = fast["extrapolated"].pop("localized")
        assert fast["extrapolated"] == {"depths": [3, 4, 5], "layers": 6, "period": 2, "forked": [4],
                                        "forked_after": "localize",
                                        "blocks": "blocks" if name == "alternating" else "model.layers"}, fast["notes"]
        assert all(not any(x == "spliced" for x in lines) for lines in loc.values()), loc
    else:
        # depth 3 up to its localize before the fork (the child finishes it, then compiles 4); 4
        # and 5 splice its per-rank program (autopar/local_splice.py)
        # where they can, else are traced and say why: GPT-2's dropouts refuse it
        loc = fast["extrapolated"].pop("localized")
        assert fast["extrapolated"] == {"depths": [3, 4, 5], "layers": 6, "period": 1,
                                        "blocks": "transformer.h" if name == "hf_gpt2" else "model.layers",
                                        "forked": [4], "forked_after": "localize"}, fast["notes"]
        if name == "hf_gpt2":
            why = "a dropout (its mask is keyed by its node's name)"
            assert loc == {"3": [f"depth 3 not recorded: {why}"],
                           **{d: [f"traced: depth 3's program was not recorded ({why})"] for d in ("4", "5")}}
        elif name == "hf_mixtral":  # its experts' placed graph: blocks not in runs, traced and said why
            assert loc["3"] == ["recorded"] and sorted(loc) == ["3", "4", "5"], loc
            assert all(len(loc[d]) == 1 and loc[d][0].startswith("traced: ") for d in ("4", "5")), loc
        else:  # Llama-like blocks (Llama, Qwen2, Mistral, Llama-70B's shapes): spliced
            assert loc == {"3": ["recorded"], "4": ["spliced"], "5": ["spliced"]}, loc
    assert "extrapolated" not in full
    for key in ("parameters", "comm_bytes", "comm_calls", "flops"):
        assert fast[key] == full[key], key
    full["memory"].pop("peak_node")
    fast["memory"].pop("peak_node", None)
    assert fast["memory"] == full["memory"]
    _close({k: v for k, v in fast["time"].items() if k != "stage_seconds"},
           {k: v for k, v in full["time"].items() if k != "stage_seconds"}, 1e-2, "time")
    assert [n for n in fast["notes"] if "stored whole" in n] == [n for n in full["notes"] if "stored whole" in n]


def test_a_model_without_one_block_list_plans_whole_and_the_search_says_what_to_do(capsys):
    from autopar.tools.explain import plan_main as main

    assert main(["-q", _spec("unalike"), "--mesh", "dp=2", "--plan", "dp=fsdp"]) == 0
    out = capsys.readouterr().out
    assert ("note: compiled every block, not extrapolated in depth: the blocks of its list blocks are not alike: "
            "block 4") in out
    assert main(["-q", _spec("unalike"), "--plan", "auto", "--world", "2"]) == 2
    err = capsys.readouterr().err
    assert "cannot search" in err and "not alike" in err and "give a fixed plan" in err


def test_the_search_takes_blocks_that_repeat_every_few_in_units():
    """``alternating``'s 12 blocks gate every other output (as Gemma 2 alternates its attention
    window): the search's unit is two blocks, its depths 1-3 are 2, 4 and 6 blocks, pipelines are
    not searched (said in a note and in each refused candidate), and the zero1 confirmation (at 1
    and 2 units) equals the whole model compiled, 12 blocks. (Not ddp's or fsdp's: at these tiny
    shapes ddp's step time comes out 0.8% low and fsdp's peak from 1 and 2 blocks 21% high on 12
    blocks all alike too; fsdp's is exact from 2 and 3 blocks, and at Llama-3-8B's from 1 and 2.)"""
    from autopar import planner as P
    from autopar.analysis import cost as C

    loaded = _factory("alternating")
    info = P.info_of(loaded.model, loaded.example_inputs, loaded.loss_fn, spec="alternating")
    assert (info.period, info.layers) == (2, 6)
    res = P.search(info, 2, precision="fp32", confirm_top=1, mbs_choices=(1,), recompute=("none",),
                   tp_strategies=("megatron",), schedules=("1f1b",), dp_strategies=("zero1",))
    assert res.ranked and res.linear_check == ["identical"] and all(c.pp == 1 for c in res.ranked)
    assert any(n.startswith("pipeline parallelism not searched: the blocks repeat in units of 2") for n in res.notes)
    assert any(c.startswith("dp=1") and "units of 2" in why for c, why in res.refused), res.refused
    confirmed = [c for c in res.ranked if c.confirmed]
    assert [c.dp_strategy for c in confirmed] == ["zero1"]
    for c in confirmed:
        whole = P.compiled(c, info, C.get_device("h100"), info.layers, precision="fp32")
        assert c.confirmed["depths"] == (1, 2)
        assert c.step_s == pytest.approx(whole["step_s"], rel=1e-6) and c.peak == whole["peak"]
    assert "12 layers in 6 units of 2" in P.report(res)


@pytest.mark.slow
@pytest.mark.parametrize("name,checked", [("hf_falcon", "identical from depth 2"), ("hf_mamba", "identical")])
def test_the_search_takes_falcon_and_mamba(name, checked):
    """The architecture sweep's two last refusals (benchmarks/results/planner-archs-2026-12-03.md):
    Falcon's depth 1 is off its blocks' line (its figures taken from depths 2 and 3, a note says
    so); Mamba's blocks all-reduced their residual in bf16 in some blocks and fp32 in others until
    the propagation reduced a Partial before the add that widens it (2026-12-03)."""
    from autopar import planner as P

    loaded = _factory(name)
    info = P.info_of(loaded.model, loaded.example_inputs, loaded.loss_fn, spec=name)
    res = P.search(info, 8, budget="80GiB", confirm_top=0, mbs_choices=(1,), tp_strategies=("megatron",),
                   schedules=("1f1b",))
    assert res.ranked and res.linear_check == [checked], res.linear_check
    assert any("from depths 2 and 3" in n for n in res.notes) == (checked != "identical")


@pytest.mark.slow
def test_the_search_checks_mixtral_without_recomputation():
    """The search's identical-blocks check (depths 1-3) takes a block choice without recomputation:
    under full recomputation Mixtral's peak moves between depths 1 and 2 (its increments 2,304 then
    2,048 bytes at these shapes) and the search refused it as blocks that differ (2026-12-03)."""
    from autopar import planner as P

    loaded = _factory("hf_mixtral")
    info = P.info_of(loaded.model, loaded.example_inputs, loaded.loss_fn, spec="hf_mixtral")
    res = P.search(info, 8, budget="80GiB", confirm_top=0, mbs_choices=(1,), tp_strategies=("megatron",),
                   schedules=("1f1b",))
    assert res.ranked and res.linear_check == ["identical"]
