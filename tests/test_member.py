"""A peer's reports to its tracker, read off the frames its tracker link posts."""
from types import SimpleNamespace

from p2pweights import protocol
from p2pweights.member import Membership
from p2pweights.protocol import Msg
from p2pweights.pull import PullScheduler

CHUNK = 1 << 20


def test_a_heartbeat_reports_each_partner_s_rate_while_asked_and_what_it_delivered_since_the_last():
    clock = [0.0]
    pull = PullScheduler(8, CHUNK, clock=lambda: clock[0])
    for rank in (1, 2):
        pull.add(rank)
        pull.ready(rank, [1] * 8)
    posted = []
    node = SimpleNamespace(clock=lambda: clock[0], pull=pull, store=SimpleNamespace(count=0))
    tracker_link = SimpleNamespace(send=lambda frame, flags: posted.append(frame))
    member = Membership(node, tracker_link, "10.0.0.1:7420", {}, tracker_timeout=10.0, give_up_after=10.0)

    def beat() -> dict:
        member.heartbeat()
        event = protocol.decode([posted.pop()])
        assert event.type == Msg.HEARTBEAT
        return event.fields

    for t, rank, index in ((0.1, 1, 0), (0.2, 1, 1), (0.3, 2, 2)):
        clock[0] = t
        pull.arrived(rank, index, ok=True)
    clock[0] = 0.5
    first = beat()
    assert first["got"] == {"1": round(2 * CHUNK / 0.5), "2": round(CHUNK / 0.5)}
    assert set(first["links"]) == {"1", "2"}  # the rates while asked, measured per chunk
    clock[0] = 0.75
    pull.arrived(1, 3, ok=True)
    pull.arrived(2, 4, ok=False)  # a chunk that failed verification delivered nothing
    clock[0] = 1.0
    assert beat()["got"] == {"1": round(CHUNK / 0.5)}
    clock[0] = 1.5
    assert beat()["got"] == {}


def test_a_probe_goes_out_as_we_attach_and_says_how_many_chunks_we_held():
    # the tracker judges a probe by the uplink only if we held nothing to forward when we sent it
    from p2pweights.tracker import PROBE_BYTES

    for have in ([0] * 8, [1, 1, 0, 1, 0, 0, 0, 0]):
        posted = []
        node = SimpleNamespace(clock=lambda: 0.0, pull=PullScheduler(8, CHUNK, have=have))
        link = SimpleNamespace(send_multipart=lambda frames, flags: posted.append(frames))
        Membership(node, link, "10.0.0.1:7420", {}, tracker_timeout=10.0, give_up_after=10.0, probe=PROBE_BYTES)
        events = [protocol.decode(frames) for frames in posted]
        assert [(e.type, e.fields) for e in events] == [(Msg.PROBE, {"seq": 0, "held": sum(have)}),
                                                        (Msg.PROBE, {"seq": 1}), (Msg.PROBE, {"seq": 2})]
        assert [len(e.payload) for e in events] == [0, PROBE_BYTES, PROBE_BYTES]
