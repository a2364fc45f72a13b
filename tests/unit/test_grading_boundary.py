"""The grading boundary's two sides without a sandbox: what crosses (data only, decoded into this side's own types),
the grader's proxies, and a call answered by the episode's side over a pair of pipes."""

from __future__ import annotations

import ast
import collections
import datetime as dt
import decimal
import fractions
import json
import math
import operator
import os
import pathlib
import shutil
import sys
import threading
import types
import unittest
import uuid
import warnings

import networkx as nx
import pytest

from composer.rollout.tasks.repository import crossing
from composer.rollout.tasks.repository.boundary import crossing_text, module_name, proxied


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
    packages = ("src/tally", "networkx", "lib/other")  # each file resolves against the package that holds it
    assert module_name("src/tally/stats.py", packages) == "tally.stats" and module_name("networkx/__init__.py", packages) == "networkx"
    assert module_name("lib/other/sub/core.py", packages) == "other.sub.core"
    with pytest.raises(ValueError, match="in none of the packages"):
        module_name("tools/helper.py", packages)


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
        "def odd():\n    class Anything:\n        def __eq__(self, other):\n            return True\n    return Anything()\n\n\n"
        "def kind():\n    class Anything:\n        pass\n    return Anything\n"
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
    # an object of a class the episode made stays there: the grader's stand-in never runs its `__eq__`
    odd = crossing.call("episode_mod", "odd", (), {})
    assert type(odd) is crossing.EpisodeObject and odd != 1 and not odd == "anything"  # noqa: SIM201
    with pytest.raises(RuntimeError, match="cannot cross"):  # and a class it made does not cross
        crossing.call("episode_mod", "kind", (), {})
    assert any(reason.startswith("result") for reason in crossing.refusals)


def _relay(asked: int, hear: int) -> None:
    """The host between the two sides: each `CALL {json}` line the grader writes goes to the episode as `{json}`."""
    with os.fdopen(asked, "rb") as lines:
        for line in lines:
            os.write(hear, line[5:])
    os.close(hear)


def _serve_over_pipes() -> None:
    """The grader's ends connected to an episode's `serve` in a thread, as the sandbox's session forwards them."""
    asked, ask = os.pipe()
    heard, hear = os.pipe()
    answered, answer = os.pipe()

    threading.Thread(target=_relay, args=(asked, hear), daemon=True).start()
    threading.Thread(target=crossing.serve, args=(heard, answer), daemon=True).start()
    crossing.connect(ask, answered)


SHAPES = """import collections
import collections.abc
import datetime
import enum


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

    wrapper.calls = calls
    wrapper.info = lambda: {"calls": len(calls)}
    return wrapper


def moved(point, dx):
    made = object.__new__(Point)
    made.x, made.y = point.x + dx, point.y
    return made, Colour.BLUE


_Info = collections.namedtuple("Info", ["hits", "misses"])  # bound to another name than its own, as cachetools' CacheInfo


def info(hits):
    return _Info(hits, 0)


class ShapeWarning(UserWarning):
    pass


def old_area(side):
    import warnings

    warnings.warn("old_area is deprecated", DeprecationWarning)
    warnings.warn("sides are rounded", ShapeWarning)
    return side * side


_MISSING = object()


def pick(value=_MISSING):
    return "missing" if value is _MISSING else value


class Mark:
    pass


Mark.END = Mark()


def after_last(mark):
    return Mark.END if mark is not Mark.END else None


def arity(function):
    import inspect
    import operator

    known = {all: "all", operator.add: "add", str.upper: "upper"}
    return known.get(function, "unknown"), len(inspect.signature(function).parameters)


def file_under(index, key, item):
    index[key].append(item)
    return index[key]


class ShapeError(ValueError):
    def __init__(self, line, col, message=None):
        self.line, self.col = line, col
        super().__init__(message or f"bad shape at {line}:{col}")


def parse_shape(text):
    raise ShapeError(1, len(text))


def plain_failure(text):
    raise Exception(text)


def stamp_of(moment):
    return type(moment).__name__, moment.isoformat()


def validate_shapes(texts):
    raise ExceptionGroup("invalid shapes", [ShapeError(i, len(t)) for i, t in enumerate(texts)] + [KeyError("none")])


class Stamp(datetime.datetime):  # a value class of the package's (tomlkit's DateTime), its constructor not the base's
    def __new__(cls, year, month, day, raw):
        made = datetime.datetime.__new__(cls, year, month, day)
        made.raw = raw
        return made

    def isoformat(self):
        raise AssertionError("never run by the boundary")


def next_day(stamp):
    return Stamp(stamp.year, stamp.month, stamp.day + 1, stamp.raw + "+1")


class Row(list):  # assignment is the project's behaviour (tomlkit's Array), not how its state is set
    def __setitem__(self, index, value):
        raise NotImplementedError("rows are appended to")

    def add(self, item):
        list.append(self, item)
        self.size = len(self)
        return self

    def __iter__(self):  # (a MutableSequence's iteration, through the class's own `__getitem__`)
        return iter(["not", "the", "items"])

    @classmethod
    def of(cls, *items):
        made = cls()
        list.extend(made, items)
        return made

    @staticmethod
    def width(item):
        return len(str(item))

    @property
    def first(self):
        return list.__getitem__(self, 0)

    @first.setter
    def first(self, value):
        list.__setitem__(self, 0, value)


def keys_of(mapping):
    if not isinstance(mapping, collections.abc.Mapping):
        raise TypeError("a mapping is wanted")
    return sorted(mapping.keys()), dict(mapping), mapping.get("zz", "none")
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
    items = bag.items
    key = crossing.call("shapes", "Bag.add", (bag, "a"), {})
    assert type(key) is shapes.Key and key == ("a", 1)
    assert bag.items == ["a"] and bag.count == 1  # the method's change of `self`, applied to the grader's object
    assert bag.items is items  # in place, at any depth: what the test (or an item's parent) holds sees the change
    # the package's constants are each side's own (a default argument's sentinel, a class's end marker): `is` holds
    assert crossing.call("shapes", "pick", (shapes._MISSING,), {}) == "missing"
    assert crossing.call("shapes", "after_last", (shapes.Mark(),), {}) is shapes.Mark.END
    assert crossing.call("shapes", "after_last", (shapes.Mark.END,), {}) is None
    # the pure standard library's functions are each side's own: identity and signatures hold there
    assert [crossing.call("shapes", "arity", (f,), {}) for f in (all, operator.add, str.upper)] == [("all", 1), ("add", 2), ("upper", 1)]
    assert crossing.call("shapes", "arity", (math.floor,), {}) == ("unknown", 1)
    inner = ["x"]
    index = {"a": inner, "b": (inner,)}
    assert crossing.call("shapes", "file_under", (index, "a", "y"), {}) is inner
    assert index == {"a": ["x", "y"], "b": (["x", "y"],)} and index["a"] is inner and index["b"][0] is inner
    # the warnings the call issues there are issued here, in their categories (a test's catch_warnings sees them)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert crossing.call("shapes", "old_area", (3,), {}) == 9
    assert [(w.category, str(w.message)) for w in caught] == [
        (DeprecationWarning, "old_area is deprecated"),
        (shapes.ShapeWarning, "sides are rounded"),
    ]
    # a class bound under another name than its own (a namedtuple made by a factory) is found by that name
    assert crossing.call("shapes", "info", (3,), {}) == (3, 0) and type(crossing.call("shapes", "info", (3,), {})) is shapes._Info
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
    # and its public attributes are read there (cachetools' `cache_info()`), as data or as its other functions
    assert wrapped.calls == [("ab",), ([1, 2, 3],)] and wrapped.info() == {"calls": 2}
    with pytest.raises(AttributeError):
        getattr(wrapped, "__closure__")  # noqa: B009
    # the package's exception, with the arguments and attributes the episode's had (its constructor takes others)
    with pytest.raises(shapes.ShapeError, match="bad shape at 1:3") as raised:
        crossing.call("shapes", "parse_shape", ("abc",), {})
    assert type(raised.value) is shapes.ShapeError and (raised.value.line, raised.value.col) == (1, 3)
    with pytest.raises(Exception) as plain:  # noqa: PT011 (a plain Exception's message, as it was)
        crossing.call("shapes", "plain_failure", ("cannot parse",), {})
    assert type(plain.value) is Exception and str(plain.value) == "cannot parse"
    # a value class's subclass from outside the package (freezegun's FakeDatetime) crosses as its value

    class Frozen(dt.datetime):
        pass

    assert crossing.call("shapes", "stamp_of", (Frozen(2010, 2, 2),), {}) == ("datetime", "2010-02-02T00:00:00")
    with pytest.raises(ExceptionGroup, match="invalid shapes") as group:  # (packaging's metadata validation)
        crossing.call("shapes", "validate_shapes", (["ab", "c"],), {})
    assert [(type(e), getattr(e, "col", None)) for e in group.value.exceptions] == [
        (shapes.ShapeError, 2),
        (shapes.ShapeError, 1),
        (KeyError, None),
    ]
    # a class of the package derived from a value class: its base's value and its attributes
    after = crossing.call("shapes", "next_day", (shapes.Stamp(2024, 2, 28, "a"),), {})
    assert type(after) is shapes.Stamp and dt.datetime.__repr__(after) == "Stamp(2024, 2, 29, 0, 0)" and after.raw == "a+1"
    # a list subclass whose assignment raises, changed by its method and returned: the grader's own object, changed
    row = shapes.Row([1])
    assert crossing.call("shapes", "Row.add", (row, 5), {}) is row and list(list.__iter__(row)) == [1, 5] and row.size == 2
    # a classmethod's proxy passes its class; a staticmethod's does not
    made = crossing.call("shapes", "Row.of", (shapes.Row, 1, 2), {})
    assert type(made) is shapes.Row and list(list.__iter__(made)) == [1, 2]
    assert crossing.call("shapes", "Row.width", (123,), {}) == 3
    # a property's getter and setter (the proxies keep `@property` and `@first.setter`)
    assert crossing.call("shapes", "Row.first", (made,), {}) == 1
    crossing.call("shapes", "Row.first", (made, 7), {})
    assert list(list.__iter__(made)) == [7, 2]
    # an object the grader keeps is a Mapping in the episode when it is one here; its methods are its own
    proxy = types.MappingProxyType({"b": 1, "a": 2})
    assert crossing.call("shapes", "keys_of", (proxy,), {}) == (["a", "b"], {"b": 1, "a": 2}, "none")
    with pytest.raises(TypeError, match="a mapping is wanted"):
        crossing.call("shapes", "keys_of", (iter([1]),), {})


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
    "a reference never given, used": b'{"ref": 1000000000, "op": "call", "args": [], "kwargs": {"$dict": []}}',
    "a reference never given, returned": b'{"return": {"$ref": 1000000000}}',
    "an operation not of the list": b'{"ref": 0, "op": "globals", "args": [], "kwargs": {"$dict": []}}',
    "a back-reference to nothing met": b'{"return": [{"$same": 5}]}',
    "an argument turned into another type": b'{"return": 1, "after": {"args": ["now a string"], "kwargs": {}}}',
    "an argument said to be another structure": b'{"return": 1, "after": {"args": [{"$was": [0, {"$dict": []}]}], "kwargs": {}}}',
    "a structure never sent, said changed": b'{"return": {"$was": [99, [1]]}}',
    "a function named as a constant": b'{"return": {"$named": ["networkx", "is_empty"]}}',
    "a module named as a constant": b'{"return": {"$named": ["networkx", "utils"]}}',
    "a constant outside the package": b'{"return": {"$named": ["os", "environ"]}}',
    "a system function by name": b'{"return": {"$std": ["posix", "system"]}}',
    "a builtin that reaches names": b'{"return": {"$std": ["builtins", "getattr"]}}',
    "a private name of a pure module": b'{"return": {"$std": ["operator", "_abs"]}}',
    "a dunder of a builtin class": b'{"return": {"$std": ["builtins", "object.__subclasses__"]}}',
    "a name a pure module lacks": b'{"return": {"$std": ["math", "nothing"]}}',
    "a mutation of an argument not passed": b'{"return": 1, "after": {"args": [[0]], "kwargs": {"nope": [1]}}}',
    "no return": b'{"changed": {}}',
    # warnings the episode says the call issued
    "a warning whose class is no warning": b'{"return": 1, "warnings": [["networkx.classes.graph:Graph", "x"]]}',
    "a warning of a class outside the package": b'{"return": 1, "warnings": [["os:PathLike", "x"]]}',
    "a warning named as an exit": b'{"return": 1, "warnings": [["SystemExit", "x"]]}',
    "a malformed warning": b'{"return": 1, "warnings": [[1, 2]]}',
    "an exception group of exits": b'{"raise": "ExceptionGroup", "message": "g", "group": [{"raise": "SystemExit"}, {"raise": "Skipped"}]}',
    "exception groups nested deep": b'{"raise": "ExceptionGroup", "group": [' * 50 + b'{"raise": "ValueError"}' + b"]}" * 50,
    "an empty exception group": b'{"raise": "ExceptionGroup", "message": "g", "group": []}',
    # exceptions of the package named with their state
    "an exception's class outside the package": b'{"raise": "Exit", "class": ["_pytest.outcomes", "Exit"], "state": {"args": [], "attributes": []}}',
    "an exception's class that is no exception": b'{"raise": "Graph", "class": ["networkx.classes.graph", "Graph"], "state": {"args": [], "attributes": []}}',
    "an exception's state naming its type": b'{"raise": "NetworkXError", "class": ["networkx.exception", "NetworkXError"], "state": {"args": [], "attributes": [["__class__", {"$type": ["builtins", "SystemExit"]}]]}}',
    "an exception's malformed arguments": b'{"raise": "NetworkXError", "class": ["networkx.exception", "NetworkXError"], "state": {"args": {"$pickle": "x"}, "attributes": []}}',
    "a reference in the grader's form, returned": b'{"return": {"$ref": [0, ["Mapping"]]}}',
    "more warnings than the bound": b'{"return": 1, "warnings": [' + b",".join([b'["UserWarning", "x"]'] * 21) + b"]}",
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


def test_shared_structures_and_cycles_cross_as_one_graph():
    """An item and its parent container (tomlkit's), a list passed twice, a dict holding itself: each structure is
    sent once and met again by number, so the other side gets the same shape, back-references kept."""
    shared = [1, 2]
    value = crossed({"a": shared, "b": (shared, [shared])})
    assert value == {"a": [1, 2], "b": ([1, 2], [[1, 2]])} and value["a"] is value["b"][0] is value["b"][1][0]
    looped = {"name": "root", "children": []}
    looped["children"].append({"name": "leaf", "parent": looped})
    back = crossed(looped)
    assert back["children"][0]["parent"] is back and back["children"][0]["name"] == "leaf"
    chain = [0]
    for _ in range(300):
        chain = [chain]
    with pytest.raises(crossing.NotCrossable, match="nesting"):  # the depth bound holds for what does not repeat
        crossing.encode(chain)


TREES = """class Node:
    def __init__(self, name, parent=None):
        self.name, self.parent, self.children = name, parent, []
        if parent is not None:
            parent.children.append(self)


def adopt(parent, name):
    child = object.__new__(Node)
    child.name, child.parent, child.children = name, parent, []
    parent.children.append(child)
    return child
"""


def test_objects_with_back_references_cross_and_come_back_whole(tmp_path, monkeypatch):
    (tmp_path / "trees").mkdir()
    (tmp_path / "trees" / "__init__.py").write_text(TREES)
    monkeypatch.syspath_prepend(str(tmp_path))
    import trees

    _serve_over_pipes()
    root = trees.Node("root")
    for i in range(300):  # deeper than the nesting bound as a chain of parents, shallow as a graph
        trees.Node(f"c{i}", root)
    child = crossing.call("trees", "adopt", (root,), {"name": "new"})
    assert child.parent is root and root.children[-1] is child and len(root.children) == 301
    assert all(c.parent is root for c in root.children)


REFERENCES = """import copy


def lookup(mapping, keys, default):
    found = [mapping[k] if k in mapping else default for k in keys]
    return found, len(mapping), sorted(mapping), mapping == {"a": 1, "b": 2}, default


def take(iterator, n):
    return [next(iterator) for _ in range(n)]


def draw(rng, n):
    return [rng.randint(0, 100) for _ in range(n)]


def fill(factory, items):
    made = factory()
    for k, v in items:
        made[k].append(v)
    return made


def compare(a, b):
    try:
        return a == b, hash(a) == hash(b), a < b
    except TypeError as e:
        return "TypeError", str(e)


def parameters(signature):
    return [(name, p.kind.name, p.default is p.empty) for name, p in signature.parameters.items()]


def give_back(obj):
    return {"same": obj, "copy": copy.copy(obj)}


def apply(function, value):
    return function(value) + 1
"""


class CustomMapping(dict):
    """As toolz's tests define one: a mapping the function must keep using as given."""

    def __getitem__(self, key):
        return dict.__getitem__(self, key) * 10


class NoCompare:
    def __eq__(self, other):
        raise TypeError("NoCompare cannot be compared")

    __hash__ = object.__hash__


def test_the_graders_objects_cross_by_reference_and_answer_in_the_grader(tmp_path, monkeypatch):
    """What the tests pass that is not data (their own classes, `object()` sentinels, `random.Random`, iterators,
    `defaultdict` factories, `inspect.Signature`) stays in the grader: the episode's function uses it across the
    boundary, the grader's object answers, and what the episode gives back is the grader's own object."""
    import inspect
    import itertools
    import random

    (tmp_path / "uses.py").write_text(REFERENCES)
    monkeypatch.syspath_prepend(str(tmp_path))
    _serve_over_pipes()
    sentinel = object()
    found, size, keys, equal, default = crossing.call("uses", "lookup", (CustomMapping(a=1, b=2), ["a", "z"], sentinel), {})
    assert found[0] == 10 and found[1] is sentinel and default is sentinel  # the grader's __getitem__, its own object
    assert (size, keys, equal) == (2, ["a", "b"], True)
    counter = itertools.count(5)
    assert crossing.call("uses", "take", (counter, 3), {}) == [5, 6, 7] and next(counter) == 8  # consumed here
    rng, same = random.Random(4), random.Random(4)
    assert crossing.call("uses", "draw", (rng, 5), {}) == [same.randint(0, 100) for _ in range(5)]
    assert rng.random() == same.random()  # the grader's generator advanced by the episode's draws
    made = crossing.call("uses", "fill", (lambda: collections.defaultdict(list), [("a", 1), ("a", 2)]), {})
    assert type(made) is collections.defaultdict and made == {"a": [1, 2]}
    assert crossing.call("uses", "compare", (NoCompare(), 1), {}) == ("TypeError", "NoCompare cannot be compared")
    signature = inspect.signature(lambda a, *, b=2: None)
    assert crossing.call("uses", "parameters", (signature,), {}) == [("a", "POSITIONAL_OR_KEYWORD", True), ("b", "KEYWORD_ONLY", False)]
    mapping = CustomMapping(a=1)
    back = crossing.call("uses", "give_back", (mapping,), {})
    assert back["same"] is mapping and type(back["copy"]) is CustomMapping and back["copy"] is not mapping
    assert crossing.call("uses", "apply", (len, "abc"), {}) == 4


WALKS = """def walk(obj, *steps):
    value = obj
    for step in steps:
        value = value() if step == "()" else getattr(value, step)
    return value


def swallow(obj):
    try:
        obj.check()
    except BaseException as e:
        return "swallowed " + type(e).__name__
    return "nothing"


def plant(obj):
    class Anything:
        def __eq__(self, other):
            return True

    obj.expected = Anything()
"""


def _outcome_failure():
    pytest.fail("the grader's own object fails the test")


class Holder:
    """What a test might pass, with a public surface that leads to what the episode must never reach."""

    def __init__(self):
        self.module, self.run, self.getter, self.check = os, os.system, getattr, _outcome_failure
        self.generator = (i for i in range(3))
        self._secret = "hidden"
        self.expected = 1

    def method(self):
        return "ok"


class SomeTest(unittest.TestCase):
    def runTest(self):
        pass


@pytest.mark.parametrize(
    "steps",
    [
        ("__dict__",),
        ("__class__",),
        ("_secret",),
        ("method", "__globals__"),
        ("method", "__self__"),
        ("module",),
        ("run",),
        ("getter",),
        ("generator", "gi_frame"),
        ("generator", "gi_code"),
        ("check", "__globals__"),
        ("method", "__func__"),
    ],
)
def test_the_episode_walking_a_reference_gets_an_ordinary_exception_and_nothing_else(tmp_path, monkeypatch, steps):
    """The episode may use only a reference's public surface, and what it gets back crosses by the same rules: no
    `_` name, no module, frame or code, no function of the interpreter's or the system's. However it walks, the call
    ends in an exception of the grader's builtins (refused uses counted as refusals), never with anything reached."""
    (tmp_path / "walker.py").write_text(WALKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    _serve_over_pipes()
    holder = Holder()
    assert crossing.call("walker", "walk", (holder, "method", "()"), {}) == "ok"  # the public surface answers
    with pytest.raises(Exception) as raised:
        crossing.call("walker", "walk", (holder, *steps), {})
    assert type(raised.value).__module__ == "builtins", repr(raised.value)
    assert holder._secret == "hidden" and holder.module is os


def test_the_grader_keeps_its_outcomes_and_takes_no_object_of_the_episodes(tmp_path, monkeypatch):
    (tmp_path / "walker.py").write_text(WALKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    _serve_over_pipes()
    holder = Holder()
    # the grader's object fails the test: the episode catching it does not keep it from the test
    with pytest.raises(pytest.fail.Exception, match="fails the test"):
        crossing.call("walker", "swallow", (holder,), {})
    # an always-equal object of the episode's set on the grader's object: a stand-in there, which equals nothing
    crossing.call("walker", "plant", (holder,), {})
    assert type(holder.expected) is crossing.EpisodeObject
    assert holder.expected != 1 and not holder.expected == holder.expected.__class__  # noqa: SIM201
    # a test case (its assertions, its outcome) is never given, even by reference
    with pytest.raises(RuntimeError, match="cannot cross"):
        crossing.call("walker", "walk", (SomeTest(),), {})


READS = """import os
import platform
import sys


def environment():
    return platform.mac_ver()[0], os.environ.get("CROSSING_PATCHED"), sys.implementation.name
"""


def _serve_in_a_process(root, python=None):
    """The episode's side as its own process (`python -c <codec and crossing> ROOT`, descriptors 4 in and 3 out), as
    the sandbox starts it: what the grader's process patches is not patched there unless the call carries it."""
    import subprocess

    asked, ask = os.pipe()
    heard, hear = os.pipe()
    answered, answer = os.pipe()
    program = f"import os\nos.dup2({heard}, 4)\nos.dup2({answer}, 3)\nexec(compile({crossing_text()!r}, 'crossing', 'exec'))"
    episode = subprocess.Popen([python or sys.executable, "-c", program, str(root)], pass_fds=(heard, answer))
    os.close(heard)
    os.close(answer)

    threading.Thread(target=_relay, args=(asked, hear), daemon=True).start()
    crossing.connect(ask, answered)
    return episode, ask


def test_the_tests_monkeypatches_hold_in_the_episodes_process_during_each_call(tmp_path):
    """packaging's tests patch `platform.mac_ver`, `sys.implementation` and the environment: the call carries the
    patches in force, the episode's process makes them for the call (a patched function is called back in the
    grader) and undoes them after."""
    import platform
    import sys
    import types

    (tmp_path / "reads.py").write_text(READS)
    episode, ask = _serve_in_a_process(tmp_path)
    try:
        unpatched = crossing.call("reads", "environment", (), {})
        assert unpatched == (platform.mac_ver()[0], None, sys.implementation.name)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(platform, "mac_ver", lambda: ("10.15", ("", "", ""), "x86_64"))
            patch.setattr(sys, "implementation", types.SimpleNamespace(name="pypy"))
            patch.setenv("CROSSING_PATCHED", "yes")
            assert crossing.call("reads", "environment", (), {}) == ("10.15", "yes", "pypy")
        assert crossing.call("reads", "environment", (), {}) == unpatched  # undone in both processes
    finally:
        os.close(ask)
        episode.wait(timeout=30)


def test_a_time_frozen_by_freezegun_in_the_grader_is_frozen_for_the_call(monkeypatch):
    """freezegun patches the grader's modules itself (not through pytest's monkeypatch): the frozen moment goes with
    each call and the episode's process freezes the same one while the call runs."""
    from tests.helpers.user_corpus import CACHE

    wheels = sorted((CACHE / "wheels").glob("*.whl"))
    for name in ("freezegun", "python_dateutil", "six"):  # pure-Python wheels import from the archive
        monkeypatch.syspath_prepend(str(next((w for w in wheels if w.name.startswith(name)), CACHE)))
    freezegun = pytest.importorskip("freezegun", reason="the user-project corpus (scripts/setup.sh) holds freezegun")
    assert crossing._frozen_time() is None
    with freezegun.freeze_time("2010-03-02 10:00", tz_offset=-5):
        assert crossing._frozen_time() == ["2010-03-02T10:00:00", -18000.0]
        frozen = {"frozen": crossing._frozen_time()}
    try:
        for _ in range(2):  # one freezer, kept while the moment holds
            crossing._patch(frozen, [])
            assert dt.date.today() == dt.date(2010, 3, 2) and dt.datetime.now() == dt.datetime(2010, 3, 2, 5, 0)
        held = crossing._episode["frozen"][1]
        crossing._patch(frozen, [])
        assert crossing._episode["frozen"][1] is held
    finally:
        crossing._patch({}, [])  # a call with no time frozen
    assert dt.date.today() != dt.date(2010, 3, 2) and crossing._episode["frozen"] is None


def _older_python():
    """An interpreter older than 3.11 that runs here (a pyenv shim of a version not selected does not), or None."""
    import subprocess

    for name in ("python3.10", "python3.9"):
        path = shutil.which(name)
        check = [path, "-c", "import sys; assert sys.version_info < (3, 11)"] if path else None
        if check and subprocess.run(check, capture_output=True).returncode == 0:
            return path
    return None


OLDER_PYTHON = _older_python()


@pytest.mark.skipif(OLDER_PYTHON is None, reason="no Python 3.9 or 3.10 on this machine")
def test_the_episodes_side_runs_on_a_projects_older_python(tmp_path):
    """A project's interpreter (`projects[].python`) may predate 3.11: the episode's side names nothing newer
    (`ExceptionGroup` only where the interpreter has it), so its answers and the package's exceptions still cross."""
    (tmp_path / "older.py").write_text(
        "class OlderError(ValueError):\n    def __init__(self, line):\n        self.line = line\n"
        "        super().__init__(f'at {line}')\n\n\ndef fail(line):\n    raise OlderError(line)\n\n\n"
        "def twice(x):\n    return [x, x]\n"
    )
    sys.path.insert(0, str(tmp_path))
    episode, ask = _serve_in_a_process(tmp_path, OLDER_PYTHON)
    try:
        import older

        assert crossing.call("older", "twice", ((1, "a"),), {}) == [(1, "a"), (1, "a")]
        with pytest.raises(older.OlderError, match="at 7") as raised:
            crossing.call("older", "fail", (7,), {})
        assert raised.value.line == 7
    finally:
        sys.path.remove(str(tmp_path))
        os.close(ask)
        episode.wait(timeout=30)
