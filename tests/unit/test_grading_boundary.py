"""The grading boundary's two sides without a sandbox: what crosses (data only, decoded into this side's own types),
the grader's proxies, and a call answered by the episode's side over a pair of pipes."""

from __future__ import annotations

import ast
import collections
import datetime as dt
import decimal
import fractions
import json
import os
import pathlib
import threading
import unittest
import uuid

import networkx as nx
import pytest

from composer.rollout.tasks.repository import crossing
from composer.rollout.tasks.repository.boundary import module_name, proxied


def crossed(value):
    """`value` encoded, sent as JSON text and decoded, as it reaches the other side."""
    return crossing.decode(json.loads(json.dumps(crossing.encode(value))))


@pytest.mark.parametrize("cls", [nx.Graph, nx.DiGraph, nx.MultiGraph, nx.MultiDiGraph])
def test_graphs_cross_with_their_data_and_neighbour_order(cls):
    G = cls(name="g")
    G.add_node("z", colour="red")
    G.add_edge(2, 3, weight=1.5)
    G.add_edge(1, 3)
    G.add_edge((0, 1), 2, label={"a": [1, 2]})
    H = crossed(G)
    assert type(H) is cls and H.graph == {"name": "g"}
    assert list(H.nodes(data=True)) == list(G.nodes(data=True))
    assert [list(H.adj[n]) for n in H] == [list(G.adj[n]) for n in G]  # order kept: 3's neighbours are [2, 1]
    assert list(H.edges(data=True)) == list(G.edges(data=True))
    if G.is_directed():
        assert [list(H.pred[n]) for n in H] == [list(G.pred[n]) for n in G]
    # One attribute dict per edge, shared by its two directions as networkx keeps it.
    if not G.is_directed() and not G.is_multigraph():
        H[2][3]["weight"] = 7
        assert H[3][2]["weight"] == 7


def test_plain_values_cross_and_objects_do_not():
    value = {"a": (1, 2.5, float("inf")), 3: {frozenset({1}), None}, "r": range(2, 9, 3), "l": [True, b"\x00x", NotImplemented, ...]}
    assert crossed(value) == value
    moment = dt.datetime(2024, 2, 29, 13, 5, 7, 120, tzinfo=dt.timezone(dt.timedelta(hours=-3)))
    values = [moment, moment.replace(tzinfo=None), moment.date(), moment.time(), dt.timedelta(days=-2, microseconds=5)]
    values += [decimal.Decimal("1.10"), fractions.Fraction(-3, 4), pathlib.PurePosixPath("a/b"), uuid.UUID(int=7)]
    back = crossed(values)
    assert back == values and [type(v) for v in back] == [type(v) for v in values] and str(back[5]) == "1.10"

    class Anything:
        def __eq__(self, other):
            return True

    for bad in (Anything(), [Anything()], {1: object()}, nx.Graph().nodes, type):
        with pytest.raises(crossing.NotCrossable):
            crossing.encode(bad)
    with pytest.raises(ValueError):
        crossing.decode({"$pickle": "gASV"})
    with pytest.raises(ValueError):
        crossing.decode({"$graph": ["Evil", {}, [], [], None]})


def test_the_proxy_keeps_signature_and_decorators_and_sends_every_argument():
    source = (
        "import functools\n\n\n@functools.lru_cache\ndef f(a, /, b, *rest, c=1, **more):\n    '''doc'''\n    return a\n\n\n"
        "class K:\n    def m(self, x):\n        return x\n"
    )
    text = proxied(source, ("f", "K.m"), "pkg.mod")
    tree = ast.parse(text)
    f, k = tree.body[1], tree.body[2]
    assert [ast.unparse(d) for d in f.decorator_list] == ["functools.lru_cache"]
    assert ast.unparse(f.body[0]) == ("return __import__('_composer_crossing').call('pkg.mod', 'f', (a, b, *rest), {'c': c, **more})")
    assert ast.unparse(k.body[0].body[0]) == "return __import__('_composer_crossing').call('pkg.mod', 'K.m', (self, x), {})"
    assert module_name("src/tally/stats.py", "src") == "tally.stats" and module_name("networkx/__init__.py", "") == "networkx"


def test_a_call_crosses_with_mutations_callbacks_and_exceptions(tmp_path, monkeypatch):
    """The grader's `call` against `serve` over pipes: the episode's function runs on copies; what it returns, how it
    changed its arguments and the exceptions it raised come back as the grader's own values and types."""
    (tmp_path / "episode_mod.py").write_text(
        "import networkx as nx\nfrom networkx import NodeNotFound\n\n\n"
        "def grow(G, items, weight):\n"
        "    G.add_edge('a', 'b', w=weight('a', 'b', {}))\n"
        "    items.append(len(G))\n"
        "    return (x for x in sorted(G))\n\n\n"
        "def total(values):\n    return sum(values)\n\n\n"
        "def fail(n):\n    raise NodeNotFound(f'no {n}')\n\n\n"
        "def odd():\n    class Anything:\n        def __eq__(self, other):\n            return True\n    return Anything()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    asked, ask = os.pipe()  # the grader's channel
    heard, hear = os.pipe()  # the episode's call descriptor
    answered, answer = os.pipe()  # the episode's channel, read by the grader

    def host():
        """What the sandbox's session does with the grader's channel: CALL lines forwarded to the episode."""
        with os.fdopen(asked, "rb") as lines:
            for line in lines:
                assert line.startswith(b"CALL ")
                os.write(hear, line[5:])
        os.close(hear)

    threading.Thread(target=host, daemon=True).start()
    threading.Thread(target=crossing.serve, args=(heard, answer), daemon=True).start()
    crossing.connect(ask, answered)
    G, items = nx.Graph(), [0]
    result = crossing.call("episode_mod", "grow", (G, items, lambda u, v, d: 2.5), {})
    assert list(result) == ["a", "b"] and items == [0, 2] and G["a"]["b"] == {"w": 2.5}
    assert crossing.call("episode_mod", "total", ((n * n for n in range(4)),), {}) == 14  # a generator's values
    with pytest.raises(nx.NodeNotFound, match="no 7"):
        crossing.call("episode_mod", "fail", (7,), {})
    with pytest.raises(RuntimeError, match="cannot cross"):
        crossing.call("episode_mod", "odd", (), {})
    assert any(reason.startswith("result") for reason in crossing.refusals)


def _serve_over_pipes() -> None:
    """The grader's ends connected to an episode's `serve` in a thread, as the sandbox's session forwards them."""
    asked, ask = os.pipe()
    heard, hear = os.pipe()
    answered, answer = os.pipe()

    def host():
        with os.fdopen(asked, "rb") as lines:
            for line in lines:
                os.write(hear, line[5:])
        os.close(hear)

    threading.Thread(target=host, daemon=True).start()
    threading.Thread(target=crossing.serve, args=(heard, answer), daemon=True).start()
    crossing.connect(ask, answered)


SHAPES = """import enum


class Colour(enum.Enum):
    RED = 1
    BLUE = 2


class Key(tuple):
    pass


class Point:
    __slots__ = ("x", "y")

    def __init__(self, x, y):
        raise AssertionError("never run by the boundary")


class Bag:
    def __init__(self):
        self.items = []

    def add(self, item):
        self.items.append(item)
        self.count = len(self.items)
        return Key((item, self.count))


def filled(factory, kind):
    return type(factory()), kind


def counted(function_name):
    calls = []
    function = {"len": len, "sorted": sorted}[function_name]

    def wrapper(*args):
        calls.append(args)
        return function(*args), len(calls)

    return wrapper


def moved(point, dx):
    made = object.__new__(Point)
    made.x, made.y = point.x + dx, point.y
    return made, Colour.BLUE
"""


def test_objects_of_the_projects_own_classes_cross_as_their_state(tmp_path, monkeypatch):
    """What real projects pass and return (a class instance, a tuple subclass, an enum member, a method's `self`
    that the call changes) crosses as data: each side builds its own class's instance without its constructor."""
    (tmp_path / "shapes").mkdir()
    (tmp_path / "shapes" / "__init__.py").write_text(SHAPES)
    monkeypatch.syspath_prepend(str(tmp_path))
    import shapes

    _serve_over_pipes()
    point = object.__new__(shapes.Point)
    point.x, point.y = 1, 2
    result, colour = crossing.call("shapes", "moved", (point, 3), {})
    assert type(result) is shapes.Point and (result.x, result.y) == (4, 2) and colour is shapes.Colour.BLUE
    bag = shapes.Bag()
    key = crossing.call("shapes", "Bag.add", (bag, "a"), {})
    assert type(key) is shapes.Key and key == ("a", 1)
    assert bag.items == ["a"] and bag.count == 1  # the method's change of `self`, applied to the grader's object
    with pytest.raises(ValueError):  # a class outside the called function's package is not built
        crossing.decode({"$object": ["os", "PathLike", None, []]})
    # classes as arguments (`factory=OrderedDict`): builtin and `collections` ones, and the project's own
    assert crossing.call("shapes", "filled", (collections.OrderedDict, shapes.Bag), {}) == (collections.OrderedDict, shapes.Bag)
    assert crossing.call("shapes", "filled", (list, (ValueError, type(None))), {}) == (list, (ValueError, type(None)))
    with pytest.raises(RuntimeError, match="cannot cross"):
        crossing.call("shapes", "filled", (threading.Thread, dict), {})
    # a function the episode returns (a decorator's wrapper) stays there: each call of it crosses, its state kept
    wrapped = crossing.call("shapes", "counted", ("len",), {})
    assert wrapped("ab") == (2, 1) and wrapped([1, 2, 3]) == (3, 2)


HOSTILE_ANSWERS = {
    # exceptions pytest or the interpreter treat specially, named by the episode
    "raise SystemExit": b'{"raise": "SystemExit", "message": "0"}',
    "raise KeyboardInterrupt": b'{"raise": "KeyboardInterrupt"}',
    "raise pytest's Skipped": b'{"raise": "Skipped", "message": "skip me"}',
    "raise pytest's Exit": b'{"raise": "Exit"}',
    "raise GeneratorExit": b'{"raise": "GeneratorExit"}',
    "raise an exception the package only imports": b'{"raise": "SkipTest"}',
    # data the decoder must refuse or that cannot be built
    "nesting past the bound": b"[" * 5000 + b"]" * 5000,
    "tag nesting past the bound": b'{"return": ' + b'{"$tuple": [' * 300 + b"1" + b"]}" * 300 + b"}",
    "an unhashable key": b'{"return": {"$dict": [[[1], 2]]}}',
    "a graph edge to no node": b'{"return": {"$graph": ["Graph", {}, [], [[1, [[2, {}]]]], null]}}',
    "a class not of the list": b'{"return": {"$graph": ["OrderedGraph", {}, [], [], null]}}',
    "a pickle": b'{"return": {"$pickle": "gASVAAAAAAAAAAA="}}',
    "an integer of a million digits": b'{"return": ' + b"9" * 1_000_000 + b"}",
    "a bare NaN": b'{"return": NaN}',
    "not JSON": b"\xff\xfe garbage",
    "a list": b"[1, 2]",
    # objects, classes and values named by the episode
    "an object of a class outside the package": b'{"return": {"$object": ["os", "PathLike", null, []]}}',
    "a class the package only imports": b'{"return": {"$type": ["networkx", "SkipTest"]}}',
    "an exception object built without its constructor": b'{"return": {"$object": ["networkx", "NetworkXError", null, []]}}',
    "an object whose state names its type": b'{"return": {"$object": ["networkx.classes.graph", "Graph", null, [["__class__", {"$type": ["networkx.classes.digraph", "DiGraph"]}]]]}}',
    "an enum member of no enum": b'{"return": {"$enum": ["networkx", "Graph", "RED"]}}',
    "a malformed date": b'{"return": {"$value": ["datetime", "yesterday"]}}',
    # the protocol misused
    "a callback never passed": b'{"callback": 3, "args": {"$tuple": []}, "kwargs": {"$dict": []}}',
    "an argument turned into another type": b'{"return": 1, "changed": {"0": "now a string"}}',
    "a mutation of an argument not passed": b'{"return": 1, "changed": {"nope": [1]}}',
    "no return": b'{"changed": {}}',
}


@pytest.mark.parametrize("answer", HOSTILE_ANSWERS.values(), ids=list(HOSTILE_ANSWERS))
def test_whatever_the_episode_answers_the_grader_raises_an_ordinary_exception(answer):
    """The episode's process is hostile: its answer line, however shaped, makes the proxy in the grader either return
    plain data or raise an `Exception` the test then fails on: never an exception pytest treats as a skip or an exit,
    never one that stops the grader, never an object of the episode's."""
    asked, ask = os.pipe()
    answered, reply = os.pipe()

    def episode():
        with os.fdopen(asked, "rb") as lines:
            for _ in lines:
                os.write(reply, answer + b"\n")

    threading.Thread(target=episode, daemon=True).start()
    crossing.connect(ask, answered)
    nx.SkipTest = unittest.SkipTest  # as a package that imports it into its namespace would hold it
    items = [0]
    try:
        with pytest.raises(Exception) as raised:
            crossing.call("networkx", "is_empty", (items,), {})
    finally:
        os.close(ask)
        del nx.SkipTest
    assert type(raised.value).__module__ in ("builtins", "json.decoder") and items == [0], repr(raised.value)
