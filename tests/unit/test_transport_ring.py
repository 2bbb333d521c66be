"""The C++ shared-memory ring on its own (one process plays both ends): slot life cycle, names."""

from __future__ import annotations

import os
import stat
import uuid

import pytest
import torch

from tests.shm_tag import tagged
from trainer.transport import _shm_ring


@pytest.fixture
def name():
    return f"/mdpp-{tagged(uuid.uuid4().hex[:8])}"


def _commit(ring: _shm_ring.Ring, value: int, nbytes: int = 64) -> int:
    slot = ring.acquire(1.0, 0.01)
    data = torch.full((nbytes,), value, dtype=torch.uint8)
    ring.write(slot, 0, data.data_ptr(), nbytes)
    ring.commit(slot, nbytes, bytes([value]) * _shm_ring.HEADER_BYTES)
    return slot


def test_segment_is_private_and_unlinked_once_the_sender_attached(name):
    receiver = _shm_ring.Ring.create(name, 2, 4096)
    path = f"/dev/shm{name}"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    sender = _shm_ring.Ring.attach(name)
    assert not os.path.exists(path)  # both ends mapped: a crash can leave nothing behind
    assert sender.peer_pid == receiver.peer_pid == os.getpid()
    with pytest.raises(RuntimeError, match="shm_open"):
        _shm_ring.Ring.attach(name)


def test_create_refuses_an_existing_name_and_bad_sizes(name):
    _shm_ring.Ring.create(name, 1, 4096)
    try:
        with pytest.raises(RuntimeError, match="File exists"):
            _shm_ring.Ring.create(name, 1, 4096)
    finally:
        os.unlink(f"/dev/shm{name}")
    with pytest.raises(ValueError, match="slot_bytes"):
        _shm_ring.Ring.create(name + "x", 1, 100)


def test_slots_wrap_around_in_order_and_a_held_slot_is_never_reread(name):
    receiver = _shm_ring.Ring.create(name, 3, 4096)
    sender = _shm_ring.Ring.attach(name)
    view = torch.frombuffer(receiver, dtype=torch.uint8)
    held = []
    for value in range(1, 10):  # three full turns of the ring
        _commit(sender, value)
        slot = receiver.wait_full(1.0, 0.01)
        assert slot == (value - 1) % 3
        start = receiver.slot_offset(slot)
        assert receiver.slot_header(slot)[:1] == bytes([value])
        assert torch.equal(view[start : start + 64], torch.full((64,), value, dtype=torch.uint8))
        held.append(slot)
        if len(held) == 2:  # keep two views alive: the receiver must not see them as new
            assert receiver.wait_full(0.05, 0.01) == _shm_ring.TIMEOUT
            for s in held:
                receiver.release(s)
            held.clear()


def test_credit_exhaustion_times_out_and_release_order_does_not_matter(name):
    receiver = _shm_ring.Ring.create(name, 2, 4096)
    sender = _shm_ring.Ring.attach(name)
    _commit(sender, 1)
    _commit(sender, 2)
    assert sender.acquire(0.05, 0.01) == _shm_ring.TIMEOUT  # no credit left
    first, second = receiver.wait_full(1, 0.01), receiver.wait_full(1, 0.01)
    receiver.release(second)  # out of order: slot 0 is still held
    assert sender.acquire(0.05, 0.01) == _shm_ring.TIMEOUT
    receiver.release(first)
    assert sender.acquire(0.05, 0.01) == first
    with pytest.raises(RuntimeError, match="not held"):
        receiver.release(first)


def test_close_ends_the_stream_after_the_committed_messages(name):
    receiver = _shm_ring.Ring.create(name, 4, 4096)
    sender = _shm_ring.Ring.attach(name)
    _commit(sender, 7)
    sender.close()
    assert receiver.wait_full(1, 0.01) == 0  # data committed before close is still delivered
    assert receiver.wait_full(1, 0.01) == _shm_ring.PEER_CLOSED
    receiver.release(0)
    receiver.close()
    assert sender.acquire(1, 0.01) == _shm_ring.PEER_CLOSED


def test_writes_past_a_slot_are_refused(name):
    receiver = _shm_ring.Ring.create(name, 1, 4096)
    sender = _shm_ring.Ring.attach(name)
    data = torch.zeros(8192, dtype=torch.uint8)
    with pytest.raises(IndexError):
        sender.write(0, 0, data.data_ptr(), 4097)
    with pytest.raises(ValueError, match="larger than a slot"):
        sender.commit(sender.acquire(1, 0.01), 4097, b"\0" * _shm_ring.HEADER_BYTES)
    assert receiver.total_bytes >= 4096 + 4096


def test_doorbell_counts_commits_and_close_and_a_quiet_wait_times_out(name):
    bell_name = name + "-bell"
    bell = _shm_ring.Doorbell.create(bell_name)
    assert stat.S_IMODE(os.stat(f"/dev/shm{bell_name}").st_mode) == 0o600
    receiver = _shm_ring.Ring.create(name, 2, 4096)
    sender = _shm_ring.Ring.attach(name)
    sender.set_doorbell(_shm_ring.Doorbell.attach(bell_name))  # the ring keeps its own mapping alive
    bell.unlink()
    assert not os.path.exists(f"/dev/shm{bell_name}")
    seen = bell.seq
    assert receiver.poll_full() == _shm_ring.TIMEOUT  # nothing committed: no wait, no slot
    assert bell.wait(seen, 0.05) is False  # nothing rang: the wait ends at its timeout
    slot = _commit(sender, 7)
    assert bell.seq == seen + 1 and bell.wait(seen, 5.0) is True  # returns at once: it moved
    assert receiver.poll_full() == slot and receiver.slot_header(slot)[0] == 7
    receiver.release(slot)
    sender.close()
    assert bell.seq == seen + 2  # end of stream rings too, so a sleeping consumer sees it
    assert receiver.poll_full() == _shm_ring.PEER_CLOSED
    assert receiver.peer_status() == 0  # the sender (this process) is alive


@pytest.mark.parametrize("commit_first", [False, True])
def test_send_in_slots_commits_before_the_fill_only_when_asked(name, commit_first):
    """The same-node GPU path commits the header first (its receiver's stream waits for a flag the
    fill writes); every other sender must fill first, or the receiver could read an unfilled slot.
    Checked on a real ring: what the receiver sees from inside each fill, per chunk of a message
    that spans three slots."""
    from trainer.transport.shm_links import _RingStatus, send_in_slots

    receiver = _shm_ring.Ring.create(name, 4, 4096)
    sender = _shm_ring.Ring.attach(name)
    seen_during_fill = []

    def fill(slot: int, offset: int, length: int) -> None:
        seen_during_fill.append((slot, offset, length, receiver.wait_full(0.0, 0.01)))

    wire = bytes(_shm_ring.HEADER_BYTES)
    status = _RingStatus(0, 1, "next", sender)
    send_in_slots(sender, status, wire, 2 * 4096 + 10, 4096, fill, 1.0, 0.01, external=True,
                  commit_first=commit_first)  # fmt: skip
    assert [(s, o, n) for s, o, n, _ in seen_during_fill] == [(0, 0, 4096), (1, 4096, 4096), (2, 8192, 10)]
    if commit_first:  # inside each fill the receiver already has the slot being filled
        assert [v for *_, v in seen_during_fill] == [0, 1, 2]
    else:  # ... only the chunks before it; the last one arrives after its fill
        assert [v for *_, v in seen_during_fill] == [_shm_ring.TIMEOUT, 0, 1]
        assert receiver.wait_full(0.1, 0.01) == 2
    assert [receiver.slot_nbytes(s) for s in range(3)] == [4096, 4096, 10]
