"""miles/parallel/layout.py: Megatron's rank order and pipeline stages, and the refusals naming the flags."""

from collections import defaultdict

import pytest

from miles.parallel.layout import (EP_FLAG, ETP_FLAG, FIRST_STAGE_FLAG, LAST_STAGE_FLAG, PP_FLAG, SP_FLAG, TP_FLAG,
                                   LayoutError, ParallelLayout, check_layout, rank_coordinates, stage_layer_counts,
                                   stage_layers)


def groups(layout, varying):
    """The rank groups in which only the coordinates ``varying`` change (Megatron's process groups)."""
    fixed = defaultdict(list)
    for c in rank_coordinates(layout):
        key = tuple(getattr(c, f) for f in ("tp", "pp", "dp", "ep", "etp", "edp") if f not in varying)
        fixed[key].append(c.rank)
    return sorted(fixed.values())


def test_the_documented_16_gpu_example_of_initialize_model_parallel():
    # megatron-core parallel_state.initialize_model_parallel's docstring: 16 GPUs, TP2, PP4 -> DP2
    layout = ParallelLayout(world=16, tp=2, pp=4)
    assert groups(layout, {"tp", "etp", "ep", "edp"}) == [[2 * i, 2 * i + 1] for i in range(8)]
    dp = groups(layout, {"dp", "etp", "ep", "edp"})
    assert dp == sorted([[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]])
    pp = groups(layout, {"pp"})
    assert pp == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


def test_rank_order_is_tp_then_dp_then_pp_and_experts_etp_then_ep_then_edp():
    layout = ParallelLayout(world=32, tp=2, pp=2, ep=4, etp=2)  # DP 8, EDP 2
    for c in rank_coordinates(layout):
        assert c.rank == c.tp + 2 * (c.dp + 8 * c.pp)
        assert c.rank == c.etp + 2 * (c.ep + 4 * (c.edp + 2 * c.pp))
    # every (pp, ep, etp) holds EDP ranks; each expert-parallel group lies within one stage
    for group in groups(layout, {"ep", "tp", "dp"}):
        assert len({r // 16 for r in group}) == 1


def test_the_glm5_layout_tp8_pp4_ep8_etp1():
    layout = ParallelLayout(world=32, tp=8, pp=4, ep=8, etp=1, first_stage_layers=22, last_stage_layers=18)
    coords = rank_coordinates(layout)
    assert (layout.dp, layout.edp) == (1, 1)
    assert [c.pp for c in coords] == [r // 8 for r in range(32)]
    assert all(c.ep == c.tp and c.etp == 0 for c in coords)  # with ETP1 and EP = TP, the expert rank is the TP rank
    assert layout.describe() == "TP8 x PP4 x DP1, EP8 x ETP1 x EDP1"


def test_stage_ranges_of_glm5s_78_layers_at_pp4():
    uneven = ParallelLayout(world=4, pp=4, first_stage_layers=22, last_stage_layers=18)
    assert stage_layers(78, uneven) == (range(0, 22), range(22, 41), range(41, 60), range(60, 78))
    assert stage_layer_counts(78, ParallelLayout(world=4, pp=4, first_stage_layers=21)) == (21, 19, 19, 19)
    assert stage_layer_counts(78, ParallelLayout(world=4, pp=4, last_stage_layers=18)) == (20, 20, 20, 18)
    assert stage_layer_counts(80, ParallelLayout(world=4, pp=4)) == (20, 20, 20, 20)
    assert stage_layer_counts(7, ParallelLayout(world=2, pp=2, first_stage_layers=4)) == (4, 3)


def test_an_uneven_split_without_the_flags_is_refused_with_flags_that_work():
    with pytest.raises(LayoutError) as e:
        stage_layers(78, ParallelLayout(world=4, pp=4))
    assert PP_FLAG in str(e.value) and "78" in str(e.value)
    assert f"{FIRST_STAGE_FLAG} 20 {LAST_STAGE_FLAG} 20" in e.value.fix
    assert stage_layer_counts(78, ParallelLayout(world=4, pp=4, first_stage_layers=20, last_stage_layers=20))


@pytest.mark.parametrize("first,last,flag", [(22, 19, LAST_STAGE_FLAG), (80, None, FIRST_STAGE_FLAG),
                                             (39, 39, FIRST_STAGE_FLAG)])
def test_stage_counts_that_leave_no_even_rest_are_refused(first, last, flag):
    with pytest.raises(LayoutError) as e:
        stage_layers(78, ParallelLayout(world=4, pp=4, first_stage_layers=first, last_stage_layers=last))
    assert flag in e.value.flags and "78" in str(e.value)


@pytest.mark.parametrize("layout,model,flag,words", [
    (ParallelLayout(world=6, tp=4), {}, TP_FLAG, "not a multiple of"),
    (ParallelLayout(world=8, tp=2, pp=2, ep=4, etp=2), {}, EP_FLAG, "does not divide the 4 ranks"),
    (ParallelLayout(world=2, tp=2), {"num_attention_heads": 9}, TP_FLAG, "9 attention heads"),
    (ParallelLayout(world=4, tp=4), {"num_attention_heads": 8, "num_query_groups": 2}, TP_FLAG, "2 query groups"),
    (ParallelLayout(world=4, ep=4), {"num_experts": 6}, EP_FLAG, "6 experts"),
    (ParallelLayout(world=4, tp=4), {"linear_key_heads": 2, "linear_value_heads": 8}, TP_FLAG,
     "2 Gated DeltaNet key heads"),
    (ParallelLayout(world=4, tp=4), {"linear_key_heads": 4, "linear_value_heads": 6}, TP_FLAG,
     "6 Gated DeltaNet value heads"),
    (ParallelLayout(world=2, first_stage_layers=3), {}, FIRST_STAGE_FLAG, "needs pipeline parallelism"),
])
def test_impossible_layouts_name_the_flag_and_the_value(layout, model, flag, words):
    with pytest.raises(LayoutError) as e:
        check_layout(layout, **model)
    assert flag in e.value.flags and flag in str(e.value) and words in str(e.value) and e.value.fix


def test_sequence_parallel_needs_tp():
    with pytest.raises(LayoutError) as e:
        check_layout(ParallelLayout(world=2), sequence_parallel=True)
    assert SP_FLAG in e.value.flags
    check_layout(ParallelLayout(world=2, tp=2), sequence_parallel=True, num_attention_heads=4, num_query_groups=2)


def test_moe_layers_under_tp_need_sequence_parallelism():
    with pytest.raises(LayoutError) as e:
        check_layout(ParallelLayout(world=4, tp=2, ep=2), num_experts=8)
    assert e.value.flags == (TP_FLAG, SP_FLAG) and "8 experts" in str(e.value) and SP_FLAG in e.value.fix
    check_layout(ParallelLayout(world=4, tp=2, ep=2), num_experts=8, sequence_parallel=True)
    check_layout(ParallelLayout(world=4, tp=2), num_experts=0)  # a dense model: no MoE layer
    check_layout(ParallelLayout(world=4, ep=4), num_experts=8)  # TP 1
    check_layout(ParallelLayout(world=4, tp=2, ep=2), num_experts=8, sequence_parallel=None)  # not known: miles plan


def test_etp_within_the_stage_is_accepted():
    check_layout(ParallelLayout(world=8, tp=2, pp=2, ep=2, etp=1), num_experts=4, num_layers=4, sequence_parallel=True)
    assert ETP_FLAG  # the flag names exist for the messages


def test_samples_split_over_data_parallelism_and_a_replicas_ranks_share_theirs():
    from miles.parallel.layout import rank_slices

    assert rank_slices(10, ParallelLayout(world=3)) == [slice(0, 4), slice(4, 7), slice(7, 10)]  # DP only: as before
    tp2_dp2 = rank_slices(8, ParallelLayout(world=4, tp=2))
    assert tp2_dp2 == [slice(0, 4), slice(0, 4), slice(4, 8), slice(4, 8)]  # ranks 0,1 = replica 0
    pp2 = rank_slices(6, ParallelLayout(world=4, pp=2))  # DP2: ranks 0,1 stage 0, ranks 2,3 stage 1
    assert pp2 == [slice(0, 3), slice(3, 6), slice(0, 3), slice(3, 6)]


def test_every_pipeline_stage_starts_on_a_layer_that_computes_its_sparse_attention_indices():
    computes = [True, True, False, True, False, True, False, True]  # GLM-5's pattern: full, full, shared, full, ...
    with pytest.raises(LayoutError) as e:  # 4 + 4: stage 1 would start on layer 4, which shares layer 3's top-k
        check_layout(ParallelLayout(world=2, pp=2), num_layers=8, indexer_layers=computes)
    assert "stage 1 starts at decoder layer 4" in str(e.value) and PP_FLAG in e.value.flags
    assert "one of 1, 3, 5, 7" in e.value.fix and FIRST_STAGE_FLAG in e.value.fix
    check_layout(ParallelLayout(world=2, pp=2, first_stage_layers=3), num_layers=8, indexer_layers=computes)
    check_layout(ParallelLayout(world=2, tp=2), num_layers=8, indexer_layers=computes)  # one stage: nothing to cut
