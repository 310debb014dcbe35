"""batchinv.host_syncs: the counter that the no-sync tests rely on must see a sync when there
is one and none when there is none."""

import pytest
import torch

from batchinv.host_syncs import count_host_syncs, host_and_wall_seconds, sync_debug_mode

pytestmark = pytest.mark.cuda


def test_counts_a_sync_and_no_sync():
    x = torch.ones(8, device="cuda")
    value, syncs = count_host_syncs(lambda: (x * 2).sum().item())
    assert (value, syncs) == (16.0, 1)
    _, syncs = count_host_syncs(lambda: x * 2)
    assert syncs == 0
    _, syncs = count_host_syncs(lambda: [float(x[0]), float(x[1])])
    assert syncs == 2


def test_error_mode_raises_and_restores():
    x = torch.ones(8, device="cuda")
    before = torch.cuda.get_sync_debug_mode()
    with pytest.raises(RuntimeError), sync_debug_mode("error"):
        x.sum().item()
    assert torch.cuda.get_sync_debug_mode() == before


def test_host_and_wall_seconds_orders_the_two_clocks():
    x = torch.ones(1 << 20, device="cuda")
    host, wall = host_and_wall_seconds(lambda: x.mul_(1.0), calls=20, warmup=2)
    assert 0 < host <= wall
