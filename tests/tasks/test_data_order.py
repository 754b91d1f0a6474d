"""The training order is a function of the seed, the epoch and the rank: a loader built for a resumed run shuffles
its first epoch as the uninterrupted run's loader did, with or without workers, whatever the global generator holds."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from vitkit.data.modules.loaders import EpochSampler, ResumableLoader


def _order(loader: DataLoader) -> list[int]:
    return [int(i) for (x,) in loader for i in x]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_loader_built_at_epoch_e_gives_epoch_e_s_order(num_workers, monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    ds = TensorDataset(torch.arange(40))

    def loader(epoch: int) -> DataLoader:
        g = torch.Generator()
        return DataLoader(ds, batch_size=8, sampler=EpochSampler(ds, g, epoch), generator=g, num_workers=num_workers,
                          persistent_workers=num_workers > 0)

    run = loader(0)  # the uninterrupted run: one loader, its epoch set as Lightning sets it
    epochs = []
    for e in range(3):
        run.sampler.set_epoch(e)
        torch.manual_seed(100 + e)  # whatever the global generator holds
        epochs.append(_order(run))
    assert len({tuple(o) for o in epochs}) == 3 and all(sorted(o) == list(range(40)) for o in epochs)
    torch.manual_seed(0)
    assert _order(loader(2)) == epochs[2]  # a run resumed in epoch 2
    monkeypatch.setenv("PL_GLOBAL_SEED", "8")
    assert _order(loader(2)) != epochs[2]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_training_loader_resumed_mid_epoch_goes_on_with_the_next_batch(num_workers, monkeypatch):
    """The training loader's place in its epoch is what Lightning keeps in a checkpoint (``state_dict``); a loader
    built for the resumed run and given it goes on with the next batch of that epoch's order: no image twice, none
    left out; the next epoch is whole."""
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    ds = TensorDataset(torch.arange(40))

    def loader(epoch: int) -> ResumableLoader:
        g = torch.Generator()
        return ResumableLoader(ds, batch_size=8, sampler=EpochSampler(ds, g, epoch), generator=g,
                               num_workers=num_workers, persistent_workers=num_workers > 0)

    run = loader(1)
    whole, state, seen = _order(run), None, []
    for b, (x,) in enumerate(run):
        seen += x.tolist()
        if b == 2:
            state = run.state_dict()  # a checkpoint after three batches
            break
    assert state == {"batches": 3}
    resumed = loader(1)
    resumed.load_state_dict(state)
    rest = _order(resumed)
    assert seen + rest == whole and resumed.state_dict() == {"batches": 5}
    resumed.sampler.set_epoch(2)
    assert sorted(_order(resumed)) == list(range(40))
    resumed.load_state_dict({"batches": 5})  # a checkpoint after the epoch's last batch: the next epoch is whole
    assert sorted(_order(resumed)) == list(range(40))
