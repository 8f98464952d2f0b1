"""Which calls of a cache policy can take an entry out, derived from its source
(:mod:`kvguard.guards.checks.tier_removals`), on small policies written like vLLM's."""

from __future__ import annotations

from collections import OrderedDict

from kvguard.guards.checks import tier_removals


class Entry:
    def __init__(self, ready: bool = True) -> None:
        self.ref_cnt = 0 if ready else -1


class Policy:
    """An LRU policy in the shape of vLLM's: ``get`` reads ``chunks``."""

    def __init__(self) -> None:
        self.chunks: OrderedDict = OrderedDict()
        self.order: list = []

    def get(self, key):
        return self.chunks.get(key)

    def insert(self, key, chunk) -> None:
        self.chunks[key] = chunk
        self.order.append(key)

    def touch(self, keys) -> None:
        for key in keys:
            if key in self.chunks:
                self.chunks.move_to_end(key)

    def remove(self, key) -> None:
        del self.chunks[key]

    def evict(self, n: int) -> list:
        out = []
        for key in list(self.chunks)[:n]:
            out.append((key, self.chunks.pop(key)))
        return out

    def _drop_all(self) -> None:
        table = self.chunks  # an alias: counted as a removal, whatever is done with it
        table.clear()

    def reset(self) -> None:
        self._drop_all()

    def size(self) -> int:
        return len(self.chunks)


def test_the_removing_methods_are_found_by_what_they_do():
    found = tier_removals.removal_calls(Policy, ["chunks"])
    assert found == {
        "insert": (0, "key"),  # a store keyed by a parameter: counts only when the key is there
        "remove": None,
        "evict": None,
        "_drop_all": None,
        "reset": None,  # through _drop_all
    }


def test_the_epoch_moves_on_removals_and_replacements_only():
    policy = Policy()
    epoch = tier_removals.watch(policy, ["chunks"])
    assert epoch is not None and epoch.n == 0
    policy.insert("a", Entry())
    policy.insert("b", Entry())
    policy.touch(["a"])
    assert policy.get("a") is not None and policy.size() == 2
    assert epoch.n == 0  # new keys, a reorder and reads take nothing out
    policy.insert("a", Entry(ready=False))  # replaces a ready entry
    assert epoch.n == 2
    policy.evict(1)
    assert epoch.n == 4 and policy.size() == 1
    policy.reset()
    assert epoch.n >= 6 and policy.size() == 0
    assert tier_removals.watch(policy, ["chunks"]) is epoch  # one epoch per policy


def test_unwatch_restores_the_methods_and_kills_the_epoch():
    policy = Policy()
    epoch = tier_removals.watch(policy, ["chunks"])
    assert "remove" in vars(policy)
    tier_removals.unwatch_all()
    assert "remove" not in vars(policy) and epoch.n is None
    policy.insert("a", Entry())
    policy.remove("a")
    assert epoch.n is None and policy.size() == 0


def test_an_unreadable_method_means_no_epoch():
    class Native(Policy):
        pop_all = dict.clear  # not a Python function: its effect cannot be read

    assert tier_removals.removal_calls(Native, ["chunks"]) is None
    assert tier_removals.watch(Native(), ["chunks"]) is None


def test_a_method_someone_else_replaced_is_left_alone():
    policy = Policy()
    policy.remove = lambda key: None  # another tool's instance attribute
    assert tier_removals.watch(policy, ["chunks"]) is None
    assert "_kvguard_removal_epoch" not in vars(policy)


def test_the_derivation_is_kept_per_method_set_and_a_new_method_is_read_again(monkeypatch):
    """:func:`removal_calls` parses each policy class once (about 20 ms per engine, but per
    replay in the fuzzer); a class whose method was replaced is a new question."""
    first = tier_removals.removal_calls(Policy, ["chunks"])
    first["size"] = None  # the caller's copy: the kept answer is not changed through it
    assert "size" not in tier_removals.removal_calls(Policy, ["chunks"])

    def size(self) -> int:
        self.chunks.popitem()  # now a remover: must be found, not answered from the cache
        return len(self.chunks)

    monkeypatch.setattr(Policy, "size", size)
    assert tier_removals.removal_calls(Policy, ["chunks"])["size"] is None
