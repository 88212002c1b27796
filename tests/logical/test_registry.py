from kvstrata.logical.registry import BlockRecord, BlockRegistry, RegistryObserver


class Recorder(RegistryObserver):
    def __init__(self):
        self.log = []

    def on_tier_stored(self, tier, records):
        self.log.append(("tier_stored", tier, [r.sequence_hash for r in records]))

    def on_tier_removed(self, tier, hashes):
        self.log.append(("tier_removed", tier, list(hashes)))

    def on_tier_cleared(self, tier):
        self.log.append(("tier_cleared", tier))

    def on_stored(self, records):
        self.log.append(("stored", [r.sequence_hash for r in records]))

    def on_removed(self, hashes):
        self.log.append(("removed", list(hashes)))


def rec(h):
    return BlockRecord(h, h, None, 16)


def test_stored_on_first_tier_removed_on_last():
    reg, obs = BlockRegistry(), Recorder()
    reg.add_observer(obs)
    reg.record_stored("G1", [rec(1), rec(2)])
    reg.record_stored("G2", [rec(2), rec(3)])
    assert reg.tiers_of(2) == {"G1", "G2"}
    reg.record_removed("G1", [1, 2])
    reg.record_removed("G2", [2])
    assert obs.log == [
        ("tier_stored", "G1", [1, 2]), ("stored", [1, 2]),
        ("tier_stored", "G2", [2, 3]), ("stored", [3]),
        ("tier_removed", "G1", [1, 2]), ("removed", [1]),
        ("tier_removed", "G2", [2]), ("removed", [2]),
    ]
    assert 3 in reg and 2 not in reg and len(reg) == 1
    assert reg.hashes_in("G2") == {3}


def test_cleared_reports_hashes_leaving_their_last_tier():
    reg, obs = BlockRegistry(), Recorder()
    reg.record_stored("G1", [rec(1), rec(2)])
    reg.record_stored("G2", [rec(2)])
    reg.add_observer(obs)
    reg.record_cleared("G1", [1, 2])
    assert obs.log == [("tier_cleared", "G1"), ("removed", [1])]
    reg.remove_observer(obs)
    reg.record_removed("G2", [2])
    assert len(obs.log) == 2 and len(reg) == 0
