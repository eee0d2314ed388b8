"""The upload scheduler alone: fair round-robin, parking, cancels, the seeder's fresh-first order; the announcer:
who hears of fresh chunks at once, who in batches."""
import pytest

from p2pweights.wire.protocol import ProtocolError
from p2pweights.swarm.policy.serve import HAVE_DEFER, PULLING, Announcer, UploadScheduler


def held(text: str):
    return lambda i: text[i] == "1"


def drain(s, skip=()):
    out = []
    while (item := s.next(skip)) is not None:
        out.append(item)
        s.sent(item[1])
    return out


def test_links_are_served_round_robin_whatever_they_ask():
    s = UploadScheduler(8, held("11111111"))
    for link in (b"a", b"b"):
        s.attach(link)
    s.request(b"a", [0, 1, 2, 3])
    s.request(b"b", [4])
    assert drain(s) == [(b"a", 0), (b"b", 4), (b"a", 1), (b"a", 2), (b"a", 3)]


def test_a_hold_sends_nothing_until_it_ends_and_requests_queue_meanwhile():
    # a joiner's uplink probe has the uplink to itself: what children ask waits for its end
    now = [0.0]
    s = UploadScheduler(8, held("11111111"), clock=lambda: now[0])
    s.attach(b"a")
    s.hold(0.25)
    s.request(b"a", [0, 1])
    assert not s.pending() and s.next() is None
    now[0] = 0.1
    s.hold(0.0)  # the probe ended early
    assert s.pending() and drain(s) == [(b"a", 0), (b"a", 1)]
    s.hold(0.5)
    s.request(b"a", [2])
    now[0] = 0.5  # or the hold ran out
    assert drain(s) == [(b"a", 2)]


def test_only_what_was_asked_and_parked_until_verified():
    s = UploadScheduler(4, held("1..."))
    s.attach(b"a")
    assert s.request(b"a", [0, 2]) == [2]  # 2 is not held: parked (and returned, to read from storage)
    assert drain(s) == [(b"a", 0)]
    s.verified(2)
    assert drain(s) == [(b"a", 2)]
    assert drain(s) == []


def test_cancel_withdraws_queued_and_parked_requests():
    s = UploadScheduler(4, held("11.."))
    s.attach(b"a")
    s.request(b"a", [0, 1, 2])
    s.cancel(b"a", [1, 2])
    s.verified(2)
    assert drain(s) == [(b"a", 0)]


def test_seeder_sends_chunks_nobody_has_before_duplicates():
    s = UploadScheduler(4, held("1111"), fresh_first=True)
    for link in (b"a", b"b"):
        s.attach(link)
    s.request(b"a", [0])
    assert drain(s) == [(b"a", 0)]
    s.request(b"a", [1])
    s.request(b"b", [0, 2])
    assert [i for _, i in drain(s)] == [1, 2, 0]  # chunk 0 went out once already: it waits


def test_blocked_send_stays_first_in_line():
    s = UploadScheduler(4, held("1111"))
    s.attach(b"a")
    s.request(b"a", [0, 1])
    link, i = s.next()
    s.blocked(link, i)
    assert s.next(skip={b"a"}) is None
    assert drain(s) == [(b"a", 0), (b"a", 1)]


def test_limits_of_what_a_link_may_ask():
    s = UploadScheduler(4, held("...."), max_parked=2)
    with pytest.raises(ProtocolError, match="not attached"):
        s.request(b"x", [0])
    s.attach(b"a")
    with pytest.raises(ProtocolError, match="twice"):
        s.request(b"a", [1, 1])
    with pytest.raises(ProtocolError, match="blob has 4"):
        s.request(b"a", [9])
    s.request(b"a", [0, 1])
    s.request(b"a", [0])  # a stall re-request of a waiting chunk: not counted again
    with pytest.raises(ProtocolError, match="more than 2"):
        s.request(b"a", [2])


def test_detach_forgets_everything_a_link_asked():
    s = UploadScheduler(4, held("1..."))
    s.attach(b"a")
    s.request(b"a", [0, 1])
    s.detach(b"a")
    s.verified(1)
    assert drain(s) == [] and not s.parked


def announcer(n=16, stripes=1):
    clock = [10.0]
    s = UploadScheduler(n, held("1" * n), clock=lambda: clock[0], stripes=lambda: stripes)
    for link in (b"a", b"b"):
        s.attach(link)
    return Announcer(s, lambda: clock[0]), s, clock


def test_a_partner_pulling_from_us_hears_at_once_the_others_in_batches():
    a, s, clock = announcer()
    s.request(b"a", [0])
    assert a.tell(b"a", [1]) == [1]  # it asked just now
    assert a.tell(b"b", [1]) == []  # it never asked: later
    assert a.tell(b"b", [2]) == []
    assert a.due() == []  # not yet
    clock[0] += HAVE_DEFER
    assert a.due() == [(b"b", [1, 2])]
    assert a.due() == []


def test_waiting_requests_keep_a_partner_pulling_however_long_ago_it_asked():
    a, s, clock = announcer()
    s.request(b"a", [3])  # parked or queued here: it waits on us
    clock[0] += 10 * PULLING
    assert a.tell(b"a", [1]) == [1]
    drain(s)  # sent: nothing waits any more, and it asked long ago
    assert a.tell(b"a", [2]) == []
    s.request(b"a", [5])  # it asks again: what waited rides along with the next news
    assert a.tell(b"a", [4]) == [2, 4]
    clock[0] += HAVE_DEFER
    assert a.due() == []


def test_only_the_stripes_a_partner_pulls_from_us_are_told_at_once():
    a, s, clock = announcer(stripes=2)
    s.request(b"a", [0, 2])  # stripe 0 (chunk i is in stripe i mod 2)
    assert a.tell(b"a", [4, 5]) == [4, 5]  # a message goes for 4: 5 (stripe 1) rides along
    assert a.tell(b"a", [7]) == []  # stripe 1 alone: later
    assert a.tell(b"a", [6]) == [7, 6]  # what waited rides along: no message of its own
    assert a.tell(b"a", [9]) == []
    clock[0] += HAVE_DEFER
    assert a.due() == [(b"a", [9])]
    s.request(b"a", [1])  # helping with stripe 1 as well now
    assert a.tell(b"a", [10, 11]) == [10, 11]


def test_everything_replaces_what_waited_and_a_forgotten_partner_hears_nothing():
    a, s, clock = announcer(4)
    assert a.tell(b"a", [1]) == [] and a.tell(b"b", [1]) == []
    assert a.tell(b"a", range(4), everything=True) == range(4)
    s.detach(b"b")
    clock[0] += HAVE_DEFER
    assert a.due() == []
