"""The masks pass (passes/masks.py): an attention mask computed from no input that is the causal
mask becomes ``is_causal=True``; every other mask stays. Checked against the graph before the
rewrite (same loss and gradients, computed by autograd through both torch-level graphs) and
against one eager process (the compiled program on one rank)."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import nn

from autopar.capture import capture_graph
from autopar.passes.masks import causal_masks, is_causal_mask

F = nn.functional
SDPA = F.scaled_dot_product_attention


def _sdpa_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and "scaled_dot_product" in str(n.target)]


class _Attn(nn.Module):
    """One attention layer whose mask is built by ``make(tokens, s)`` inside forward."""

    def __init__(self, make, vocab=64, dim=32, heads=4):
        super().__init__()
        self.make, self.heads = make, heads
        self.emb = nn.Embedding(vocab, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        b, s = tokens.shape
        x = self.emb(tokens)
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        o = SDPA(q, k, v, attn_mask=self.make(tokens, s))
        return self.head(x + o.transpose(1, 2).reshape(b, s, -1))


def _ce(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(0, 1))


def _written_after(t, s):
    """The causal mask, then its first column set through a view: the mask SDPA reads is not causal."""
    m = torch.ones(s, s, dtype=torch.bool).tril()
    m[:, 0] = True
    return m


MASKS = {
    # (mask builder, rewritten?, what the report says)
    "tril bool": (lambda t, s: torch.ones(s, s, dtype=torch.bool).tril(), True, "is the causal mask"),
    "arange compare": (lambda t, s: (torch.arange(s)[None, :] <= torch.arange(s)[:, None])[None, None].expand(
        t.shape[0], 1, s, s), True, "is the causal mask"),
    "additive -inf": (lambda t, s: torch.full((s, s), float("-inf")).triu(1), True, "is the causal mask"),
    "sliding window": (lambda t, s: (torch.ones(s, s, dtype=torch.bool).tril() & ~torch.ones(s, s, dtype=torch.bool)
                                     .tril(-4)), False, "is not the causal mask"),
    "shifted diagonal": (lambda t, s: torch.ones(s, s, dtype=torch.bool).tril(-1) | torch.eye(s, dtype=torch.bool)
                         .roll(1, 0), False, "is not the causal mask"),
    "random": (lambda t, s: torch.ones(s, s, dtype=torch.bool).tril() | (torch.rand(s, s) < 0.3), False,
               "differs between two evaluations"),
    "made in place": (lambda t, s: torch.ones(s, s, dtype=torch.bool).tril_(), True, "is the causal mask"),
    "written after": (_written_after, False, "an in-place op writes"),
    "padding": (lambda t, s: torch.ones(s, s, dtype=torch.bool).tril()[None, None] & (t != 0)[:, None, None, :],
                False, "depends on an input"),
}


@pytest.mark.parametrize("name", list(MASKS))
def test_a_constant_causal_mask_becomes_is_causal_and_nothing_else_does(name, monkeypatch):
    """(A mask is evaluated a second time, with another seed, only where the first evaluation
    drew random numbers.)"""
    from autopar.passes import masks

    make, rewritten, says = MASKS[name]
    torch.manual_seed(0)
    model = _Attn(make)
    x = torch.randint(1, 64, (2, 12))
    x[1, 9:] = 0  # padding in the second row (matters to the input-dependent mask only)
    y = torch.randint(0, 64, (2, 12))
    before = capture_graph(model, (x, y), _ce)
    after = capture_graph(model, (x, y), _ce)
    evaluate, evaluations = masks._evaluate, []
    monkeypatch.setattr(masks, "_evaluate", lambda *a, **k: evaluations.append(1) or evaluate(*a, **k))
    lines = causal_masks(after, model)
    assert len(lines) == 1 and says in lines[0], lines
    if name not in ("written after", "padding"):  # (evaluated: those two were refused before)
        assert len(evaluations) == (2 if name == "random" else 1), evaluations
    sdpa = _sdpa_nodes(after)
    assert len(sdpa) == 1
    assert (sdpa[0].kwargs.get("is_causal") is True and sdpa[0].kwargs.get("attn_mask") is None) == rewritten
    if rewritten:
        assert "is_causal=True" in lines[0] and len(after.graph.nodes) < len(before.graph.nodes)
    # the graphs compute the same loss and, through autograd, the same gradients
    if name != "random":
        outs = []
        for gm in (before, after):
            model.zero_grad()
            loss = torch.fx.Interpreter(gm).run(x, y)
            loss = loss[0] if isinstance(loss, (tuple, list)) else loss
            loss.backward()
            outs.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-6, atol=1e-6)
        for a, b in zip(outs[0][1], outs[1][1]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _rows(t, s, offset=False, strict=False):
    """Hugging Face's way: position ids per batch row, compared into a [batch, 1, s, s] mask."""
    pos = torch.arange(s)[None].expand(t.shape[0], s) + (torch.arange(t.shape[0])[:, None] if offset else 0)
    return pos[:, None, None, :] < pos[:, None, :, None] if strict else pos[:, None, None, :] <= pos[:, None, :, None]


@pytest.mark.parametrize("make,says", [
    (_rows, "so one batch row evaluated: the rows are the same ops on identical values): is_causal=True"),
    (lambda t, s: _rows(t, s, strict=True), "is not the causal mask"),
    # each row causal, but the rows read different values: not proven alike, so kept
    (lambda t, s: _rows(t, s, offset=True), "batch rows not provably alike"),
])
def test_a_mask_too_large_to_evaluate_is_checked_one_row_at_a_time_where_the_rows_are_alike(monkeypatch, make, says):
    """A mask over EVAL_BYTES (Llama-3-70B's batch 128 x 4096: 14 GiB to evaluate whole) whose batch
    rows are pointwise ops of identical small values: row 0 evaluated stands for every row."""
    from autopar.passes import masks

    monkeypatch.setattr(masks, "EVAL_BYTES", 10 << 10)  # the [2, 1, 64, 64] mask's subgraph holds about 11.5 KiB
    monkeypatch.setattr(masks, "_VERDICTS", {})
    torch.manual_seed(0)
    model = _Attn(make)
    x, y = torch.randint(1, 64, (2, 64)), torch.randint(0, 64, (2, 64))
    before = capture_graph(model, (x, y), _ce)
    after = capture_graph(model, (x, y), _ce)
    lines = causal_masks(after, model)
    assert len(lines) == 1 and says in lines[0], lines
    losses = [torch.fx.Interpreter(gm).run(x, y) for gm in (before, after)]
    losses = [v[0] if isinstance(v, (tuple, list)) else v for v in losses]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("offset,says", [
    (False, "KiB whole, so one batch row evaluated"),
    # rows that read different values: not provably alike, so every row evaluated (each is causal)
    (True, "is the causal mask ([2, 1, 64, 64] bool): is_causal=True"),
])
def test_a_mask_within_the_limit_is_evaluated_one_row_where_the_rows_are_alike(monkeypatch, offset, says):
    """Under EVAL_BYTES too, a mask whose rows are provably the same computation is evaluated one
    row (Llama-3-8B's [8, 1, 2048, 2048]: 0.03 s against 0.1-0.2 s whole); where they are not, whole."""
    from autopar.passes import masks

    monkeypatch.setattr(masks, "_VERDICTS", {})
    model = _Attn(lambda t, s: _rows(t, s, offset=offset))
    x, y = torch.randint(1, 64, (2, 64)), torch.randint(0, 64, (2, 64))
    gm = capture_graph(model, (x, y), _ce)
    lines = causal_masks(gm, model)
    assert len(lines) == 1 and says in lines[0] and "is_causal=True" in lines[0], lines


def test_a_mask_from_a_buffer_is_not_taken_for_a_constant():
    """A buffer may change between steps (the user's, or a running statistic): a mask read from
    one stays, even when it holds the causal mask now."""

    class Buffered(_Attn):
        def __init__(self):
            super().__init__(lambda t, s: self.tri[:s, :s])
            self.register_buffer("tri", torch.ones(16, 16, dtype=torch.bool).tril(), persistent=False)

    model = Buffered()
    x, y = torch.randint(1, 64, (2, 12)), torch.randint(0, 64, (2, 12))
    gm = capture_graph(model, (x, y), _ce)
    lines = causal_masks(gm, model)
    assert "depends on an input, parameter or buffer" in lines[0] and "kept" in lines[0]


def test_is_causal_mask():
    s = 6
    tri = torch.ones(s, s, dtype=torch.bool).tril()
    assert is_causal_mask(tri, s, s) and is_causal_mask(tri[None, None].expand(3, 2, s, s), s, s)
    additive = torch.zeros(s, s).masked_fill(~tri, torch.finfo(torch.float32).min)
    assert is_causal_mask(additive, s, s) and is_causal_mask(additive.masked_fill(~tri, float("-inf")), s, s)
    assert not is_causal_mask(tri, s, s + 1)  # not square: SDPA's causal is top-left aligned
    batch = tri[None].repeat(2, 1, 1)
    batch[1, 3, 3] = False  # one row of one batch entry differs
    assert not is_causal_mask(batch, s, s)
    assert not is_causal_mask(additive.masked_fill(~tri, -1e4), s, s)  # a finite penalty is not a mask
    assert not is_causal_mask(tri.long(), s, s)


def test_hugging_face_mask_is_rewritten_and_the_program_matches_eager():
    """HF Llama (SDPA attention): traced, its masking utilities build a [batch, 1, seq, seq] mask
    that eager PyTorch never builds; the pass makes the program's attention causal again. The
    compiled program on one rank matches one eager process, and so does the one compiled without
    the pass."""
    import autopar
    from autopar.testing import build_model, parity_optimizer

    from test_kernels import _one_rank

    model, batches, loss_fn = build_model("hf_llama")
    gm = capture_graph(model, batches[0], loss_fn)
    lines = causal_masks(gm, model)
    assert len(lines) == 1 and lines[0].startswith("2 attention(s)") and "is_causal=True" in lines[0], lines
    assert all(n.kwargs.get("is_causal") is True for n in _sdpa_nodes(gm))
    assert not [n for n in gm.graph.nodes if "masking_utils" in (n.meta.get("stack_trace") or "")], \
        "the mask's nodes left the graph"

    ref = build_model("hf_llama")[0]
    ref_opt = parity_optimizer(ref.parameters(), 1e-2)
    runs = {}
    with _one_rank() as mesh:
        for skip in ((), ("masks",)):
            m = build_model("hf_llama")[0]
            pm = autopar.compile(m, mesh, example_inputs=batches[0], loss_fn=loss_fn, plan={"dp": "ddp"},
                                 capture_eval=False, skip_passes=skip)
            opt = parity_optimizer(pm.parameters(), 1e-2)
            losses = []
            for x, y in batches:
                losses.append(float(pm.train_step(x, y)))
                opt.step()
                opt.zero_grad()
            runs[skip] = (losses, pm.report())
    ref_losses = []
    for x, y in batches:
        loss = loss_fn(ref(x).logits, y)
        loss.backward()
        ref_losses.append(float(loss))
        ref_opt.step()
        ref_opt.zero_grad()
    for skip, (losses, report) in runs.items():
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-5, atol=2e-5)
    assert "attention masks: 2 attention(s)" in runs[()][1]
    assert "2 KV heads read as they are (enable_gqa=True), not repeated to 4" in runs[()][1]
    assert "attention masks" not in runs[("masks",)][1]


def test_grouped_query_attention_reads_the_kv_heads_where_the_plan_allows():
    """After the causal rewrite, HF Llama's attention (4 query heads, 2 KV heads repeated by
    repeat_kv) reads the 2 KV heads with enable_gqa=True and the repeat's nodes go, unless the
    plan splits the heads over more ranks than there are KV heads (or user rules decide); the
    program then saves K and V at their own size: the predicted peak falls by what the repeated
    copies held, and the step matches one eager process (the test above)."""
    from autopar.passes.masks import grouped_attention
    from autopar.testing import build_model

    model, batches, loss_fn = build_model("hf_llama")
    for heads_split, said in ((1, "2 KV heads read as they are"), (2, "2 KV heads read as they are"),
                              (4, "the plan splits the heads over 4 ranks, more than divide its 2 KV heads"),
                              (None, "user rules")):
        gm = capture_graph(model, batches[0], loss_fn)
        causal_masks(gm, model)
        lines = grouped_attention(gm, heads_split)
        assert len(lines) == 1 and lines[0].startswith("2 attention(s)") and said in lines[0], lines
        rewritten = heads_split in (1, 2)
        for n in _sdpa_nodes(gm):
            k = n.args[1]
            assert (n.kwargs.get("enable_gqa") is True) == rewritten
            assert k.meta["example_value"].shape[1] == (2 if rewritten else 4)
        expands = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "expand"]
        repeats = expands + [u for n in expands for u in n.users] + [
            n for n in gm.graph.nodes if n.op == "call_function" and n.target is operator.getitem
            and isinstance(n.args[1], tuple) and len(n.args[1]) == 5 and n.args[1][2] is None]
        assert len(repeats) == (0 if rewritten else 12), repeats  # (repeat_kv: getitem, expand, reshape)


def test_the_kv_heads_as_they_are_lower_the_peak():
    import autopar
    from autopar.analysis.cost import predict_memory
    from autopar.testing import build_model

    from test_kernels import _one_rank

    peaks = {}
    with _one_rank() as mesh:
        for skip in ((), ("masks",)):
            model, batches, loss_fn = build_model("hf_llama")
            pm = autopar.compile(model, mesh, example_inputs=batches[0], loss_fn=loss_fn, plan={"dp": "ddp"},
                                 capture_eval=False, skip_passes=skip)
            peaks[skip] = predict_memory(pm)["max_activations"]
    # batch 4, seq 16, fp32, 2 layers: K and V saved as [4, 2, 16, 16] instead of [4, 4, 16, 16]
    saved = 2 * 2 * 4 * (4 - 2) * 16 * 16 * 4
    assert peaks[("masks",)] - peaks[()] >= saved, (peaks, saved)
