"""A streamed-state load that cannot be mapped onto this run's store (another expert-parallel size,
another model) fails naming --no-load-optim, the flag that resumes the weights alone."""

import pytest
import torch

from miles import checkpoint
from miles_plugins.optimizers.nvme_stream import CheckpointError as StoreCheckpointError


class _UnmappableStore:
    def load_from(self, base):
        raise StoreCheckpointError(f"{base}/nvme_opt_state/rank00000/opt0_0: the checkpoint differs from this store")


def _saved(tmp_path):
    model = torch.nn.Linear(4, 3)
    base = checkpoint.prepare(str(tmp_path / "ckpt"), 2)
    checkpoint.save_train_state(base, model=model, optimizer=None, store=None, rank=0, world_size=1)
    # a streamed save: its optimizer state is the store's (which the fake store cannot map)
    checkpoint.write_meta(base, next_rollout_id=2, data_state={}, world_size=1,
                          extra={"streamed_optimizer_state": True})
    return base, model


def test_unmappable_streamed_state_names_no_load_optim(tmp_path):
    base, model = _saved(tmp_path)
    with pytest.raises(checkpoint.CheckpointError, match=r"differs from this store.*pass --no-load-optim"):
        checkpoint.load_train_state(base, model=model, optimizer=None, store=_UnmappableStore(), rank=0,
                                    world_size=1, load_optimizer=True)


def test_no_load_optim_skips_the_store(tmp_path):
    base, model = _saved(tmp_path)
    info = checkpoint.load_train_state(base, model=model, optimizer=None, store=_UnmappableStore(), rank=0,
                                       world_size=1, load_optimizer=False)
    assert info["optimizer"] == "skipped" and info["model_tensors"] == 2
