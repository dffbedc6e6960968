"""Serves the model's solution module to its grader over two pipes.

Run as `python3 -I -S solution_server.py REQUEST_FD REPLY_FD` in the
solution's own sandbox, beside `solution.py` and `plain_data.py`; never
imported by ptx, standard library only. The model's code shares this process
and may change anything in it: the grader trusts nothing that comes from here
and checks every message itself.

Messages are frames of a 4-byte big-endian length and one plain_data value.
The server first sends ("hello", exports, modules): what `from solution
import *` would bind (honouring `__all__`) and, for the names bound to
modules, the module's name; or ("import_error", type name, args). Then it
answers the grader's requests one at a time:

  (id, "call", target, args, kwargs)          -> target(*args, **kwargs)
  (id, "getattr", target, name)               -> getattr(target, name)
  (id, "method", target, name, args, kwargs)  -> getattr(target, name)(...)

with (id, "ok", value), (id, "raise", type name, args) or (id, "unsendable",
why). A value that is not plain data goes as a handle, payload (index, type
name), into a table that keeps it alive for the rest of the run; requests
name their targets by those indices. The server exits when the grader closes
the request pipe, at once even while the solution's code is running.
"""

import _thread
import os
import select
import sys

_MESSAGE_CHARS = 1000  # of an exception's message, when its args are not plain data


class _Whole:
  """Marks a value to be sent as one handle (its parts are not all plain data)."""

  def __init__(self, value):
    self.value = value


class _Table:
  """The solution's objects the grader holds handles to, by index."""

  def __init__(self):
    self.objects = []
    self.index = {}  # id(object) -> index: an object keeps its handle

  def ref(self, x):
    """The handle payload for `x`."""
    if type(x) is _Whole:
      x = x.value
    i = self.index.get(id(x))
    if i is None:
      i = self.index[id(x)] = len(self.objects)
      self.objects.append(x)
    return (i, type(x).__name__)

  def get(self, i):
    """The object behind the grader's handle `i`."""
    if type(i) is not int or not 0 <= i < len(self.objects):
      raise ValueError(f"no solution object #{i!r}")
    return self.objects[i]


def _exit_when_closed(fd: int) -> None:
  """Exits the process once the grader has closed `fd` (its request pipe)."""
  poller = select.poll()
  poller.register(fd, 0)  # no events asked for: only a hang-up wakes it
  poller.poll()
  os._exit(0)


def _read(fd: int, n: int) -> bytes | None:
  """Reads exactly `n` bytes, or None at end of file."""
  chunks = []
  while n:
    chunk = os.read(fd, n)
    if not chunk:
      return None
    chunks.append(chunk)
    n -= len(chunk)
  return b"".join(chunks)


def _write(fd: int, data: bytes) -> None:
  data = memoryview(len(data).to_bytes(4, "big") + data)
  while data:
    data = data[os.write(fd, data):]


def _args(e: BaseException, plain_data) -> tuple:
  """What the grader rebuilds `e` from: its args when they are plain data, else its message."""
  try:
    if len(plain_data.encode(e.args)) <= 4 * _MESSAGE_CHARS:
      return e.args
  except Exception:  # noqa: BLE001  (not plain data, or too large: fall back on the message)
    pass
  try:
    return (str(e)[:_MESSAGE_CHARS],)
  except Exception:  # noqa: BLE001  (a __str__ that raises)
    return ("<unprintable>",)


def _exports(module) -> tuple[dict, dict]:
  """What `from solution import *` binds, and the module names of those that are modules."""
  names = getattr(module, "__all__", None)
  if names is None:
    names = [n for n in vars(module) if not n.startswith("_")]
  exports = {}
  for name in names:
    if type(name) is not str:
      raise TypeError(f"Item in solution.__all__ must be str, not {type(name).__name__}")
    exports[name] = getattr(module, name)
  modules = {n: v.__name__ for n, v in exports.items() if type(v) is type(sys) and type(v.__name__) is str}
  return exports, modules


def _serve(request, table: _Table):
  """Runs one request; returns the reply (before encoding)."""
  rid, op, target = request[:3]
  try:
    if op == "call":
      args, kwargs = request[3:]
      value = target(*args, **kwargs)
    elif op == "getattr":
      value = getattr(target, request[3])
    else:
      name, args, kwargs = request[3:]
      value = getattr(target, name)(*args, **kwargs)
  except BaseException as e:  # noqa: BLE001  (SystemExit too: the grader decides what it means)
    return (rid, "raise", type(e).__name__, e)
  return (rid, "ok", value)


def _encode(reply, table: _Table, plain_data) -> bytes:
  """Encodes a reply; a value with non-plain parts where handles cannot go becomes one handle."""
  if reply[1] == "raise":
    reply = reply[:3] + (_args(reply[3], plain_data),)
  try:
    return plain_data.encode(reply, table.ref)
  except plain_data.NotPlainData:
    try:
      return plain_data.encode(reply[:2] + (_Whole(reply[2]),), table.ref)
    except Exception as e:  # noqa: BLE001  (see below)
      why = e
  except Exception as e:  # noqa: BLE001  (too large, too deep: the grader hears why)
    why = e
  return plain_data.encode((reply[0], "unsendable", f"{type(why).__name__}: {why}"[:_MESSAGE_CHARS]))


def main() -> None:
  """Imports the solution, says hello, then serves requests until the grader hangs up."""
  request_fd, reply_fd = int(sys.argv[1]), int(sys.argv[2])
  _thread.start_new_thread(_exit_when_closed, (request_fd,))
  # -I leaves the script's folder off sys.path; plain_data and solution live there.
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import plain_data
  table = _Table()
  try:
    import solution
    exports, modules = _exports(solution)
    hello = plain_data.encode(("hello", {n: _hello_value(v, table, plain_data) for n, v in exports.items()},
                               modules), table.ref)
  except BaseException as e:  # noqa: BLE001  (SystemExit at import included: it failed to import)
    hello = plain_data.encode(("import_error", type(e).__name__, _args(e, plain_data)))
  _write(reply_fd, hello)
  while True:
    header = _read(request_fd, 4)
    frame = header and _read(request_fd, int.from_bytes(header, "big"))
    if frame is None:
      break
    request = plain_data.decode(frame, table.get)
    _write(reply_fd, _encode(_serve(request, table), table, plain_data))
  # The solution's own threads must not keep the process alive.
  os._exit(0)


def _hello_value(value, table: _Table, plain_data):
  """An exported value, or a whole handle for it when it cannot go as plain data with handles."""
  try:
    plain_data.encode(value, table.ref)
    return value
  except Exception:  # noqa: BLE001  (not plain data, or too large to send whole)
    return _Whole(value)


if __name__ == "__main__":
  main()
