"""The data tree is a DAG within the reader's limits: shared objects stay shared in both
modes; what the tree cannot hold as data (a cycle, nesting deeper than the reader allows,
sharing that a reader would expand past its budget) sends the whole object to the pickle
section, which ``safe=False`` reads with every identity kept and ``safe=True`` refuses as
not readable here, saying why. What ``dump`` writes, ``load`` reads."""

from __future__ import annotations

import numpy as np
import pytest

from coax_utils import utils


def pickle_section_of(s: bytes) -> str:
    """The message of safe=True refusing ``s`` (it names the first pickled object)."""
    with pytest.raises(utils.UnsafeCheckpointError) as e:
        utils.loads(s, safe=True)
    return str(e.value)


def test_shared_objects_stay_shared_in_both_modes():
    a = [13]
    b = {"a": a, "again": a}
    arr = np.arange(5)
    obj = {"a": a, "b": b, "arrays": (arr, arr), "tuple": (a, a)}
    s = utils.dumps(obj)
    for safe in (True, False):
        r = utils.loads(s, safe=safe)
        assert r["b"] == b and r["tuple"] == (a, a)
        np.testing.assert_array_equal(r["arrays"][0], arr)
        assert r["b"]["a"] is r["a"] and r["b"]["again"] is r["a"]
        assert r["tuple"][0] is r["a"] and r["arrays"][0] is r["arrays"][1]
        r["b"]["a"].append(7)
        assert r["a"] == [13, 7]


def test_cycles_go_to_the_pickle_section_whole_and_keep_their_identities():
    cyclic = [1]
    cyclic.append(cyclic)
    d = {}
    d["self"] = (d, [d])
    shared = [5]
    obj = {"list": cyclic, "dict": d, "shared": shared, "twice": shared}
    s = utils.dumps(obj)
    message = pickle_section_of(s)
    assert "a cycle through the list" in message or "a cycle through the dict" in message
    r = utils.loads(s)
    assert r["list"][1] is r["list"] and r["list"][0] == 1
    assert r["dict"]["self"][0] is r["dict"] and r["dict"]["self"][1][0] is r["dict"]
    assert r["shared"] is r["twice"]
    # a cycle through an immutable tuple
    t_list = []
    t = (t_list,)
    t_list.append(t)
    r = utils.loads(utils.dumps([t, t]))
    assert r[0] is r[1] and r[0][0][0] is r[0]


def test_dumps_of_x_repeated_200_times_loads_in_both_modes():
    x = list(range(1_000_000))
    obj = [x] * 200
    s = utils.dumps(obj)
    restored = utils.loads(s)
    assert len(restored) == 200 and all(r is restored[0] for r in restored)
    assert restored[0] == x
    message = pickle_section_of(s)  # an intact file, not readable with safe=True
    assert "past its budget" in message and "intact but cannot be read here" in message
    few = utils.loads(utils.dumps([x] * 8), safe=True)  # within the budget: data
    assert all(r is few[0] for r in few) and few[0] == x


def test_nesting_deeper_than_the_reader_allows_is_pickled_whole():
    deep = inner = []
    for _ in range(150):
        inner.append([])
        inner = inner[0]
    s = utils.dumps({"deep": deep})
    assert "nesting deeper than 100 levels" in pickle_section_of(s)
    restored = utils.loads(s)["deep"]
    for _ in range(150):
        restored = restored[0]
    assert restored == []
    # deep only through a reference: a 60-level list, then held again 60 levels down
    a = b = []
    for _ in range(60):
        b.append([])
        b = b[0]
    holder = c = []
    for _ in range(60):
        c.append([])
        c = c[0]
    c.append(a)
    s = utils.dumps([a, holder])
    assert "nesting deeper than 100 levels" in pickle_section_of(s)
    r = utils.loads(s)
    leaf = r[1]
    for _ in range(60):
        leaf = leaf[0]
    assert leaf[0] is r[0]
    shallow = utils.loads(utils.dumps([a, [[a]]]), safe=True)  # within the limit: data
    assert shallow[1][0][0] is shallow[0]


def test_objects_that_are_not_data_still_go_to_the_pickle_section_one_by_one():
    obj = {"f": len, "w": np.ones(3), "n": 1}
    s = utils.dumps(obj)
    assert "builtins.builtin_function_or_method at ['f']" in pickle_section_of(s)
    assert utils.loads(s)["f"] is len


def has_pickle_section(s: bytes) -> bool:
    try:
        utils.loads(s, safe=True)
    except utils.UnsafeCheckpointError:
        return True
    return False


def test_at_the_edge_of_the_budget_what_dump_keeps_as_data_loads_in_safe_mode():
    x = [0] * 50_000  # two bytes of JSON per node: the writer's count is close to the reader's
    lo, hi = 1, 2000  # [x] * lo is data, [x] * hi is not: find where it changes
    assert not has_pickle_section(utils.dumps([x] * lo))
    assert has_pickle_section(utils.dumps([x] * hi))
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if has_pickle_section(utils.dumps([x] * mid)) else (mid, hi)
    edge = utils.loads(utils.dumps([x] * lo), safe=True)  # the most sharing dump keeps
    assert len(edge) == lo and all(r is edge[0] for r in edge) and edge[0] == x
    assert lo > 16  # the budget allows honest sharing well beyond a few copies


def test_at_the_edge_of_the_depth_limit_what_dump_keeps_as_data_loads_in_safe_mode():
    def nested(levels):
        root = inner = []
        for _ in range(levels - 1):
            inner.append([])
            inner = inner[0]
        return root

    deepest = next(n for n in range(90, 120) if has_pickle_section(utils.dumps(nested(n))))
    assert deepest > 100
    restored = utils.loads(utils.dumps(nested(deepest - 1)), safe=True)
    for _ in range(deepest - 2):
        restored = restored[0]
    assert restored == []
