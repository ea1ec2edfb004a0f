"""The other boxes online on a shared job stream, read from availability notices."""

from __future__ import annotations

from edge.comms.mqtt import GROUP_PROPERTY, INSTANCE_PROPERTY, OFFLINE, ONLINE
from edge.comms.peers import StreamPeers


def _peers() -> StreamPeers:
    return StreamPeers("edge", "me", (GROUP_PROPERTY, "plant"), ONLINE)


def _props(group: str | None, instance: str = "i1") -> list[tuple[str, str]]:
    props = [(INSTANCE_PROPERTY, instance)]
    return [*props, (GROUP_PROPERTY, group)] if group is not None else props


def test_a_box_is_a_peer_while_its_latest_notice_says_online_on_our_group() -> None:
    peers = _peers()
    assert peers.topic_filter == "edge/+/available"
    peers.notice("edge/b/available", ONLINE, _props("plant"))
    peers.notice("edge/c/available", ONLINE, _props("plant"))
    assert peers.online() == ["b", "c"]
    peers.notice("edge/b/available", OFFLINE, _props("plant"))  # a clean stop, or its will
    peers.notice("edge/c/available", b"", [])  # a retained notice an operator cleared
    assert peers.online() == []
    peers.notice("edge/b/available", ONLINE, _props("plant"))
    peers.notice("edge/b/available", ONLINE, _props("line"))  # moved to another stream
    assert peers.online() == []


def test_other_streams_our_own_topic_and_other_topics_are_no_peers() -> None:
    peers = _peers()
    peers.notice("edge/x/available", ONLINE, _props("line"))
    peers.notice("edge/y/available", ONLINE, _props(None))  # a box on no stream
    peers.notice("edge/me/available", ONLINE, _props("plant", "another-instance"))  # identity's business
    peers.notice("other/z/available", ONLINE, _props("plant"))  # another prefix
    peers.notice("edge/z/results", ONLINE, _props("plant"))
    assert peers.online() == []
