"""parallel_export.py on fake shards: every stage's ranks, gathering over TP by an injected callable, send the full
HF tensors part by part in the engines' order; together they are the TP1 export, exactly; at most one part's
gathered tensors are alive at a time."""

import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")

from miles.backends.megatron_backend.families import describe  # noqa: E402
from miles.backends.megatron_backend.convert import hf_to_megatron, hf_moe_layout, iter_megatron_to_hf  # noqa: E402
from miles.backends.megatron_backend.parallel_export import iter_stage_hf, stage_parts  # noqa: E402
from miles.backends.megatron_backend.tp_shards import pp_stage, tp_shard  # noqa: E402
from miles.parallel.layout import ParallelLayout, stage_layers  # noqa: E402

from test_megatron_convert import tiny  # noqa: E402


class FakeTensorParallelGroup:
    """One stage's TP group: every rank's stage-local shards; records the parts gathered and weak references to
    what each gather handed out."""

    def __init__(self, shards):
        self.shards, self.parts, self.handed = shards, [], []


def fake_grid(full, stages, tp, tied, vocab_size):
    """grid[stage][tp_rank]: the stage-local shards of each rank."""
    return [[tp_shard(pp_stage(full, stages, s, tied_embeddings=tied), tp_rank=r, tp=tp, vocab_size=vocab_size)
             for r in range(tp)] for s in range(len(stages))]


def export(config, hf, layout):
    arch = describe(config)
    full = hf_to_megatron(hf, config)
    stages = stage_layers(arch.num_layers, layout)
    grid = fake_grid(full, stages, layout.tp, arch.tied_embeddings, arch.vocab_size)
    sent, groups = [], []
    for s, row in enumerate(grid):
        group = FakeTensorParallelGroup(row)
        groups.append(group)
        # TP rank 0's loop (the others run the same one, calling the same gathers)
        for name, tensor in iter_stage_hf(row[0], stage=s, stages=stages, hf_config=config, tp_rank=0,
                                          gather=_by_name(group, s, stages), hf_moe_layout=hf_moe_layout(hf)):
            sent.append((name, tensor.clone()))  # what the engine received; the sender drops its tensor
            del tensor
    return sent, groups, stages


def _by_name(group, stage, stages):
    """The gather the ranks call, named by global layer numbers, answered from the stage-local shards."""
    start = stages[stage].start

    def gather(mine):
        out = [{} for _ in group.shards]
        group.parts.append(sorted(mine))
        refs = []
        for name in mine:
            local = name
            if name.startswith("decoder.layers."):
                layer, rest = name[len("decoder.layers."):].split(".", 1)
                local = f"decoder.layers.{int(layer) - start}.{rest}"
            for r, shard in enumerate(group.shards):
                out[r][name] = shard[local].clone()
                refs.append(weakref.ref(out[r][name]))
        # when part k is gathered, the gathered tensors of part k - 2 and before are gone
        for old in group.handed[:-1]:
            assert all(ref() is None for ref in old), "more than one part's gathered tensors alive"
        group.handed.append(refs)
        return out

    return gather


@pytest.mark.parametrize("family,layout", [
    ("llama", ParallelLayout(world=4, tp=2, pp=2)),
    ("qwen2", ParallelLayout(world=4, tp=2, pp=2)),  # tied embeddings: the last stage sends lm_head
    ("qwen2", ParallelLayout(world=2, tp=2)),
    ("qwen3_moe", ParallelLayout(world=4, tp=2, pp=2, first_stage_layers=2)),
])
def test_the_stages_send_the_tp1_export_exactly_in_stage_order(family, layout):
    config, hf = tiny(family)
    sent, groups, stages = export(config, hf, layout)
    reference = dict(iter_megatron_to_hf(hf_to_megatron(hf, config), config, hf_moe_layout=hf_moe_layout(hf)))
    assert sorted(n for n, _ in sent) == sorted(reference) and len(sent) == len(reference)
    for name, tensor in sent:
        assert torch.equal(tensor, reference[name]), name
    # stage by stage: the embedding first, the layers in order, the final norm last (before a tied lm_head)
    names = [n for n, _ in sent]
    assert names[0] == "model.embed_tokens.weight"
    layer_of = [int(n.split(".")[2]) for n in names if n.startswith("model.layers.")]
    assert layer_of == sorted(layer_of)
    assert "model.norm.weight" in names[-2:]
    # one gather per part, in stage_parts' order
    assert [len(g.parts) for g in groups] == [len(stage_parts(s, stages)) for s in range(len(stages))]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_every_stage_receives_the_whole_model_over_the_pipeline_group(family):
    from miles.backends.megatron_backend.parallel_export import iter_model_hf

    config, hf = tiny(family)
    arch = describe(config)
    full = hf_to_megatron(hf, config)
    layout = ParallelLayout(world=4, tp=2, pp=2)
    stages = stage_layers(arch.num_layers, layout)
    grid = fake_grid(full, stages, layout.tp, arch.tied_embeddings, arch.vocab_size)
    # what each owner stage sends, part by part: the "wire" of the fake pipeline group
    wire = {s: [] for s in range(len(stages))}
    for s, row in enumerate(grid):
        def record(owner, items, s=s):
            assert owner == s and items is not None
            wire[s].append(items)
            return items
        list(iter_model_hf(row[0], stage=s, stages=stages, hf_config=config, tp_rank=0,
                           gather=_by_name(FakeTensorParallelGroup(row), s, stages), share=_only_own(record, s),
                           hf_moe_layout=hf_moe_layout(hf)))
    reference = list(iter_megatron_to_hf(full, config, hf_moe_layout=hf_moe_layout(hf)))
    for s, row in enumerate(grid):  # each stage's ranks: their own parts converted, the others' received
        sent = iter(wire[s])
        received = {o: iter(wire[o]) for o in wire}

        def share(owner, items, s=s):
            assert (items is not None) == (owner == s), "only the owner stage converts a part"
            return next(received[owner]) if items is None else (next(sent), items)[1]

        got = list(iter_model_hf(row[0], stage=s, stages=stages, hf_config=config, tp_rank=0,
                                 gather=_by_name(FakeTensorParallelGroup(row), s, stages), share=share,
                                 hf_moe_layout=hf_moe_layout(hf)))
        assert sorted(n for n, _ in got) == sorted(n for n, _ in reference)
        ref = dict(reference)
        for name, tensor in got:
            assert torch.equal(tensor, ref[name]), name
        assert got[0][0] == "model.embed_tokens.weight"


def _only_own(record, stage):
    """A share for the recording pass: the other stages' parts are skipped (an empty hand-over)."""
    def share(owner, items):
        return record(owner, items) if owner == stage else []
    return share


@pytest.mark.parametrize("tp,ep,etp", [(2, 2, 1), (4, 2, 2), (2, 4, 1)])
def test_every_tp_rank_exports_the_tp1_weights_when_its_peers_hold_other_experts(tp, ep, etp):
    """With EP and TP both > 1 the TP ranks of a group are different expert-parallel ranks (ranks number ETP
    fastest, then EP): each must hand the EP gather its own experts, not TP rank 0's."""
    from miles.backends.megatron_backend.convert import experts_to_global
    from miles.parallel.layout import rank_coordinates

    config, hf = tiny("qwen3_moe")  # 4 experts
    config.num_experts = 8  # 8 experts: EP 4 and EP 2 x ETP 2 both split them
    torch.manual_seed(1)
    hf = {**hf, **{f"model.layers.{i}.mlp.experts.{e}.{p}.weight": torch.randn(24 if p != "down_proj" else 16,
                                                                                16 if p != "down_proj" else 24)
                   for i in (0, 2) for e in range(8) for p in ("gate_proj", "up_proj", "down_proj")}}
    arch = describe(config)
    layout = ParallelLayout(world=tp * max(1, ep * etp // tp), tp=tp, ep=ep, etp=etp)
    coords = rank_coordinates(layout)[:tp]  # one TP group: its ranks' EP and ETP ranks
    stages = stage_layers(arch.num_layers, layout)
    by_ep = {e: hf_to_megatron(hf, config, ep_rank=e, ep_size=ep) for e in range(ep)}
    row = [tp_shard(by_ep[c.ep], tp_rank=c.tp, tp=tp, etp_rank=c.etp, etp=etp, vocab_size=arch.vocab_size)
           for c in coords]

    def gather_over_ep(mine_ep):
        def layer_experts(layer, local):
            prefix = f"decoder.layers.{layer}.mlp.experts.local_experts."
            own = {k: v for k, v in by_ep[mine_ep].items() if k.startswith(prefix)}
            assert set(local) == set(own) and all(torch.equal(local[k], own[k]) for k in own), \
                "this rank hands the EP gather experts it does not hold"
            full = {}
            for e in range(ep):
                full.update(experts_to_global({k: v for k, v in by_ep[e].items() if k.startswith(prefix)},
                                              config, e, ep))
            return full
        return layer_experts

    reference = dict(iter_megatron_to_hf(hf_to_megatron(hf, config), config, hf_moe_layout=hf_moe_layout(hf)))
    for c in coords:
        got = {name: tensor.clone() for name, tensor in  # the engine's copy: the sender drops its tensor
               iter_stage_hf(row[c.tp], stage=0, stages=stages, hf_config=config, tp_rank=c.tp, etp=etp,
                             gather=_by_name(FakeTensorParallelGroup(row), 0, stages),
                             hf_moe_layout=hf_moe_layout(hf), layer_experts=gather_over_ep(c.ep))}
        assert set(got) == set(reference)
        for name, tensor in got.items():
            assert torch.equal(tensor, reference[name]), (c, name)
