"""Pickles that cost far more than their length, or change the stand-ins later pickles use (issue 14, defects 3
and 4; see hostile_support).

A pickle's memo lets a few bytes name one object many times, so ~1 KB describes a tree of 2**40 objects (a
"billion laughs"): a deeply shared tuple used as a dict key (hashing it), torch.device (a stand-in for str) over
a shared list (printing it), a shared dict that the readers flatten into names. Each must be refused at once,
in safe_pickle, in a torch .bin and in a DCP .metadata. Keys of one hash value (numbers and tuples of them, whose
hashes a pickle can choose) make filling a dict or set quadratic: past a limit per dict they are refused before they
are inserted. And a BUILD opcode must not rewrite a stand-in that every later load shares (the
torch.float8_e4m3fn dtype), nor any object the pickle did not create as a record.
"""

from __future__ import annotations

import collections
import copyreg
import io
import itertools
import math
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch  # a dev dependency: the seeds are made by torch itself
from hostile_support import FUZZ, copy_dcp, load_metadata, outcome, run_bounded, save_metadata, torch_zip
from hypothesis import event, example, given, target
from hypothesis import strategies as st

import tensormorph as tm
from tensormorph import pickle_work, safe_pickle, torchzip
from tensormorph.errors import HeaderError
from tensormorph.formats import dcp_metadata, megatron
from tensormorph.formats.deepspeed import states as deepspeed_states

pytestmark = pytest.mark.timeout(120)

EXPANDS = "expands to more than"
SECONDS, GROWN_MIB = 2, 200  # the bound on each refusal, measured in a child process


# ---------------------------------------------------------------------------
# the three shapes, as objects with 41 distinct parts that the pickler writes once each
# ---------------------------------------------------------------------------


def shared_tuple(depth: int = 40) -> Any:
    node: Any = 0
    for _ in range(depth):
        node = (node, node)
    return node


def shared_list(depth: int = 40) -> Any:
    node: Any = []
    for _ in range(depth):
        node = [node, node]
    return node


def shared_dict(depth: int = 40) -> Any:
    node: Any = {"leaf": 0}
    for _ in range(depth):
        node = {"a": node, "b": node}
    return node


class Filled:
    """Pickles as collections.OrderedDict() filled with `items` by SETITEMS: a dict whose key this process never
    builds (hashing a deeply shared tuple here would hang the test itself)."""

    def __init__(self, items: list[tuple[Any, Any]]):
        self.items = items

    def __reduce__(self) -> tuple:
        return collections.OrderedDict, (), None, None, iter(self.items)


class Call:
    """Pickles as a call of the global `func` with `args`, then a BUILD of `state` when one is given."""

    def __init__(self, func: Any, args: tuple, state: Any = None):
        self.func, self.args, self.state = func, args, state

    def __reduce__(self) -> tuple:
        return (self.func, self.args) if self.state is None else (self.func, self.args, self.state)


SHAPES = {
    "shared tuple as a dict key": lambda str_stand_in: Filled([(shared_tuple(), 1)]),
    "str stand-in over a shared list": lambda str_stand_in: Call(str_stand_in, (shared_list(),)),
    "shared dict": lambda str_stand_in: shared_dict(),
}


def refused_in_bounds(action: str) -> str:
    """Run `action` in a child process within the time and memory bounds (imports warmed first); the text of the
    HeaderError it must raise."""
    imports = "import tensormorph as tm\nfrom tensormorph import safe_pickle, torchzip"
    result = run_bounded(f"{imports}\n# measure\n{imports}\n{action}\n", seconds=SECONDS, grown_mib=GROWN_MIB)
    assert result is not None and result[0] == "HeaderError", result
    return result[1]


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_shared_objects_are_refused_by_safe_pickle(shape: str) -> None:
    payload = pickle.dumps(SHAPES[shape](torch.device), protocol=2)
    assert len(payload) < 1500
    message = refused_in_bounds(
        f"safe_pickle.loads({payload!r}, torchzip._tensor_globals(lambda *args: None), file='x.pkl')")
    assert message.startswith("x.pkl: pickle " + EXPANDS), message


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_shared_objects_in_a_torch_file_are_refused(tmp_path: Path, shape: str) -> None:
    path = tmp_path / "pytorch_model.bin"
    torch.save({"w": torch.arange(4, dtype=torch.float32), "evil": SHAPES[shape](torch.device)}, path)
    assert path.stat().st_size < 4096
    message = refused_in_bounds(f"tm.open({str(path)!r})")
    assert message.startswith(f"{path}: pickle {EXPANDS}"), message


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_shared_objects_in_dcp_metadata_are_refused(dcp_seed: Path, tmp_path: Path, shape: str) -> None:
    folder = copy_dcp(dcp_seed, tmp_path / "ckpt")
    metadata = load_metadata(folder)
    # torch.serialization._get_layout is the DCP reader's str stand-in; planner_data is flattened into names
    metadata.planner_data = {"evil": SHAPES[shape](torch.serialization._get_layout)}
    save_metadata(folder, metadata)
    message = refused_in_bounds(f"tm.open({str(folder)!r})")
    assert message.startswith(f"{folder / '.metadata'}: pickle {EXPANDS}"), message


DOUBLED_TUPLE = b"K\x00" + b"2\x86" * 40  # DUP, TUPLE2: each level holds the one below twice (2**41 objects)
HASHED = {  # every way a pickle hashes a key or member
    "SETITEM": b"\x80\x02}" + DOUBLED_TUPLE + b"K\x01s.",
    "SETITEMS": b"\x80\x02}(" + DOUBLED_TUPLE + b"K\x01u.",
    "DICT": b"\x80\x02(" + DOUBLED_TUPLE + b"K\x01d.",
    "ADDITEMS": b"\x80\x04\x8f(" + DOUBLED_TUPLE + b"\x90.",
    "FROZENSET": b"\x80\x04(" + DOUBLED_TUPLE + b"\x91.",
    "builtins.set": b"\x80\x02cbuiltins\nset\n" + DOUBLED_TUPLE + b"\x85\x85R.",
}


def test_a_shared_tuple_is_never_hashed() -> None:
    """A tuple shared through DUP (not the memo) as a dict key or set member, by each opcode that hashes."""
    code = f"""from tensormorph import safe_pickle
from tensormorph.errors import HeaderError
# measure
from tensormorph import safe_pickle
from tensormorph.errors import HeaderError
for name, payload in {HASHED!r}.items():
    try:
        safe_pickle.loads(payload)
    except HeaderError as error:
        assert "{EXPANDS}" in str(error), (name, error)
    else:
        raise AssertionError(name)
"""
    assert run_bounded(code, seconds=SECONDS, grown_mib=GROWN_MIB) is None


def test_expansion_refusal_is_exact_at_the_limit() -> None:
    """A tuple of 1024 objects referred to 1024 times expands to 2**20 + 1 objects, one past the limit of a
    short pickle; with one reference fewer (and 1023 more integers written out) it reaches the limit exactly."""
    part = tuple(range(1023))
    over, at = [part] * 1024, [part] * 1023 + list(range(1023))
    for value, size in ((over, 1 + 1024 * 1024), (at, 1 + 1023 * 1024 + 1023)):
        payload = pickle.dumps(value, protocol=4)
        assert safe_pickle.MAX_EXPANSION_PER_BYTE * len(payload) < safe_pickle.MIN_EXPANSION_BUDGET
        result = outcome(lambda payload=payload: safe_pickle.loads(payload, file="x.pkl"))
        if size > safe_pickle.MIN_EXPANSION_BUDGET:
            assert type(result) is HeaderError and EXPANDS in str(result), result
        else:
            assert result == value


# ---------------------------------------------------------------------------
# random shared DAGs: the unpickler reads them exactly, or refuses exactly those that expand too far
# ---------------------------------------------------------------------------


integers = st.lists(st.integers(-300, 300), max_size=3)
references = st.lists(st.integers(1, 3), max_size=4)  # how far back each referenced node is
dag_recipes = st.lists(st.tuples(st.sampled_from(["list", "tuple", "dict"]), references, integers),
                       min_size=1, max_size=40)


def build_dag(recipe: list[tuple[str, list[int], list[int]]]) -> tuple[Any, int]:
    """The last node of a DAG whose nodes each hold earlier nodes (1 to 3 back) and integers, and its expanded
    size: 1 per node plus its children's, a dict's integer keys counting 1 each."""
    nodes: list[Any] = []
    sizes: list[int] = []
    for kind, backs, numbers in recipe:
        held = [back for back in backs if back <= len(nodes)]
        parts = [nodes[-back] for back in held] + list(numbers)
        size = 1 + sum(sizes[-back] for back in held) + len(numbers)
        if kind == "dict":
            nodes.append(dict(enumerate(parts)))
            size += len(parts)
        else:
            nodes.append(tuple(parts) if kind == "tuple" else parts)
        sizes.append(size)
    return nodes[-1], sizes[-1]


def same_dag(ours: Any, theirs: Any, seen: set[tuple[int, int]]) -> bool:
    """Equal structure, comparing each pair of shared nodes once."""
    if type(ours) is not type(theirs):
        return False
    if not isinstance(ours, (list, tuple, dict)):
        return bool(ours == theirs)
    if (id(ours), id(theirs)) in seen:
        return True
    seen.add((id(ours), id(theirs)))
    if isinstance(ours, dict):
        return ours.keys() == theirs.keys() and all(same_dag(ours[k], theirs[k], seen) for k in ours)
    return len(ours) == len(theirs) and all(same_dag(a, b, seen) for a, b in zip(ours, theirs))


@FUZZ
@given(recipe=dag_recipes, protocol=st.integers(0, pickle.HIGHEST_PROTOCOL))
@example(recipe=[("tuple", [1, 1], [])] * 30, protocol=2)  # 2**31 objects
@example(recipe=[("list", [1, 1], [7])] * 18 + [("dict", [1, 1, 2, 3], [])], protocol=4)  # 2**20 and more
@example(recipe=[("dict", [1, 2], [1, 2, 3])] * 12, protocol=5)
def test_shared_dags_read_exactly_or_are_refused_exactly_past_the_limit(recipe: list, protocol: int) -> None:
    value, size = build_dag(recipe)
    payload = pickle.dumps(value, protocol=protocol)
    limit = max(safe_pickle.MIN_EXPANSION_BUDGET, safe_pickle.MAX_EXPANSION_PER_BYTE * len(payload))
    result = outcome(lambda: safe_pickle.loads(payload, file="x.pkl"))
    event("refused" if size > limit else "read")
    target(math.log2(size), label="log2 of the expanded size")
    if size > limit:
        assert type(result) is HeaderError and EXPANDS in str(result), result
    else:
        assert same_dag(result, pickle.loads(payload), set()), recipe


# ---------------------------------------------------------------------------
# defect 4: no pickle changes what the next one reads
# ---------------------------------------------------------------------------


def build_onto(module: str, name: str) -> bytes:
    """A pickle that BUILDs state onto the global module.name: it would rewrite it where the global is shared."""
    state = b"}X\x0a\x00\x00\x00torch_nameX\x07\x00\x00\x00float32s"
    return b"\x80\x02" + f"c{module}\n{name}\n".encode() + state + b"b."


def test_build_on_a_dtype_cannot_change_later_reads(dcp_seed: Path, tmp_path: Path) -> None:
    """A .bin that BUILDs onto torch.float8_e4m3fn and a .metadata that BUILDs onto torch.float32 are refused;
    a benign fp8 file and a benign DCP checkpoint opened after them in the same process read bit-exactly."""
    hostile_bin = tmp_path / "hostile.bin"
    hostile_bin.write_bytes(torch_zip(build_onto("torch", "float8_e4m3fn")))
    hostile_dcp = tmp_path / "hostile"
    hostile_dcp.mkdir()
    head = b"\x80\x04\x8c\x1ctorch.distributed.checkpoint0"  # a string, popped: passes detection
    (hostile_dcp / ".metadata").write_bytes(head + build_onto("torch", "float32")[2:])
    fp8 = torch.tensor([0.5, -1.75, 448.0, 0.001953125, -3.0]).to(torch.float8_e4m3fn)
    benign = tmp_path / "fp8.bin"
    torch.save({"x": fp8}, benign)
    imports = "import numpy as np\nimport tensormorph as tm\nfrom tensormorph.errors import HeaderError\n"
    code = imports + "# measure\n" + imports + f"""refusals = []
for path in ({str(hostile_bin)!r}, {str(hostile_dcp)!r}):
    try:
        tm.open(path)
    except HeaderError as error:
        refusals.append(str(error))
assert len(refusals) == 2, refusals
assert "BUILD would set the state of torch.float8_e4m3fn" in refusals[0], refusals
assert "BUILD would set the state of torch.float32" in refusals[1], refusals
with tm.open({str(benign)!r}) as ck:
    assert ck["x"].dtype == "F8_E4M3", ck["x"].dtype
    assert ck["x"].full().tobytes() == {fp8.view(torch.uint8).numpy().tobytes()!r}
with tm.open({str(dcp_seed)!r}) as ck:
    assert np.array_equal(ck["w"].full(), np.arange(24, dtype=np.float32).reshape(4, 6))
"""
    assert run_bounded(code, seconds=30, grown_mib=500) is None


def every_global() -> dict[tuple[str, str], Any]:
    """The stand-ins of every reader (the base ones are in the torch and DCP tables)."""
    return {**torchzip._tensor_globals(lambda *args: None), **dcp_metadata.metadata_globals(),
            **megatron.COMMON_GLOBALS, **deepspeed_states.DEEPSPEED_GLOBALS}


@pytest.mark.parametrize("module, name", sorted(every_global()))
def test_no_global_can_be_changed(module: str, name: str) -> None:
    """BUILD, SETITEM, APPEND and ADDITEMS onto any allowed global (a shared function, class or dtype) are
    refused, and leave it as it was."""
    table = every_global()
    stand_in = table[(module, name)]
    before = (repr(stand_in), dict(getattr(stand_in, "__dict__", {})))
    head = b"\x80\x02" + f"c{module}\n{name}\n".encode()
    for payload, message in ((build_onto(module, name), "BUILD would set the state of"),
                             (head + b"K\x01K\x02s.", "SETITEM onto a"),
                             (head + b"K\x01a.", "APPEND onto a"),
                             (head + b"(K\x01\x90.", "ADDITEMS onto a")):
        with pytest.raises(HeaderError, match=message):
            safe_pickle.loads(payload, table)
    assert (repr(stand_in), dict(getattr(stand_in, "__dict__", {}))) == before


def test_build_cannot_change_a_rebuilt_tensor(tmp_path: Path) -> None:
    """A BUILD after a tensor's rebuild would give the checked TensorRef another shape (past its storage)."""
    path = tmp_path / "model.bin"
    weights = torch.arange(4, dtype=torch.float32)
    torch.save({"w": Call(torch._utils._rebuild_parameter, (weights, False, collections.OrderedDict()),
                          {"shape": (1 << 30,)})}, path)
    with pytest.raises(HeaderError, match="BUILD would set the state of a TensorRef") as info:
        tm.open(path)
    assert str(path) in str(info.value)


def test_cycles_are_refused() -> None:
    """A list that holds itself: readers would recurse into it forever."""
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    with pytest.raises(HeaderError, match="APPEND changes a list that the pickle has already referred to"):
        safe_pickle.loads(pickle.dumps(cyclic, protocol=2), file="x.pkl")


def test_extension_codes_are_refused() -> None:
    """copyreg's extension registry and cache are process-wide: where any library registered a code, a pickle
    naming it would fetch the stand-in of an earlier load's table from the cache, not from its own."""
    code = 0x7FFFFFF0
    copyreg.add_extension("torch.distributed.checkpoint.metadata", "Metadata", code)
    try:
        for table in (dcp_metadata.metadata_globals(), dcp_metadata.metadata_globals()):
            with pytest.raises(HeaderError, match="extension code"):
                safe_pickle.loads(b"\x80\x02\x84" + code.to_bytes(4, "little") + b")\x81.", table)
    finally:
        copyreg.remove_extension("torch.distributed.checkpoint.metadata", "Metadata", code)
        copyreg.clear_extension_cache()


def test_a_state_dict_keeps_its_metadata() -> None:
    """torch.save of a module's state dict BUILDs its _metadata onto the OrderedDict: still allowed."""
    state = collections.OrderedDict(w=torch.ones(2))
    state._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]  # as nn.Module.state_dict sets it
    buffer = io.BytesIO()
    torch.save(state, buffer)
    tree = torchzip.load(memoryview(buffer.getvalue()), file="m.bin")
    assert tree._metadata == {"": {"version": 1}} and tree["w"].shape == (2,)


# ---------------------------------------------------------------------------
# hash-collision keys: a dict or set of N keys of one hash value takes N**2/2 comparisons to fill
# ---------------------------------------------------------------------------


MODULUS = (1 << 61) - 1  # sys.hash_info.modulus: a number hashes to its value modulo this prime
LIMIT = pickle_work.MAX_KEYS_PER_HASH
SHARED = f"x.pkl: {LIMIT + 1} keys share one hash value"
XXPRIME_1, XXPRIME_2, XXPRIME_5 = 11400714785074694791, 14029467366897019727, 2870177450012600261
MASK_64 = (1 << 64) - 1


def colliding_ints(n: int) -> list[int]:
    """k * (2**61 - 1) + 7 all hash to 7."""
    return [k * MODULUS + 7 for k in range(1, n + 1)]


def colliding_floats() -> list[float]:
    """All 105 non-integral floats of one hash value. m * 2**e hashes to m * 2**e modulo 2**61 - 1, where 2**-1 is
    2**60: for each exponent e < 0 the one candidate mantissa is h * 2**-e mod (2**61 - 1), h's 61 bits rotated, and
    it fits a double where the rotation puts 8 of h's zero bits on top. With one bit set every 9 places, h has six
    such runs of zeros, each good for about 17 exponents (apart by 61)."""
    h = sum(1 << (9 * i) for i in range(6))
    floats = set()
    for e in range(-1074, 0):
        mantissa = h * pow(2, -e % 61, MODULUS) % MODULUS
        value = math.ldexp(mantissa, e)
        if mantissa < 1 << 53 and math.ldexp(value, -e) == mantissa and value % 1:
            floats.add(value)
    assert {hash(value) for value in floats} == {h} and len(floats) == 105
    return sorted(floats)


def colliding_pairs(n: int, shared: int = 0x5DEECE66D) -> list[tuple[int, int]]:
    """n 2-tuples (a, b) of integers below 2**61 - 1 with one hash value, made by inverting CPython's tuple hash
    (Objects/tupleobject.c, xxHash-based since 3.8): acc = P5; for each item acc = rotl(acc + hash(item) * P2, 31)
    * P1 (mod 2**64); then acc += 2 ^ P5 ^ 3527539. After the first item every step is a bijection, so all pairs
    whose acc(a) + hash(b) * P2 is one value `shared` collide: hash(b) = (shared - acc(a)) / P2 mod 2**64, and
    about one a in four gets a b below the modulus (whose hash is b itself)."""
    inverse = pow(XXPRIME_2, -1, 1 << 64)
    pairs: list[tuple[int, int]] = []
    a = 0
    while len(pairs) < n:
        acc = (XXPRIME_5 + a * XXPRIME_2) & MASK_64
        acc = ((acc << 31 | acc >> 33) & MASK_64) * XXPRIME_1 & MASK_64
        b = (shared - acc) * inverse & MASK_64
        b -= (b >> 63) << 64  # as a signed hash value
        if -MODULUS < b < MODULUS and b != -1:  # -1 hashes to -2
            pairs.append((a, b))
        a += 1
    assert len({hash(pair) for pair in pairs}) == 1
    return pairs


def atom(value: Any) -> bytes:
    """The opcodes that push `value` (a number or a 2-tuple of them): the pickles are written opcode by opcode, as
    building the dict here would take the quadratic time in this process too."""
    if type(value) is tuple:
        return atom(value[0]) + atom(value[1]) + pickle.TUPLE2
    return pickle.dumps(value, protocol=2)[2:-1]


def members(keys: list[Any]) -> bytes:
    return b"".join(map(atom, keys))


def items(keys: list[Any]) -> bytes:
    return b"".join(atom(key) + pickle.NONE for key in keys)


def pairs_list(keys: list[Any]) -> bytes:
    return pickle.MARK + b"".join(atom(key) + pickle.NONE + pickle.TUPLE2 for key in keys) + pickle.LIST


FILLS = {  # every way a pickle fills a dict or a set: the pickle of one holding `keys` (as keys, with None values)
    "DICT": lambda keys: b"\x80\x02(" + items(keys) + b"d.",
    "SETITEMS": lambda keys: b"\x80\x02}(" + items(keys) + b"u.",
    "SETITEM": lambda keys: b"\x80\x02}" + b"".join(atom(key) + b"Ns" for key in keys) + b".",
    "ADDITEMS": lambda keys: b"\x80\x04\x8f(" + members(keys) + b"\x90.",
    "FROZENSET": lambda keys: b"\x80\x04(" + members(keys) + b"\x91.",
    "builtins.set": lambda keys: b"\x80\x02cbuiltins\nset\n(" + members(keys) + b"l\x85R.",
    "builtins.set by OBJ": lambda keys: b"\x80\x02(cbuiltins\nset\n(" + members(keys) + b"lo.",
    "builtins.frozenset by INST": lambda keys: b"\x80\x02((" + members(keys) + b"libuiltins\nfrozenset\n.",
    "builtins.frozenset by NEWOBJ": lambda keys: b"\x80\x02cbuiltins\nfrozenset\n(" + members(keys) + b"l\x85\x81.",
    "builtins.frozenset by NEWOBJ_EX": lambda keys: (b"\x80\x04cbuiltins\nfrozenset\n(" + members(keys)
                                                    + b"l\x85}\x92."),
    "collections.OrderedDict": lambda keys: b"\x80\x02ccollections\nOrderedDict\n" + pairs_list(keys) + b"\x85R.",
    "argparse.Namespace": lambda keys: b"\x80\x02cargparse\nNamespace\n" + pairs_list(keys) + b"\x85R.",
    "deepspeed LossScaler": lambda keys: (b"\x80\x02cdeepspeed.runtime.fp16.loss_scaler\nLossScaler\n"
                                          + pairs_list(keys) + b"\x85R."),
}
COLLIDING = {"integers past the modulus": colliding_ints, "2-tuples of small integers": colliding_pairs,
             "non-integral floats": lambda n: colliding_floats()[:n]}
TABLE = {**safe_pickle.BASE_GLOBALS, **megatron.COMMON_GLOBALS, **deepspeed_states.DEEPSPEED_GLOBALS}
TABLE_CODE = """from tensormorph import safe_pickle
from tensormorph.formats import megatron
from tensormorph.formats.deepspeed import states
table = {**safe_pickle.BASE_GLOBALS, **megatron.COMMON_GLOBALS, **states.DEEPSPEED_GLOBALS}
"""


class TableUnpickler(pickle._Unpickler):
    """The standard library's unpickler with safe_pickle's stand-ins: the values that must be read."""

    def find_class(self, module: str, name: str) -> Any:
        return TABLE[(module, name)]


@pytest.mark.parametrize("kind", sorted(COLLIDING))
def test_hash_collision_keys_are_refused_fast(tmp_path: Path, kind: str) -> None:
    """20,000 keys of one hash value (a 300 KB pickle, 4 to 9 s to read each way before the bound), or the 105 such
    non-integral floats, through every way of filling a dict or set: refused at once, counted before insertion."""
    keys = COLLIDING[kind](20_000)
    payloads = tmp_path / "payloads.pkl"
    payloads.write_bytes(pickle.dumps({name: fill(keys) for name, fill in FILLS.items()}))
    code = TABLE_CODE + f"""import pickle
from tensormorph.errors import HeaderError
payloads = pickle.loads(open({str(payloads)!r}, "rb").read())
# measure
wrong = {{}}
for name, payload in payloads.items():
    try:
        safe_pickle.loads(payload, table, file="x.pkl")
        wrong[name] = "read"
    except HeaderError as error:
        if not str(error).startswith({SHARED!r}):
            wrong[name] = str(error)
assert not wrong, wrong
"""
    assert run_bounded(code, seconds=SECONDS, grown_mib=GROWN_MIB) is None


@pytest.mark.parametrize("kind", sorted(COLLIDING))
def test_hash_collision_keys_read_exactly_up_to_the_limit(kind: str) -> None:
    """LIMIT keys of one hash value read as the standard unpickler reads them; one more is refused."""
    keys = COLLIDING[kind](LIMIT + 1)
    for name, fill in FILLS.items():
        payload = fill(keys[:LIMIT])
        value, expected = safe_pickle.loads(payload, TABLE), TableUnpickler(io.BytesIO(payload)).load()
        assert type(value) is type(expected) and value == expected and len(value) == LIMIT, name
        with pytest.raises(HeaderError, match=f"^{SHARED}"):
            safe_pickle.loads(fill(keys), TABLE, file="x.pkl")


def test_hash_collision_keys_are_counted_per_dict_across_opcodes() -> None:
    """The limit holds for each dict or set, whatever fills it in turn: DICT then SETITEMS, ADDITEMS in two batches,
    a Namespace's items then the state BUILD merges in. Separate dicts may each hold LIMIT keys of one hash value."""
    keys = colliding_pairs(LIMIT + 1)
    half = LIMIT // 2
    in_turn = {
        "DICT, SETITEMS": b"\x80\x02(" + items(keys[:LIMIT]) + b"d(" + items(keys[LIMIT:]) + b"u.",
        "ADDITEMS twice": b"\x80\x04\x8f(" + members(keys[:half]) + b"\x90(" + members(keys[half:]) + b"\x90.",
        "Namespace, BUILD": (b"\x80\x02cargparse\nNamespace\n)\x81(" + items(keys[:half]) + b"u("
                             + items(keys[half:]) + b"db."),
    }
    for name, payload in in_turn.items():
        with pytest.raises(HeaderError, match=f"^{SHARED}"):
            safe_pickle.loads(payload, TABLE, file="x.pkl")
        assert len(TableUnpickler(io.BytesIO(payload)).load()) == LIMIT + 1, name
    apart = b"\x80\x02(" + b"".join(b"(" + items(keys[:LIMIT]) + b"d" for _ in range(3)) + b"l."
    assert safe_pickle.loads(apart) == [dict.fromkeys(keys[:LIMIT])] * 3


def test_real_keys_of_one_hash_value_read() -> None:
    """Distinct real keys share a hash value by accident only: -1 and -2 both hash to -2, so the 2**6 tuples of them
    in six places collide. They read; 2**7 are past the limit."""
    six = {key: 0 for key in itertools.product((-1, -2), repeat=6)}
    assert len({hash(key) for key in six}) == 1 and len(six) == LIMIT
    assert safe_pickle.loads(pickle.dumps(six, protocol=4)) == six
    seven = dict.fromkeys(itertools.product((-1, -2), repeat=7), 0)
    with pytest.raises(HeaderError, match=f"^x.pkl: {LIMIT + 1} keys share one hash value"):
        safe_pickle.loads(pickle.dumps(seven, protocol=4), file="x.pkl")


def test_memo_indices_of_one_hash_value_are_refused(tmp_path: Path) -> None:
    """The memo is a dict too: 20,000 text PUTs to indices k * (2**61 - 1) + 7 (a 500 KB pickle) would fill it in
    quadratic time. No pickler numbers anywhere near 2**61 objects."""
    path = tmp_path / "memo.pkl"
    path.write_bytes(b"N" + b"".join(b"p%d\n" % index for index in colliding_ints(20_000)) + b".")
    code = f"""from tensormorph import safe_pickle
data = open({str(path)!r}, "rb").read()
# measure
safe_pickle.loads(data, file="x.pkl")
"""
    result = run_bounded(code, seconds=SECONDS, grown_mib=GROWN_MIB)
    assert result is not None and result[0] == "HeaderError", result
    assert result[1].startswith(f"x.pkl: PUT names memo index {MODULUS + 7}"), result


def test_hash_collision_keys_in_a_torch_file_are_refused(tmp_path: Path) -> None:
    """20,000 colliding 2-tuple keys of a state dict in a torch .bin (torch.save writes its SETITEMS)."""
    path = tmp_path / "pytorch_model.bin"
    torch.save({"w": torch.arange(4, dtype=torch.float32),
                "evil": Filled([(key, 0) for key in colliding_pairs(20_000)])}, path)
    message = refused_in_bounds(f"tm.open({str(path)!r})")
    assert message.startswith(f"{path}: {LIMIT + 1} keys share one hash value"), message


def test_dicts_and_sets_of_many_number_and_tuple_keys_read_fast(tmp_path: Path) -> None:
    """100,000 tuple keys, float keys, tuple members and float members: each its own hash value, read at full speed."""
    value = {"tuples": {(i, i + 1): i for i in range(100_000)}, "floats": {i + 0.5: i for i in range(100_000)},
             "tuple set": {(i, -i) for i in range(100_000)}, "float set": frozenset(i / 3 for i in range(100_000))}
    path = tmp_path / "benign.pkl"
    path.write_bytes(pickle.dumps(value, protocol=4))
    code = f"""import pickle
from tensormorph import safe_pickle
data = open({str(path)!r}, "rb").read()
# measure
assert safe_pickle.loads(data) == pickle.loads(data)
"""
    assert run_bounded(code, seconds=5, grown_mib=GROWN_MIB) is None  # 0.8 s here: the plain unpickling of 4.5 MB
