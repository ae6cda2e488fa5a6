"""An iteration in flight: on CUDA it records an event after its last op, and waiting for it
waits for that event alone; on the CPU, where every op has run when it is queued, there is
nothing to wait for. (The event is CUDA's; here a stand-in records what is asked of it.)"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from splitserve.engine import in_flight
from splitserve.engine.outputs import StepStats
from splitserve.engine.policies import Plan, ScheduledSeq


class _Event:
    made: list["_Event"] = []

    def __init__(self):
        self.calls = []
        _Event.made.append(self)

    def record(self, stream=None):
        self.calls.append(("record", stream))

    def synchronize(self):
        self.calls.append("synchronize")


def _queued(logits) -> in_flight.InFlight:
    seq = SimpleNamespace(seq_id="a", num_computed_tokens=4, token_ids=[1, 2, 3, 4, 5])
    plan = Plan((ScheduledSeq(seq, 1),), ())
    forward = SimpleNamespace(logits=logits, seqs=[seq], prompt_rows=[])
    return in_flight.InFlight.queued(plan, StepStats(), 0.0, forward, drawn=None)


def test_on_cuda_it_waits_for_the_event_recorded_after_its_last_op(monkeypatch):
    monkeypatch.setattr(in_flight.torch.cuda, "Event", _Event)
    monkeypatch.setattr(in_flight.torch.cuda, "current_stream", lambda device: f"current stream of {device}")
    _Event.made.clear()
    queued = _queued(SimpleNamespace(is_cuda=True, device="cuda:1"))  # on its device's stream, whichever is current
    assert [event.calls for event in _Event.made] == [[("record", "current stream of cuda:1")]]
    queued.wait()
    assert _Event.made[0].calls == [("record", "current stream of cuda:1"), "synchronize"]
    assert queued.runs(queued.plan.scheduled[0].seq) and not queued.runs(SimpleNamespace(seq_id="a"))


def test_on_the_cpu_there_is_nothing_to_wait_for(monkeypatch):
    monkeypatch.setattr(in_flight.torch.cuda, "Event", _Event)
    _Event.made.clear()
    queued = _queued(torch.zeros(1, 4))
    queued.wait()
    assert queued.done is None and _Event.made == []
