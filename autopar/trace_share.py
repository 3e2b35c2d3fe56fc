"""Ranks that compile the same model share its traces: one rank traces, the others read its copy.

Every rank of an SPMD program (and every rank of a pipeline, before the split) traces the same
model with the same global shapes, so dynamo's capture, the joint forward+backward graph
(AOTAutograd) and the forward-only program (torch.export) come out the same on each, and the
propagate pass puts the same questions to DTensor: rank-independent work that N ranks on one host
do N times over (on this 2-core machine a 2-rank test job paid it twice). With a real process
group of more than one rank, the mesh's lowest rank (the leader) traces and puts a copy in the
default group's c10d store (the TCPStore every rank already reaches; no collective, so a rank
that takes another path cannot hang anyone); the others wait for that copy instead of tracing.
What is shared is what ``autopar/capture_cache.py`` keeps (its templates: the graph with its
metadata, the trace's own constants; the model's tensors by name), pickled by torch's
``GraphPickler`` (fake tensors as descriptions, made again in a fresh fake mode on the reader;
dynamo's fake mode, which its graph names, becomes that one too), and a reader binds it to its own
model as a cache hit would. DTensor's answers (propagate's memo, keyed by everything an answer
depends on) go the same way: the leader's new entries, added by the others before they propagate.

Whether two ranks mean the same trace is checked, not assumed: the leader announces, for each
trace of a compile in order, a digest of the cache key (the model's fingerprint and the inputs'
shapes for a capture or a forward program, the torch-level graph's text for a joint one; classes
and functions by name rather than by identity); a rank whose own digest differs (a loss that
closes over the rank's number is another loss on each rank), or whose leader has announced
nothing within the compile's ``timeout``, traces for itself. So does every rank where the
leader's trace raised (each then raises its own error), or where this torch lacks what sharing
needs (nothing is lost: each rank traces, as before).

A copy is shared only while its size times the ranks that read it stays under ``MAX_SENT`` (1 GiB,
chosen, not measured: the store is one process, and sharing was measured on 2- and 4-rank jobs of
small models only). ``AUTOPAR_SHARE_TRACES=0`` switches it off; ``STATS`` counts what was shared.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import hashlib
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from autopar import torch_compat as tc

KINDS = ("capture", "joint", "forward")  # what capture_cache shares (and ``memo``: "strategies")
_KEEP = 8  # copies a leader leaves in the store per mesh (the oldest are deleted)
_POLL_S = 0.02
# at most this many bytes sent from the store per trace (its size times the ranks that read it):
# the store is one process (rank 0's, or the launcher's agent's). A bound chosen, not measured:
# sharing was measured on 2- and 4-rank gloo jobs of small models only
MAX_SENT = 1 << 30
STATS: collections.Counter = collections.Counter()  # "KIND taken" / "traced_here" / "published" / "refused"
WAITED: list[float] = []  # seconds each ``follow`` waited (the tests read them)


@dataclass
class _Peers:
    store: Any
    leader: bool
    leader_rank: int
    followers: int
    wait_s: float
    compile_no: int
    calls: collections.Counter = field(default_factory=collections.Counter)
    published: collections.OrderedDict = field(default_factory=collections.OrderedDict)
    after: bool = False  # past the compile (``later``): the leader's end of compile says nothing


_ACTIVE: contextvars.ContextVar[_Peers | None] = contextvars.ContextVar("autopar_trace_share", default=None)
_COMPILES: collections.Counter = collections.Counter()  # per mesh: compiles started (the ranks count alike)
_PUBLISHED: dict = {}  # per mesh: the leader's copies in the store, oldest first


def enabled() -> bool:
    return os.environ.get("AUTOPAR_SHARE_TRACES", "1") not in ("0", "false", "off")


@contextlib.contextmanager
def sharing(mesh, wait_s: float):
    """Around one compile on ``mesh``: its traces shared between the mesh's ranks where it is a
    real process group of more than one rank (not a fake one: planning traces alone)."""
    peers = _peers(mesh, wait_s)
    token = _ACTIVE.set(peers)
    try:
        yield peers
    finally:
        _ACTIVE.reset(token)
        if peers is not None and peers.leader:
            # a trace the leader has not announced by now it will not make (its stages differ:
            # a pipeline's twins): the others stop waiting for it
            with contextlib.suppress(Exception):
                peers.store.set(f"end/{peers.compile_no}", "1")


def _peers(mesh, wait_s: float) -> _Peers | None:
    import torch.distributed as dist

    from autopar.runtime.failure import world

    # (failure's side channel decides what counts as ranks to coordinate, none for one rank or a
    # fake group, and holds the default group's store)
    w = world() if enabled() and mesh is not None else None
    if w is None:
        return None
    ranks = sorted(int(r) for r in mesh.mesh.flatten().tolist())
    if len(ranks) < 2 or tc.find("GraphPickler", None) is None or tc.find("GraphPicklerOptions", None) is None:
        return None
    name = hashlib.blake2b(repr(ranks).encode(), digest_size=8).hexdigest()
    _COMPILES[name] += 1
    store = dist.PrefixStore(f"autopar/traces/{name}/", w.store)
    published = _PUBLISHED.setdefault(name, collections.OrderedDict())
    return _Peers(store, dist.get_rank() == ranks[0], ranks[0], len(ranks) - 1, wait_s, _COMPILES[name],
                  published=published)


def forget() -> None:
    """Delete the copies this process put in the store (a test that wants every trace made again)."""
    import torch.distributed as dist

    from autopar.runtime.failure import world

    w = world()
    store = w.store if w is not None else None
    for name, copies in _PUBLISHED.items():
        for d in list(copies) if store is not None else ():
            with contextlib.suppress(Exception):
                dist.PrefixStore(f"autopar/traces/{name}/", store).delete_key(f"copy/{d}")
        copies.clear()


def active() -> _Peers | None:
    return _ACTIVE.get()


def later(fn):
    """``fn``, to be called after the compile (the eval program's passes at the first forward
    call, generation's), sharing within the compile's peers as if it ran inside it."""
    peers = active()
    if peers is None or fn is None:
        return fn

    def run(*args, **kwargs):
        token = _ACTIVE.set(dataclasses.replace(peers, after=True))  # (the same counts: ``calls`` shared)
        try:
            return fn(*args, **kwargs)
        finally:
            _ACTIVE.reset(token)

    return run


# ---- digests: the cache key, readable in another process ---------------------------------------

def renamed(key, name_of) -> tuple:
    """``key`` as another process computes it alike: each object the fingerprint compared by
    identity (``("id", qualname, id)``) becomes ``("id", name_of(id, qualname), n)``, n the order
    it first appears in the key (two objects of one name stay apart). ``name_of`` may raise: the
    key then has no such form (autopar/disk_cache.py's names)."""
    seen: dict[int, int] = {}

    def walk(x):
        if isinstance(x, tuple) and len(x) == 3 and x[0] == "id" and isinstance(x[2], int):
            return ("id", name_of(x[2], x[1]), seen.setdefault(x[2], len(seen)))
        if isinstance(x, (tuple, list)):
            return tuple(walk(y) for y in x)
        return x

    return walk(key)


def digest(key, refs=()) -> str:
    """The cache key as text the other ranks compute alike: each object compared by identity
    named by its module and qualified name (the refs the fingerprint kept: two functions of one
    name in two modules stay apart) and by its order in the key."""
    names = {id(r): f"{getattr(r, '__module__', '')}.{getattr(r, '__qualname__', type(r).__qualname__)}"
             for r in refs}
    text = repr(renamed(key, lambda i, qual: names.get(i, qual)))
    return hashlib.blake2b(text.encode(), digest_size=20).hexdigest()


# ---- the copy on the wire ------------------------------------------------------------------------

def encode(template) -> bytes | None:
    """A capture-cache template as bytes (None where it does not pickle: the ranks trace alone)."""
    pickler, options = tc.find("GraphPickler", None), tc.find("GraphPicklerOptions", None)
    if pickler is None or options is None:
        return None

    fake_mode = tc.find("FakeTensorMode", None)

    class _Pickler(pickler):
        def reducer_override(self, obj):
            if isinstance(obj, fx.Graph):  # (a template holds a bare graph: pickled as a graph module's)
                gm = fx.GraphModule.__new__(fx.GraphModule)
                torch.nn.Module.__init__(gm)
                gm._graph, gm._tracer_cls, gm._tracer_extras = obj, None, {}
                return _graph_of, (gm,)
            if fake_mode is not None and isinstance(obj, fake_mode):
                # dynamo's capture names its fake mode (the graph module's meta, a view's base in
                # a fake tensor's description, which torch's pickler leaves in): the reader's own
                return _fake_mode_of, (self._unpickle_state,)
            return super().reducer_override(obj)

    try:
        return _Pickler.dumps(template, options(ops_filter=None, node_metadata_key_filter=None))
    except Exception:  # noqa: BLE001 - something in it does not pickle: not shared
        return None


def _graph_of(gm) -> fx.Graph:
    return gm._graph


def _fake_mode_of(state):
    return state.fake_mode


def decode(data: bytes):
    """A template from ``encode``'s bytes, its fake tensors made in a fresh fake mode."""
    import warnings

    with warnings.catch_warnings():  # (torch's own pytree specs warn of their deprecated class as they load)
        warnings.simplefilter("ignore", FutureWarning)
        return tc.find("GraphPickler").loads(data, tc.FakeTensorMode(shape_env=_shape_env()))


def _shape_env():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return ShapeEnv()


# ---- a memo filled alike on every rank --------------------------------------------------------------

@contextlib.contextmanager
def memo(kind: str, key, table: dict, shareable=lambda value: True):
    """Around work that fills ``table``, a memo keyed by everything its answers depend on (so an
    entry is right for any rank, whatever graph it was made for), the same way on every rank:
    the leader puts the entries it added in the store (those ``shareable`` says pickle), and the
    others wait for them and add them before doing the work (which then finds them). ``key``
    (plain data, or a function giving it) says which work this is: where the leader's differs, a
    rank waits for nothing."""
    peers = active()
    if peers is None:
        yield
        return
    key = key() if callable(key) else key
    where = slot(peers, kind)
    if not peers.leader:
        got = follow(peers, where, key, ())
        if got:
            table.update(got)
        yield
        return
    announced = announce(peers, where, key, ())
    before = len(table)
    try:
        yield
    except BaseException:
        publish(peers, announced, None)
        raise
    items = list(table.items())
    # (a table emptied on the way, as a bounded one is, and filled again: every entry it holds)
    added = items[before:] if len(items) >= before else items
    publish(peers, announced, {k: v for k, v in added if shareable(v)})


# ---- the protocol ----------------------------------------------------------------------------------

def _kind(slot: str) -> str:
    return slot.split("/")[2]


def slot(peers: _Peers, kind: str) -> str:
    """Where the leader says which trace of ``kind`` this is: the n-th of this compile (every rank
    takes one at each trace of ``kind``, from its cache or not, so the ranks count alike)."""
    peers.calls[kind] += 1
    return f"slot/{peers.compile_no}/{kind}/{peers.calls[kind]}"


def announce(peers: _Peers, slot: str, key, refs) -> str:
    """The leader, at a trace (traced or from its cache): says which trace this is."""
    d = digest(key, refs)
    with contextlib.suppress(Exception):  # (the store is gone: the others wait, time out, trace for themselves)
        peers.store.set(slot, d)
    return f"{slot}|{d}"


def publish(peers: _Peers, announced: str, template) -> None:
    """The leader puts its copy of the trace it announced in the store (once per trace: the
    oldest copies are deleted); ``template`` None: it has none (its trace raised), and the
    others trace for themselves."""
    slot, _, d = announced.partition("|")
    store = peers.store
    try:
        if template is None:
            store.set(slot, "none")
            return
        if store.check([f"copy/{d}"]):
            return
        data = encode(template)
        if data is None or len(data) * peers.followers > MAX_SENT:
            STATS[f"{_kind(slot)} refused"] += 1
            store.set(slot, "none")
            return
        store.set(f"copy/{d}", data)
        STATS[f"{_kind(slot)} published"] += 1
        peers.published[d] = True
        while len(peers.published) > _KEEP:
            old, _ = peers.published.popitem(last=False)
            store.delete_key(f"copy/{old}")
    except Exception:  # noqa: BLE001 - the store is gone: the others time out and trace for themselves
        pass


def follow(peers: _Peers, slot: str, key, refs):
    """A rank other than the leader, at a trace of ``kind`` it has no copy of: the leader's copy
    (a template) where the leader announced the same trace and published it; None (trace here)
    where it announced another, has none, ended its compile without announcing one, or said
    nothing within the compile's timeout."""
    from autopar.runtime.failure import compile_failed

    d = digest(key, refs)
    store = peers.store
    copy_key = f"copy/{d}"
    t0 = time.monotonic()
    try:
        while not store.check([copy_key]):
            ended = not peers.after and store.check([f"end/{peers.compile_no}"])  # (read before the slot)
            said = store.get(slot).decode() if store.check([slot]) else None
            # the leader traces something else here or cannot share it, has finished its compile
            # without this trace, its compile failed (this rank's will say so), or it said nothing
            # in time: trace here
            if ((said is not None and said != d) or (ended and said is None) or compile_failed(peers.leader_rank)
                    or time.monotonic() - t0 > peers.wait_s):
                return _here(slot, t0)
            time.sleep(_POLL_S)
        got = decode(store.get(copy_key))
    except Exception:  # noqa: BLE001 - the store is gone, or a copy this process cannot read: trace here
        return _here(slot, t0)
    STATS[f"{_kind(slot)} taken"] += 1
    WAITED.append(time.monotonic() - t0)
    return got


def _here(slot: str, t0: float) -> None:
    STATS[f"{_kind(slot)} traced_here"] += 1
    WAITED.append(time.monotonic() - t0)
    return None
