"""A transformers model's checkpoint weights load back into it through transformers' own loader: transformers 5
keeps a MoE layer's experts fused in the model (`experts.gate_up_proj`) and saves them per expert
(`experts.0.gate_proj.weight`), so the files' raw names do not match the model's state dict. The torch backend's
`--load` of a glm_moe_dsa / qwen3_5_moe / qwen3_moe checkpoint goes through here."""

import pytest
import torch

from miles import checkpoint
from miles.models import write_random_model


def _model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)


@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "glm5-tiny", "qwen3.5-moe-tiny", "llama-tiny"])
def test_saved_weights_load_back_bit_for_bit(tmp_path, preset):
    saved = _model(write_random_model(str(tmp_path / "a"), preset, seed=1, dtype="fp32"))
    with torch.no_grad():
        for p in saved.parameters():
            p.add_(0.25)  # weights no freshly built model holds
    checkpoint.save_train_state(str(tmp_path / "ckpt"), model=saved, optimizer=None, store=None, rank=0,
                                world_size=1)
    target = _model(write_random_model(str(tmp_path / "b"), preset, seed=2, dtype="fp32"))
    storages = {k: v.untyped_storage().data_ptr() for k, v in target.state_dict().items()}

    checkpoint.load_model_weights(target, str(tmp_path / "ckpt" / checkpoint.MODEL_DIR))
    got, want = target.state_dict(), saved.state_dict()
    assert got.keys() == want.keys()
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    assert {k: v.untyped_storage().data_ptr() for k, v in got.items()} == storages  # copied in place


def test_weights_of_another_model_are_refused(tmp_path):
    saved = _model(write_random_model(str(tmp_path / "a"), "qwen3-moe-tiny", dtype="fp32"))
    checkpoint.save_train_state(str(tmp_path / "ckpt"), model=saved, optimizer=None, store=None, rank=0,
                                world_size=1)
    other = _model(write_random_model(str(tmp_path / "b"), "llama-tiny", dtype="fp32"))
    with pytest.raises(checkpoint.CheckpointError, match=str(tmp_path / "ckpt")):
        checkpoint.load_model_weights(other, str(tmp_path / "ckpt" / checkpoint.MODEL_DIR))
