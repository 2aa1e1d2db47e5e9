"""The auto plan's report (operator groups, table, why, DOT and SVG) on a hand-built plan:
a Megatron MLP block (column then row) on a 1-D mesh of 2, whose row-parallel output is
all-reduced into the loss."""

import re
import xml.etree.ElementTree as ElementTree

from plait.parallel.auto.device_mesh import AutoMesh
from plait.parallel.auto.opgraph import OpGraph, OpNode, ParamMeta
from plait.plan.auto.auto_plan import AutoPlan, Baseline, EdgeReshard, MeshOutcome, operator_groups, PlanCost, \
    RunnerUp
from plait.plan.auto.report import collapse_repeats, layout_colours, node_rows, plan_dot, plan_svg, plan_table, \
    report_lines
from plait.plan.auto.strategy import Strategy

SVG = "{http://www.w3.org/2000/svg}"


def mlp_block_plan() -> AutoPlan:
    """x (8, 16) -> c_fc (column) -> gelu -> c_proj (row, P) -> all-reduce -> mse loss."""
    fc_w, proj_w = "h.0.mlp.c_fc.weight", "h.0.mlp.c_proj.weight"
    nodes = (OpNode("x", "input", "input", (), (), (8, 16), "float64", 8, module=""),
             OpNode("fc", "linear", "aten.linear.default", ("x",), (fc_w,), (8, 32), "float64", 8,
                    module="h.0.mlp.c_fc"),
             OpNode("act", "elementwise", "aten.gelu.default", ("fc",), (), (8, 32), "float64", 8,
                    module="h.0.mlp.act", members=("act", "dropout")),
             OpNode("proj", "linear", "aten.linear.default", ("act",), (proj_w,), (8, 16), "float64", 8,
                    module="h.0.mlp.c_proj"),
             OpNode("loss", "loss", "aten.mse_loss.default", ("proj",), (), (), "float64", 8, module=""),
             OpNode("output", "output", "output", ("loss",), (), (), "float64", 8, module=""))
    graph = OpGraph(nodes=nodes, params=(ParamMeta(fc_w, (32, 16), "float64", 8),
                                         ParamMeta(proj_w, (16, 32), "float64", 8)), inputs=("x",), output="output")
    choice = {"x": Strategy("replicated", ("R",), (), (), 0.0, 0.0, 0.0),
              "fc": Strategy("column@0", ("S1",), (("R",),), ((fc_w, ("S0",)),), 3e-6, 1e-6, 2048.0),
              "act": Strategy("S1", ("S1",), (("S1",),), (), 1e-6, 0.0, 1024.0),
              "proj": Strategy("row@0", ("P",), (("S1",),), ((proj_w, ("S1",)),), 3e-6, 0.0, 2048.0),
              "loss": Strategy("replicated", ("R",), (("R",),), (), 1e-6, 0.0, 1024.0),
              "output": Strategy("replicated", ("R",), (("R",),), (), 0.0, 0.0, 0.0)}
    edges = (EdgeReshard("x", "fc", 0, 0.0, ()), EdgeReshard("fc", "act", 0, 0.0, ()),
             EdgeReshard("act", "proj", 0, 0.0, ()), EdgeReshard("proj", "loss", 0, 5e-6, ("all_reduce@0",)),
             EdgeReshard("loss", "output", 0, 0.0, ()))
    cost = PlanCost(compute_s=8e-6, comm_s=1e-6, reshard_s=5e-6, memory_bytes=6144.0)
    return AutoPlan(graph=graph, mesh=AutoMesh((2,)), choice=choice, layouts={}, cost=cost, solve_s=0.01, gap=0.0,
                    status="Optimal", meshes=(MeshOutcome((2,), cost, 0.01, 0.0, "Optimal"),),
                    baselines=(Baseline("all replicated", "every operator unsharded", (2,),
                                        PlanCost(16e-6, 0.0, 0.0, 12288.0)),),
                    runner_ups=(RunnerUp("h.0.mlp", "fc", "column@0", "batch@0", 2e-6, "re-solved"),),
                    edges=edges, cluster_description="a test cluster", memory_limit_bytes=1e6,
                    model_description="a hand-built MLP block")


def test_operator_groups_put_a_blocks_leaf_modules_under_the_block():
    plan = mlp_block_plan()
    assert operator_groups(plan.graph) == [("(model)", ("x",)), ("h.0.mlp", ("fc", "act", "proj")),
                                           ("(model)", ("loss", "output"))]


def test_the_table_names_each_groups_choice_and_sums_its_costs():
    plan = mlp_block_plan()
    table = plan_table(plan)
    rows = {cells[0]: cells for cells in (re.split(r"\s{2,}", line) for line in table[2:])}
    # compute 3 + 1 + 3 us, comm 1 us, no reshard into the block, memory 2048 + 1024 + 2048 B
    assert rows["h.0.mlp"] == ["h.0.mlp", "c_fc column@0, c_proj row@0", "P", "7 us", "1 us", "0 us", "5 KiB"]
    assert table[-1].split("  ")[0] == "(model)" and re.split(r"\s{2,}", table[-1])[1:] == [
        "loss replicated", "R", "1 us", "0 us", "5 us", "1 KiB"]  # the all-reduce into the loss
    lines = report_lines(plan)
    text = "\n".join(lines)
    assert "predicted step 14 us per device: compute 8 us, collectives 1 us, reshards 5 us" in text
    assert "all replicated" in text and "(1.14x)" in text  # 16 us / 14 us
    assert "h.0.mlp: c_fc column@0; next batch@0 +2 us (re-solved)" in text


def test_svg_colours_nodes_by_output_layout_and_labels_the_reshard():
    plan = mlp_block_plan()
    root = ElementTree.fromstring(plan_svg(plan))  # well-formed XML
    colours = layout_colours(plan)
    assert list(colours) == ["R", "S1", "P"]
    boxes = {group.find(f"{SVG}text").text: group.find(f"{SVG}rect").get("fill") for group in root.iter(f"{SVG}g")}
    assert boxes == {"x": colours["R"], "fc": colours["S1"], "act": colours["S1"], "proj": colours["P"],
                     "loss": colours["R"], "output": colours["R"]}
    labels = [text.text for text in root.iter(f"{SVG}text") if text.get("fill") == "#cb181d"]
    assert labels == ["all_reduce@0"]
    assert node_rows(plan) == {"x": (0, 0), "fc": (1, 0), "act": (2, 0), "proj": (3, 0), "loss": (4, 0),
                               "output": (5, 0)}


def test_dot_has_every_node_and_the_labelled_reshard_edge():
    dot = plan_dot(mlp_block_plan())
    assert dot.startswith("digraph auto_plan {") and dot.rstrip().endswith("}")
    assert dot.count("[label=") == 6
    assert '"proj" -> "loss" [color="#cb181d", fontcolor="#cb181d", label="all_reduce@0"];' in dot
    assert '"x" -> "fc";' in dot


def test_repeated_blocks_are_shown_once_with_their_range():
    """12 blocks of (ln, attn, mlp) rows equal up to numbers collapse into 3 rows; a row that
    differs in a cost (the last mlp) ends the run there."""
    def block(index, mlp_compute="3 us"):
        return [(f"h.{index}", f"ln_{index} S0@0", "S0", "1 us", "0 us", "0 us", "1 KiB"),
                (f"h.{index}.attn", f"sdpa_{index} heads@0", "P", "2 us", "1 us", "0 us", "2 KiB"),
                (f"h.{index}.mlp", "c_fc column@0, c_proj row@0", "P", mlp_compute, "1 us", "1 us", "3 KiB")]
    head, tail = ("(model)", "x batch@0", "S0", "0 us", "0 us", "0 us", "0 B"), ("lm", "head", "R", "", "", "", "")
    rows = [head] + [row for index in range(11) for row in block(index)] + block(11, mlp_compute="4 us") + [tail]
    assert collapse_repeats(rows) == [
        head,
        ("h.{0..10} (x11)", "ln_0 S0@0", "S0", "1 us", "0 us", "0 us", "1 KiB"),
        ("h.{0..10}.attn (x11)", "sdpa_0 heads@0", "P", "2 us", "1 us", "0 us", "2 KiB"),
        ("h.{0..10}.mlp (x11)", "c_fc column@0, c_proj row@0", "P", "3 us", "1 us", "1 us", "3 KiB"),
        *block(11, mlp_compute="4 us"), tail]


def test_rows_differing_in_a_strategys_axis_are_not_collapsed():
    rows = [(f"h.{index}.mlp", f"c_fc_{index} column@{index % 2}", "S1", "1 us", "0 us", "0 us", "1 KiB")
            for index in range(4)]
    assert collapse_repeats(rows) == [("h.{0..2..2}.mlp (x2)", "c_fc_0 column@0", "S1", "1 us", "0 us", "0 us", "1 KiB"),
                                      ("h.{1..3..2}.mlp (x2)", "c_fc_1 column@1", "S1", "1 us", "0 us", "0 us", "1 KiB")]
