"""`ragkv serve --replicas N --peer-tier on|off --peer-tier-bytes B`: parsed into the cluster's
settings; a bad byte count is refused by name."""

from __future__ import annotations

import pytest

from ragkv.cli.main import build_parser
from ragkv.server.settings import ServerSettings


def _parse(*flags: str):
    return build_parser().parse_args(["serve", "--index", "docs=./idx", "--replicas", "2", *flags])


def test_the_peer_tier_is_on_with_replicas_and_its_budget_defaults_to_the_cpu_tier() -> None:
    pytest.importorskip("ray.serve")
    from ragkv.server.cluster import ClusterSettings

    args = _parse()
    assert (args.peer_tier, args.peer_tier_bytes) == ("on", None)
    settings = ServerSettings(kv_cpu_bytes=3 << 30)
    peer = ClusterSettings(args.replicas, peer_tier=args.peer_tier == "on").peer(settings)
    assert peer is not None and peer.budget_bytes == 3 << 30
    assert ClusterSettings(1).peer(settings) is None  # one replica has no peers
    assert ClusterSettings(2, peer_tier=False).peer(settings) is None
    off = _parse("--peer-tier", "off", "--peer-tier-bytes", "512MiB")
    assert (off.peer_tier, off.peer_tier_bytes) == ("off", 512 << 20)
    with pytest.raises(ValueError, match="peer_tier_bytes"):
        ClusterSettings(2, peer_tier_bytes=0)


@pytest.mark.parametrize("bad", ["0", "lots", "-5GiB"])
def test_a_bad_peer_tier_byte_count_is_refused_by_name(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse("--peer-tier-bytes", bad)
    assert "--peer-tier-bytes" in capsys.readouterr().err
