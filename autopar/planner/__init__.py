"""``plan="auto"``: choose the mesh, the strategy per axis, the pipeline and recomputation.

The search costs a candidate from what the compiler and the cost model say about ONE transformer
block, not from a compile of the whole model per candidate:

1. **Block coefficients, compiled.** For every choice of the block's own axes (tp size and
   strategy: megatron or sequence; cp size and strategy: ulysses or context; ep size) and
   recompute choice (none / selective / full), the
   model is compiled at depth 1 and depth 2 (its repeated block list cut to that many blocks in a
   copy on the meta device, ``autopar.depth``: any model with such a list, no config read) on a
   fake ep x cp x tp mesh; the cost model runs on
   each per-rank program. The difference of the two is one block (its parameters, its saved
   activations by category at the program's peak, its forward and backward time with its own
   tensor-parallel collectives as the simulator overlaps them); depth 1 minus one block is the
   rest (embeddings, final norm, head, loss). A third depth checks that the blocks really are
   identical: depth 3 minus depth 2 must equal depth 2 minus depth 1 (``Coefficients.linear``;
   compiled beside the other block choices). Where depth 1 alone is off the line (depth 4 -
   depth 3 equals depth 3 - depth 2: its one block is the first and the last at once), every
   block choice is taken from depths 2 and 3 (``blocks.from_depth_two``) and a note says so;
   otherwise the search refuses the model rather than extrapolating.
2. **Composition, analytic.** A candidate is ``dp x ep x cp x tp x pp`` with a data-parallel strategy
   (ddp, zero1, zero2, fsdp), a pipeline schedule (1f1b, interleaved with 2 virtual stages) and
   a micro-batch count. Its memory is the block figures times the blocks a rank holds and keeps
   in flight (the schedule's simulated peak of live micro-batches), sharded as the strategy
   shards them; its time is the pipeline schedule simulated with per-stage block costs
   (``analysis.schedules.simulate``), plus point-to-point hops, plus the data-parallel traffic
   (ring formulas, alpha-beta on the link the axis lands on) minus what overlaps with compute,
   plus the optimizer step. Axes are placed as ``(pp, dp, ep, cp, tp)``: tp varies fastest (inside a
   node), pp slowest (across nodes). The block's cp / ep traffic (attention's all-to-alls or ring
   shifts, routed tokens: per micro-batch; the gradients replicated on cp / ep: once per step) and
   its time come with the block's figures; ep splits the batch as dp does.
3. **Confirmation** (``confirm``): the best screened candidates are compiled for real at one
   and two blocks per (virtual) stage and their figures carried to the model's depth. A
   pipeline's stages hold equal, named blocks in those compiles; each stage's figures
   (``pipeline_cost.StageCosts``) are carried along their own line to the blocks the whole model's split
   gives that stage (balanced by the device's costs: a stage with the head holds fewer) and
   composed as the cost model composes a compiled pipeline (``pipeline_cost.compose_pipeline``). The
   chosen plan names those split points, so its command compiles to the confirmed figures
   (Llama-3-8B and -70B: equal to the whole-model compile; tests/test_planner.py).
4. **Check against a real compile** (``verify``): the chosen plan is compiled for real (fake
   process group, full mesh, rank 0) at a reduced depth, and the composition at that depth is
   compared with the cost model's figures for the compiled program. The ratios are printed.

What the composition assumes (each is checked by ``verify`` / tests/test_planner.py on small
meshes, not assumed silently): ZeRO/FSDP gradient traffic hides under the backward of the last
micro-batch except the last block's share; FSDP gathers one block ahead (two blocks' compute-dtype
parameters alive) and hides each gather under the previous block's compute; the rest's time sits
on the last pipeline stage and its parameters split between first (embeddings) and last stage.
"""

from __future__ import annotations

from autopar.planner.blocks import (DP_STRATEGIES, RECOMPUTE, SCHEDULES, TP_STRATEGIES, Coefficients, Figures,
                                     ModelInfo, block_coefficients, figures_of, info_of, model_info)
from autopar.planner.compose import AXES, CP_STRATEGIES, Candidate, candidates, cost, model_flops_per_step
from autopar.planner.report import command_line, report, result_json
from autopar.planner.search import SearchResult, compiled, confirm, same_programs, search, verify

__all__ = ["AXES", "CP_STRATEGIES", "DP_STRATEGIES", "RECOMPUTE", "SCHEDULES", "TP_STRATEGIES", "Candidate", "Coefficients", "Figures",
           "ModelInfo", "SearchResult", "block_coefficients", "candidates", "command_line", "compiled", "confirm",
           "cost", "figures_of", "info_of", "model_flops_per_step", "model_info", "report", "result_json", "same_programs", "search",
           "verify"]
