"""kimi_papers.evaluation.sage as a library: the data engine (graph, unambiguous questions), trace round trips, the
node-as-proxy rewards on hand-computed cases, the batched kernel against the scalar loop, and the experiment's pieces."""
import re

import numpy as np
import pytest
import torch

from kimi_papers.evaluation.sage import (
    CHAR_COLOUR, CHAR_LABEL, Scene, SceneWorld, Trace, build_scene_graph, cell_box, check_image, compact_trace,
    diameter, expand_compact, iou, majority_rule, match_nodes, named_colour_rule, node_grounded_reward,
    node_relevance_reward, node_reward_batch, node_reward_loop, pack_traces, parse_trace, qbox, render_trace, resolve,
    sample_question, serialise, set_f1, total_reward)


def hand_graph():
    """Red cube (0,0); blue table (1,0) with green top and cyan legs; red sphere behind the table (1,1)."""
    sc = Scene([dict(label="cube", colour="red", large=True, x=0, d=0, z=0.1, parts=[]),
                dict(label="table", colour="blue", large=False, x=1, d=0, z=0.2,
                     parts=[dict(label="top", colour="green"), dict(label="legs", colour="cyan")]),
                dict(label="sphere", colour="red", large=False, x=1, d=1, z=0.5, parts=[])],
               np.zeros((64, 64, 3), np.uint8))
    return build_scene_graph(sc)


def test_graph_edges_and_serialisation():
    g = hand_graph()
    assert [n["label"] for n in g.nodes] == ["cube", "table", "top", "legs", "sphere"]
    assert g.edges[(0, ">")] == 1 and g.edges[(1, "<")] == 0 and g.edges[(1, "^")] == 4 and g.edges[(4, "v")] == 1
    assert g.edges[(1, ".o")] == 2 and g.edges[(1, ".g")] == 3 and g.edges[(2, "~")] == 1
    assert (0, "^") not in g.edges and (0, "<") not in g.edges
    assert serialise(g) == "AqrBtuBoeBgcFsr"
    assert diameter(g) == 2
    assert (2, "above", 3) in g.relations


def test_questions_are_unambiguous_and_gold_path_answers():
    rng = np.random.default_rng(0)
    w, n = SceneWorld(seed=4), 0
    for _ in range(120):
        g = build_scene_graph(w.sample())
        for h in (1, 2, 3):
            try:
                q, a, path = sample_question(g, h, rng)
            except ValueError:
                continue
            rels = re.findall(r"\.[a-z]|[<>^v~]", q[3:])
            sets = resolve(g, (CHAR_COLOUR[q[1]], CHAR_LABEL[q[2]]), rels)
            assert all(len(s) == 1 for s in sets) and [next(iter(s)) for s in sets] == path
            assert a == g.nodes[path[-1]]["colour"] and len(set(path)) == h + 1
            n += 1
    assert n > 200


def test_ambiguous_anchor_rejected_and_hops_checked():
    sc = Scene([dict(label="cube", colour="red", large=True, x=0, d=0, z=0.1, parts=[]),
                dict(label="cube", colour="red", large=True, x=1, d=0, z=0.1, parts=[])], np.zeros((64, 64, 3), np.uint8))
    g = build_scene_graph(sc)
    with pytest.raises(ValueError, match="no unambiguous"):
        sample_question(g, 1, np.random.default_rng(0))        # both anchors are "the red cube"
    with pytest.raises(ValueError, match="diameter"):
        sample_question(hand_graph(), 3, np.random.default_rng(0))
    with pytest.raises(ValueError, match="image"):
        check_image(np.zeros((32, 32, 3), np.uint8))


def test_trace_round_trip_and_malformed():
    g = hand_graph()
    c = compact_trace([0, 1, 4], "?rq>^", g)
    assert c == "|Aqr>Btu^Fsr=r"
    t = expand_compact(c, g)
    assert parse_trace(render_trace([0, 1, 4], g)) == t
    assert t.rels == ["right_of", "behind"] and t.answer == "red"
    for bad in ("", None, "<graph> </graph>", render_trace([0, 1], g).replace("right_of", "up")):
        assert parse_trace(bad) is None
    assert expand_compact("=r", g) is None and expand_compact("|Aqr>Btu", g) is None
    assert qbox((0.5, 3.9, 4.1, 8.0)) == (0, 0, 2, 2)


def test_rewards_hand_computed():
    g = hand_graph()
    gold = ("red", [0, 1, 4])
    t = expand_compact("|Aqr>Btu^Fsr=r", g)
    assert total_reward(t, "red", g, gold) == dict(r_acc=1.0, r_fmt=1.0, r_gnd=1.0, r_rel=1.0, total=2.0)
    # a wrong answer keeps the node rewards; weights apply as r_acc + alpha r_gnd + beta r_rel
    assert total_reward(t, "blue", g, gold, alpha=0.3, beta=0.1)["total"] == pytest.approx(0.4)
    # one irrelevant extra node: precision 3/4, recall 1 -> F1 6/7
    assert node_relevance_reward(expand_compact("|Aqr>Btu.Boe^Fsr=r", g), g, [0, 1, 4]) == pytest.approx(6 / 7)
    # a skipped hop: precision 1, recall 2/3 -> F1 0.8
    assert node_relevance_reward(expand_compact("|Aqr^Fsr=r", g), g, [0, 1, 4]) == pytest.approx(0.8)
    # a repeat scores 0 in r_gnd and counts once in r_rel
    t_dup = expand_compact("|Aqr>Aqr>Btu=u", g)
    assert node_grounded_reward(t_dup, g) == pytest.approx(2 / 3)
    assert node_relevance_reward(t_dup, g, [0, 1, 4]) == pytest.approx(0.8)
    # unparseable: no node reward; empty: 0
    assert total_reward(None, "red", g, gold)["total"] == 1.0
    assert node_grounded_reward(Trace([], [], "red"), g) == 0.0 and set_f1(set(), set()) == 0.0
    # IoU by hand, degenerate boxes 0
    assert iou((0, 0, 2, 2), (1, 1, 3, 3)) == pytest.approx(1 / 7) and iou((1, 1, 1, 5), (1, 1, 1, 5)) == 0.0
    assert iou((0, 0, 4, 2), (0, 0, 2, 2)) == pytest.approx(0.5)


def test_partial_grounding_uses_iou_of_matched_node():
    g = hand_graph()
    t = expand_compact("|Asr=r", g)           # a sphere cited in the cube's cell: matched to the real sphere, partial IoU
    want = iou(qbox(cell_box(0, 0, "sphere", True)), qbox(g.nodes[4]["box"]))
    assert node_grounded_reward(t, g) == pytest.approx(want)


def test_hungarian_is_one_to_one():
    sc = Scene([dict(label="cube", colour="red", large=True, x=0, d=0, z=0.1, parts=[]),
                dict(label="cube", colour="blue", large=True, x=1, d=0, z=0.1, parts=[])], np.zeros((64, 64, 3), np.uint8))
    g = build_scene_graph(sc)
    b0, b1 = qbox(g.nodes[0]["box"]), qbox(g.nodes[1]["box"])
    shifted = (b0[0] + 1, b0[1], b0[2] + 1, b0[3])
    assign, ious = match_nodes(Trace([("cube", b0, 1), ("cube", shifted, 1)], ["near"], "red"), g)
    assert assign == [0, 1] and ious == [1.0, pytest.approx(iou(shifted, b1))]


def test_kernel_matches_loop():
    g = torch.Generator().manual_seed(3)
    R, V, N = 120, 4, 7
    lo = torch.randint(0, 12, (R, V + N, 2), generator=g).float()
    wh = torch.randint(0, 5, (R, V + N, 2), generator=g).float()
    bx = torch.cat([lo, (lo + wh).clamp(max=16)], -1)
    cl, sl = torch.randint(0, 3, (R, V), generator=g), torch.randint(0, 3, (R, N), generator=g)
    cm = torch.arange(V)[None] < torch.randint(0, V + 1, (R, 1), generator=g)
    sm = torch.arange(N)[None] < torch.randint(1, N + 1, (R, 1), generator=g)
    gold = (torch.rand(R, N, generator=g) < 0.3) & sm
    args = (bx[:, :V], cl, cm, bx[:, V:], sl, sm, gold)
    a_g, a_r = node_reward_batch(*args)
    b_g, b_r = node_reward_loop(*args)
    assert torch.allclose(a_g, b_g, atol=1e-6) and torch.allclose(a_r, b_r, atol=1e-6)


def test_kernel_matches_scalar_rewards_on_traces():
    g = hand_graph()
    trs = [expand_compact(x, g) for x in ("|Aqr>Btu^Fsr=r", "|Aqr^Fsr=r", "|Asr=r", "junk")]
    packed = pack_traces(trs, [g] * 4, [[0, 1, 4]] * 4)
    bg, br = node_reward_batch(*packed)
    assert bg.tolist() == pytest.approx([node_grounded_reward(t, g) for t in trs])
    assert br.tolist() == pytest.approx([node_relevance_reward(t, g, [0, 1, 4]) for t in trs])


def test_rules():
    assert majority_rule([("a", "red", 1), ("b", "blue", 1), ("c", "blue", 1)]) == {1: "blue"}
    assert named_colour_rule("?uq<") == "blue"
    with pytest.raises(ValueError, match="question"):
        named_colour_rule("x")


def test_experiment_pieces():
    from kimi_papers.evaluation.sage_experiment import (as_direct, make_problems, scene_reward_fn, score, summarise)
    pr = make_problems(40, world_seed=2)
    assert make_problems(3, world_seed=2) == pr[:3]
    rf = scene_reward_fn("sage")
    assert rf(pr[:2], [p.solution for p in pr[:2]]) == [2.0, 2.0]
    assert scene_reward_fn("acc")(pr[:1], ["=" + as_direct(pr[:1])[0].solution[1:]]) == [1.0]
    s = summarise(score(pr, [p.solution for p in pr]))
    assert s["acc"] == 1.0 and s["precision"] == 1.0 and s["recall"] == 1.0
    wrong = summarise(score(pr, ["=" for _ in pr]))
    assert wrong["acc"] == 0.0 and wrong["visited"] == 0.0
