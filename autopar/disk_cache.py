"""The capture cache's entries kept on disk, for the next process that compiles the same model.

``autopar/capture_cache.py`` keeps a compile's three traces (dynamo's capture, the AOTAutograd
joint graph, the forward-only export) for later compiles in the same process. A user who plans a
model, changes the mesh and plans it again, or restarts a training script, pays them again in a
new process: for Llama-3-8B's three planning blocks on this 2-core machine about 2.4 of the 7-8
seconds of ``autopar plan``. This module writes each entry to a file and reads it back in
another process, as torch's own FX graph and AOTAutograd caches do for their artifacts; and
propagate's memo of DTensor's answers (keyed by everything an answer depends on), one file per
graph and mesh shape holding the answers its propagation used.

What makes a hit mean the same trace (a wrong hit would be a wrong program):

- The in-process key (every module's class, every non-tensor attribute by value, parameters'
  and buffers' shapes / dtypes / strides, buffers' values, the loss function, the inputs, the
  global switches a trace reads) with each object it compares by identity NAMED instead: a class
  by its module, qualified name and the content of the file that defines it; a function also by
  its code (bytecode, constants, names, defaults). A class made inside a function
  (``<locals>`` in its name: its body may close over anything) or an object compared by identity
  (a module held outside the module tree) has no name that holds across processes: no file.
- torch's version, Python's, and the content of autopar's own source (a change anywhere in
  autopar is another key: the passes before the cache decide what is traced).
- Every file the trace ran code from (the graph's stack traces: transformers' masking and
  attention helpers, the user's loss module; the Python functions the graph calls), stored with
  the entry by content digest and compared when it is read: a file edited since is a miss, and
  the trace is made again.
- No operator of a namespace torch or autopar does not define (a user's custom op: its fake
  kernel, backward, decomposition and any sharding rule live in a file no key names): a graph
  that calls one (or hands one to a higher-order op), a joint graph traced from such a graph,
  and DTensor's answer for such an op are not written; nor is an answer autopar derived by
  running an op (passes/propagate.py ``_kept_on_disk``: its limits can be set at run time).
- No file modified after this process started (a class's, a traced file, autopar's own): the
  process runs the code it loaded, which such a file may no longer say; an entry that names one
  is not read either.
- The global switches a trace reads (default dtype and device, grad mode, deterministic
  algorithms, autocast on CPU and CUDA with its dtype), as in the in-process key; DTensor's
  answers also by the mesh's device type and devices per host.

Not covered: what the model's code reads that is neither in a file nor in the key: an
environment variable, a global or registry the user's script sets at run time (transformers'
attention registry), torch's dynamo / functorch config changed by the script. Within one process
these are the same for every compile; across processes they may not be: a model that depends on
one should run with the disk off. ``AUTOPAR_DISK_CACHE=0`` switches the disk off (``AUTOPAR_CAPTURE_CACHE=0``
switches off both); ``AUTOPAR_CACHE_DIR`` says where (default ``~/.cache/autopar``, as for
kernels/choice.py's measured kernels; the traces in its ``traces-1``), kept under
``AUTOPAR_CACHE_MAX_MB`` (1024), the least recently read files deleted first. Entries are
pickles, read only from that directory (as torch's caches are): it must be the user's own. A
compile that read any says so (``compile_notes``; ``autopar plan``'s notes).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import os
import pickle
import re
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

from autopar import torch_compat as tc

FORMAT = 1
# "KIND read" / "written" / "stale" (a file changed) / "unreadable" / "custom op" / "edited" (since the start)
STATS: dict[str, int] = {}
_FILES: dict[str, tuple[int, int, str]] = {}  # path -> (mtime_ns, size, content digest)
_MAX_ENTRY = 512 << 20  # an entry larger than this is not written
_READ_MEMOS: dict[str, dict] = {}  # the memo files this process has read or written: their entries
_NOTED: contextvars.ContextVar[tuple] = contextvars.ContextVar("autopar_disk_reads", default=())
WHAT = {"capture": "dynamo's capture", "joint": "the joint graph", "forward": "the forward program",
        "strategies": "DTensor's strategies"}


def directory() -> Path | None:
    off = ("0", "false", "off", "no")
    if os.environ.get("AUTOPAR_DISK_CACHE", "1").lower() in off or os.environ.get("AUTOPAR_CAPTURE_CACHE") in off:
        return None
    # (where kernels/choice.py keeps its measured kernel choices too)
    root = os.environ.get("AUTOPAR_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "autopar")
    return Path(root) / f"traces-{FORMAT}"


def _count(what: str) -> None:
    STATS[what] = STATS.get(what, 0) + 1


@functools.lru_cache(maxsize=1)
def _started() -> float:
    """When this process started (Linux: /proc; elsewhere, when the cache was first used: a file
    edited between the start and then would be missed there)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        # (btime is whole seconds, rounded down: this is at or before the true start, so a file
        # edited after the start is never taken for one edited before it)
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def file_digest(path: str | None) -> str | None:
    """The content digest of ``path``, computed again only when its size or modification time
    changed; None where there is no such file, or it was modified after this process started
    (the code this process runs may be the file as it was before: neither side of a disk entry
    can vouch for it)."""
    if not path:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    if st.st_mtime > _started():
        return None
    got = _FILES.get(path)
    if got is not None and got[:2] == (st.st_mtime_ns, st.st_size):
        return got[2]
    try:
        with open(path, "rb") as f:
            d = hashlib.blake2b(f.read(), digest_size=16).hexdigest()
    except OSError:
        return None
    _FILES[path] = (st.st_mtime_ns, st.st_size, d)
    return d


@functools.lru_cache(maxsize=1)
def _own_source() -> str:  # (raises _Unnamed, each time, where a file changed since the start)
    """A digest of every autopar source file (its packages where they live: an editable install
    keeps ``autopar.passes`` and ``autopar.kernels`` beside ``autopar``)."""
    import importlib.util

    roots = {Path(__file__).parent.resolve()}
    for sub in ("passes", "kernels"):
        spec = importlib.util.find_spec(f"autopar.{sub}")
        where = (spec.submodule_search_locations or ()) if spec is not None else ()
        roots.update(Path(p).resolve() for p in where)
    files = {p.resolve() for r in roots for p in r.rglob("*.py")}
    h = hashlib.blake2b(digest_size=16)
    for p in sorted(files):
        d = file_digest(str(p))
        if d is None:  # (edited since this process started: its code may be the file as it was)
            raise _Unnamed
        h.update(p.name.encode())
        h.update(d.encode())
    return h.hexdigest()


def _versions() -> tuple:
    return (FORMAT, torch.__version__, sys.version_info[:2], _own_source())


def _code(code: types.CodeType) -> str:
    h = hashlib.blake2b(digest_size=16)

    def walk(c):
        h.update(c.co_code)
        h.update(repr((c.co_names, c.co_varnames, c.co_freevars, c.co_cellvars)).encode())
        for k in c.co_consts:
            if isinstance(k, types.CodeType):
                walk(k)
            else:
                h.update(repr(k).encode())

    walk(code)
    return h.hexdigest()


def _module_file(name: str | None) -> str | None:
    mod = sys.modules.get(name or "")
    return getattr(mod, "__file__", None)


def _name(obj) -> tuple | None:
    """What names ``obj`` (which the in-process key compares by identity) in another process,
    or None where nothing does."""
    qual = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if isinstance(obj, type):
        if not qual or "<locals>" in qual:
            return None
        d = None if obj.__module__ == "builtins" else file_digest(_module_file(obj.__module__))
        if d is None and obj.__module__ != "builtins":
            return None
        return ("class", obj.__module__, qual, d)
    if isinstance(obj, types.FunctionType):
        f = file_digest(obj.__code__.co_filename)
        if f is None:
            return None
        return ("function", obj.__module__, qual, _code(obj.__code__), f, _plain(obj.__defaults__),
                _plain(obj.__kwdefaults__))
    if isinstance(obj, types.BuiltinFunctionType):
        return ("builtin", getattr(obj, "__module__", None), qual)
    if isinstance(obj, types.ModuleType):
        f = getattr(obj, "__file__", None)
        d = file_digest(f)
        return None if f and d is None else ("module", obj.__name__, d)  # (None: edited since the start)
    if isinstance(obj, (tc.OpOverload, tc.OpOverloadPacket)):
        return ("op", str(obj)) if own_op(obj) else None  # (a user's op: its code is in no key)
    return None


def _plain(x) -> str:
    text = repr(x)
    if re.search(r" at 0x[0-9a-f]+", text):  # an object's default: only its identity prints
        raise _Unnamed
    return text


class _Unnamed(Exception):
    pass


def key_of(key, refs) -> str | None:
    """The in-process key as a file name another process computes alike; None where something in
    it is compared by identity and has no name that holds across processes."""
    try:
        names = {id(r): _name(r) for r in refs}
    except Exception:  # noqa: BLE001 - _Unnamed, or a default whose repr raises: no name, no file
        return None
    from autopar.trace_share import renamed

    def name_of(i, qual):
        if names.get(i) is None:
            raise _Unnamed
        return names[i]

    try:
        text = repr((renamed(key, name_of), _versions()))
    except Exception:  # noqa: BLE001 - as above
        return None
    # (an identity left in the text: a cycle's marker, an object's default repr)
    if re.search(r" at 0x[0-9a-f]+|\('cycle', \d+\)", text):
        return None
    return hashlib.blake2b(text.encode(), digest_size=20).hexdigest()


_TRACE_FILE = re.compile(r'File "([^"]+)", line \d+')


# the operator namespaces whose ops torch or autopar define (their code is in the key: torch's
# version, autopar's source); an op of any other namespace (a user's custom op, whose fake kernel
# and backward live in a file no key names) keeps its graph off the disk. A namespace a later
# torch adds, or autopar's next one, counts as a user's until listed: no disk, never a wrong hit
_OWN_OPS = frozenset({"aten", "prims", "prim", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional",
                      "_dtensor", "higher_order", "rngprims", "debugprims", "quantized", "_quantized", "mkldnn", "mkl",
                      "onednn", "inductor", "profiler", "export", "_native", "autopar", "demo_unruled"})


def own_op(target) -> bool:
    """Whether ``target`` is not an operator, or one of a namespace torch or autopar defines."""
    if not isinstance(target, (tc.OpOverload, tc.OpOverloadPacket)):
        return True
    return str(target).split(".")[0] in _OWN_OPS


def foreign_op(graph) -> str | None:
    """An operator ``graph`` calls (or hands to a higher-order op) that torch and autopar do not
    define, or None."""
    for n in getattr(graph, "nodes", ()):
        if n.op != "call_function":
            continue
        for t in (n.target, *n.args, *n.kwargs.values()):
            if not own_op(t):
                return str(t)
    return None


def _files_of(template) -> dict[str, str] | None:
    """The files the trace ran code from (its nodes' stack traces, and the Python functions the
    graph calls), by content digest; None where one was modified after this process started."""
    graph = getattr(template, "graph", None)
    files: set[str] = set()
    for n in getattr(graph, "nodes", ()):
        st = n.meta.get("stack_trace")
        if st:
            files.update(_TRACE_FILE.findall(st))
        if n.op == "call_function" and isinstance(n.target, types.FunctionType):
            files.add(n.target.__code__.co_filename)
    out = {}
    for f in sorted(files):
        d = file_digest(f)
        if d is not None:
            out[f] = d
        elif os.path.isfile(f):  # (not "<string>" or a frozen module: a file changed since the start)
            return None
    return out


def _path(kind: str, name: str) -> Path | None:
    d = directory()
    return None if d is None else d / kind / f"{name}.bin"


def load(kind: str, name: str | None):
    """The template kept under ``name``, or None: none, unreadable, or made from a file that
    has changed since (each counted in ``STATS``)."""
    path = _path(kind, name) if name else None
    if path is None:
        return None
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        entry = pickle.loads(data)
        if entry.get("format") != FORMAT:
            return None
        if any(file_digest(f) != d for f, d in entry["files"].items()):  # (None: changed since this process began)
            _count(f"{kind} stale")
            return None
        from autopar import trace_share

        template = trace_share.decode(entry["payload"])
    except Exception:  # noqa: BLE001 - a file another torch or a crash left: trace afresh
        _count(f"{kind} unreadable")
        return None
    try:
        os.utime(path)  # (read: the last to be deleted)
    except OSError:
        pass
    _count(f"{kind} read")
    for noted in _NOTED.get():
        if kind not in noted:
            noted.append(kind)
    return template


@contextlib.contextmanager
def noting(kinds: list):
    """Inside: each kind read from disk is added to ``kinds`` (once; and to the lists of the
    ``noting`` around this one): a compile's record of them."""
    token = _NOTED.set(_NOTED.get() + (kinds,))
    try:
        yield kinds
    finally:
        _NOTED.reset(token)


def note(kinds) -> str | None:
    """The line a report gives to what was read from disk, or None."""
    if not kinds:
        return None
    return (f"read from autopar's trace cache ({directory()}), made by an earlier process from the same model, "
            f"code and torch: {', '.join(WHAT.get(k, k) for k in kinds)} (AUTOPAR_DISK_CACHE=0 traces afresh)")


# write-behind (``write_behind``): this process's saves, queued for ``finish_behind``; its pid
_BEHIND: list = []
_BEHIND_PID: int | None = None
_LOCK = ".writing"  # a writer behind holds a shared lock on it (``wait_for_writers``)


def write_behind() -> None:
    """From here on this process's saves are queued, and ``finish_behind`` writes them after the
    command's output, in a detached child: the console's ``plan`` / ``dump`` / ``explain``, which
    leave as soon as their output is out (the pickling, 0.15-0.2 s of a Llama-3-8B plan, is then
    off the command's time). A forked child of this process writes its own saves at once."""
    global _BEHIND_PID
    _BEHIND.clear()
    _BEHIND_PID = os.getpid()


def finish_behind() -> None:
    """Write what ``write_behind`` queued (a memo saved twice: its last state, once): in a forked
    child that leaves this process's output streams and session (a pipe's reader sees the end when
    this process leaves; the child holds ``_LOCK`` shared until it is done), or here where this
    process cannot fork (another thread runs: autopar/forked.py ``can_fork``)."""
    global _BEHIND_PID
    queue = {(kind, name): template for kind, name, template in _BEHIND}
    _BEHIND.clear()
    _BEHIND_PID = None
    root = directory()
    if not queue or root is None:
        return
    from autopar.forked import can_fork

    _started()  # (computed here, for the child: its own start is later)
    lock = None
    if can_fork():
        try:
            import fcntl

            root.mkdir(parents=True, exist_ok=True)
            lock = os.open(root / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(lock, fcntl.LOCK_SH)  # (taken before the fork: held until the child is done)
            pid = os.fork()
        except (OSError, ImportError):
            pid = -1
        if pid > 0:
            os.close(lock)
            return
        if pid == 0:
            try:
                os.setsid()
                null = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(null, fd)
                for (kind, name), template in queue.items():
                    save(kind, name, template)
            finally:
                os._exit(0)
    if lock is not None:
        os.close(lock)
    for (kind, name), template in queue.items():
        save(kind, name, template)


def wait_for_writers(cache_dir: str | None = None, timeout: float = 60.0) -> bool:
    """Wait until no writer behind (``finish_behind``) is writing into the cache (``cache_dir``: an
    ``AUTOPAR_CACHE_DIR``; default this process's): a benchmark's next run, a test that reads what
    a command wrote. False if one still is after ``timeout`` seconds."""
    root = directory() if cache_dir is None else Path(cache_dir) / f"traces-{FORMAT}"
    if root is None or not (root / _LOCK).exists():
        return True
    import fcntl

    fd = os.open(root / _LOCK, os.O_RDWR)
    try:
        end = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() > end:
                    return False
                time.sleep(0.02)
    finally:
        os.close(fd)


def save(kind: str, name: str | None, template) -> None:
    """Write ``template`` under ``name`` (atomically: a reader sees the whole file or none), or
    queue it (``write_behind``)."""
    path = _path(kind, name) if name else None
    if path is None:
        return
    if _BEHIND_PID == os.getpid():
        _BEHIND.append((kind, name, template))
        return
    from autopar import trace_share

    if foreign_op(getattr(template, "graph", None)) is not None:
        _count(f"{kind} custom op")
        return
    files = _files_of(template)
    if files is None:
        _count(f"{kind} edited")
        return
    payload = trace_share.encode(template)
    if payload is None or len(payload) > _MAX_ENTRY:
        return
    data = pickle.dumps({"format": FORMAT, "files": files, "payload": payload, "made": time.time()},
                        protocol=pickle.HIGHEST_PROTOCOL)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:  # (a read-only or full disk: the compile goes on; nothing is kept)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        return
    _count(f"{kind} written")
    _prune(path.parent.parent)


def _prune(root: Path) -> None:
    limit = int(float(os.environ.get("AUTOPAR_CACHE_MAX_MB", "1024")) * (1 << 20))
    try:
        files = [(p.stat(), p) for p in root.glob("*/*.bin")]
    except OSError:
        return
    total = sum(s.st_size for s, _ in files)
    for s, p in sorted(files, key=lambda sp: sp[0].st_mtime):
        if total <= limit:
            break
        try:
            p.unlink()
            total -= s.st_size
        except OSError:
            pass


def forget_memos() -> None:
    """The memo files this process read count as unread (their entries left the memo)."""
    _READ_MEMOS.clear()


@contextlib.contextmanager
def memo(kind: str, key, table: dict, keep=lambda table_key, value: True):
    """Around work that reads and fills ``table``, a memo keyed by everything its answers depend on
    (DTensor's strategies: propagate's ``_SHARED_STRATEGIES``), for one piece of work (``key``:
    the mesh's shape and the graph). Before it, the entries an earlier process wrote under ``key``
    are added to ``table``; the work adds each table key it reads or writes to the set this
    yields; after it, where it used one the file lacks, the file is written again with the entries
    it had and those used (those ``keep`` allows: pickled, and named by nothing a key misses)."""
    used: set = set()
    name = key_of(("memo", kind, key), ()) if directory() is not None else None
    if name is None:
        yield used
        return
    had = _READ_MEMOS.get(name)
    if had is None:
        got = load(kind, name)
        had = _READ_MEMOS[name] = got if isinstance(got, dict) else {}
        for k, v in had.items():
            table.setdefault(k, v)
    yield used
    new = {k: table[k] for k in used if k not in had and k in table and keep(k, table[k])}
    if new:
        had.update(new)
        save(kind, name, had)
