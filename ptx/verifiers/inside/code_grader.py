"""Runs a task's tests against a solution that lives in another process; prints the verdict.

Run as `python3 -I -S code_grader.py REQUEST_FD REPLY_FD` in a sandbox of its own,
beside `plain_data.py`; never imported by ptx, standard library only. Its
standard input is one plain_data message, (nonce, tests, budget_s): the test
sources, already rewritten by `ptx.envs.python_tests` so that
`==` and `!=`, `in` and `not in`, and method calls go through `_ptx_eq`
(plain_data.same), `_ptx_in` (plain_data.contains) and `_ptx_method`; and
the seconds all of them may take. It talks to solution_server.py across the
pipes, and when done prints one JSON line:

  {"nonce": ..., "passed": n, "total": m, "failed": i, "kind": k, "failure": why}

`failed` is the index of the first failing test (null when all passed) and
`kind` says why: "wrong" (an assert or another exception), "timeout" (no
reply before the deadline, or test code still running at it), "gone" (the
solution's process closed the channel: it exited or was killed), "protocol"
(it sent something that is not a well-formed reply). A test passes only when
it runs to its end without an exception (SystemExit included) and no request
it made met a broken channel, even one its code caught.

What the tests see: the names `from solution import *` would bind, except
dunder names and names of builtins (so `len` is always the real one), with
modules the solution imported replaced by the grader's own copy of that
standard-library module. Plain data arrives as plain data; anything else is a
`Remote` handle that can be called, have attributes read and methods called,
and give `str()` and `len()`; its equality is identity, and truth, hashing,
iteration and arithmetic raise TypeError. An exception raised by solution
code arrives as the builtin exception of that name (when there is one that
derives from Exception), so `except ValueError` works, else as SolutionError.
Test code cannot pass the solution its own functions or objects (callbacks):
only plain data and Remote handles cross.
"""

import _signal  # not `signal`: that one imports enum, a few milliseconds of every run
import builtins
import os
import select
import sys
import time

# -I leaves the script's folder off sys.path; plain_data lives there. Appended,
# so that it shadows no standard module.
sys.path.append(os.path.dirname(os.path.abspath(__file__)))
import plain_data

_TICK_S = 0.1  # after the deadline, test code that swallowed it is interrupted again this often
_MESSAGE_CHARS = 300  # of a failure's message
_OUTPUT_CHARS = 4096  # of what test code prints, kept (and dropped) in memory
# Standard modules that act when imported; never imported for a solution.
_ACTS_ON_IMPORT = frozenset({"this", "antigravity", "__hello__", "__phello__"})


class ChannelError(BaseException):
  """The solution cannot answer: gone, too slow or garbled. Not an Exception: tests cannot catch it by accident."""

  def __init__(self, kind: str, message: str):
    super().__init__(message)
    self.kind = kind


class SolutionError(Exception):
  """An exception raised by solution code whose type is not a builtin exception."""


class _Deadline(BaseException):
  """Test code was still running when the budget ran out."""


class _Clock:
  """The budget of the whole run, and an alarm that interrupts test code past it."""

  def __init__(self, budget_s: float):
    self.budget_s = budget_s
    self.deadline = time.monotonic() + budget_s
    self.armed = False  # only test code is interrupted, never the grader's own bookkeeping
    _signal.signal(_signal.SIGALRM, self._fire)
    _signal.setitimer(_signal.ITIMER_REAL, budget_s, _TICK_S)

  def left(self) -> float:
    return self.deadline - time.monotonic()

  def stop(self) -> None:
    self.armed = False
    _signal.setitimer(_signal.ITIMER_REAL, 0)

  def _fire(self, signum, frame) -> None:
    if self.armed:
      raise _Deadline()


def _not_plain(what: str):
  def refuse(self, *args):
    raise TypeError(f"{what} of {self!r}: the solution returned a value that is not plain data; "
                    "the tests can only call it, read its attributes, call its methods, str() and len() it")
  return refuse


class Remote:
  """A solution object, held by handle: calls, attribute reads and method calls go to its process."""

  __slots__ = ("_ptx_channel", "_ptx_index", "_ptx_type")

  def __init__(self, channel, index: int, type_name: str):
    object.__setattr__(self, "_ptx_channel", channel)
    object.__setattr__(self, "_ptx_index", index)
    object.__setattr__(self, "_ptx_type", type_name[:100])

  def __call__(self, *args, **kwargs):
    return self._ptx_channel.request("call", self, args, kwargs)

  def __getattr__(self, name: str):
    # Python's own probes (__length_hint__, __reduce_ex__, ...) stay here.
    if name.startswith("__") and name.endswith("__"):
      raise AttributeError(name)
    return self._ptx_channel.request("getattr", self, name)

  def __setattr__(self, name, value):
    raise TypeError(f"cannot set {name!r} of {self!r}: the tests may only call solution objects")

  def __eq__(self, other) -> bool:
    return self is other

  def __ne__(self, other) -> bool:
    return self is not other

  __hash__ = _not_plain("hash")

  def __repr__(self) -> str:
    return f"<solution {self._ptx_type} #{self._ptx_index}>"

  def __str__(self) -> str:
    return self._ptx_typed("__str__", str)

  def __len__(self) -> int:
    n = self._ptx_typed("__len__", int)
    if n < 0:
      raise ValueError(f"len() of {self!r} is {n}")
    return n

  def _ptx_typed(self, method: str, kind: type):
    value = self._ptx_channel.request("method", self, method, (), {})
    if type(value) is not kind:
      raise TypeError(f"{method} of {self!r} returned a {type(value).__name__}, not {kind.__name__}")
    return value


for _name in ("bool", "iter", "reversed", "contains", "getitem", "setitem", "delitem", "lt", "le", "gt", "ge",
              "add", "radd", "sub", "rsub", "mul", "rmul", "truediv", "rtruediv", "floordiv", "rfloordiv",
              "mod", "rmod", "pow", "rpow", "neg", "pos", "abs", "int", "float", "complex", "index", "round"):
  setattr(Remote, f"__{_name}__", _not_plain(_name))


def _rebuild(name: str, args: tuple) -> Exception:
  """The exception the tests see for one raised by solution code."""
  cls = getattr(builtins, name, None)
  if isinstance(cls, type) and issubclass(cls, Exception):
    try:
      return cls(*args)
    except Exception:
      pass
  return SolutionError(f"{name}: {_short(args[0] if len(args) == 1 else args)}")


def _short(value) -> str:
  text = value if type(value) is str else repr(value)
  return text if len(text) <= _MESSAGE_CHARS else text[:_MESSAGE_CHARS] + "..."


class Channel:
  """The grader's end of the pipes: one request at a time, each within the clock's deadline."""

  def __init__(self, request_fd: int, reply_fd: int, clock: _Clock):
    os.set_blocking(request_fd, False)
    self.request_fd, self.reply_fd, self.clock = request_fd, reply_fd, clock
    self.readable, self.writable = select.poll(), select.poll()
    self.readable.register(reply_fd, select.POLLIN)
    self.writable.register(request_fd, select.POLLOUT)
    self.buffer = bytearray()
    self.last_id = 0
    self.remotes = {}  # index -> Remote, so a solution object has one handle (identity holds)
    self.broken = None  # the ChannelError that broke it; every later request fails with it
    self.failures = 0  # requests that failed for the channel's sake

  def request(self, op: str, target: Remote, *rest):
    """Sends one request and returns the solution's answer (or raises what it raised)."""
    if self.broken is None and self.clock.left() <= 0:
      self.broken = ChannelError("timeout", f"the {self.clock.budget_s} s for the tests ran out")
    if self.broken is not None:
      self.failures += 1
      raise ChannelError(self.broken.kind, str(self.broken))
    self.last_id += 1
    try:
      message = plain_data.encode((self.last_id, op, target, *rest), self._payload)
    except (plain_data.NotPlainData, plain_data.TooLarge) as e:
      raise TypeError(f"cannot pass that to the solution ({e}): only plain data and solution objects cross") from None
    try:
      self._send(message)
      reply = self._receive()
    except ChannelError as e:
      self.broken = e
      self.failures += 1
      raise
    except _Deadline:
      # The alarm came while the solution kept us waiting. Out of step from
      # here on: a frame may be half read.
      self.broken = ChannelError("timeout", f"the solution did not answer within the {self.clock.budget_s} s")
      self.failures += 1
      raise ChannelError(self.broken.kind, str(self.broken)) from None
    return self._answer(reply)

  def hello(self) -> tuple[dict, dict]:
    """Waits for the solution's exports; raises ChannelError, or SolutionError when it did not import."""
    hello = self._receive()
    if type(hello) is tuple and len(hello) == 3 and hello[0] == "hello" and type(hello[1]) is dict \
        and type(hello[2]) is dict:
      return hello[1], hello[2]
    if type(hello) is tuple and len(hello) == 3 and hello[0] == "import_error" and type(hello[1]) is str \
        and type(hello[2]) is tuple:
      args = hello[2][0] if len(hello[2]) == 1 else hello[2]
      raise SolutionError(f"the solution did not import: {hello[1]}: {_short(args)}")
    raise ChannelError("protocol", f"the solution's first message is not a hello: {_short(hello)}")

  def _answer(self, reply):
    ok = type(reply) is tuple and len(reply) >= 3 and type(reply[0]) is int and reply[0] == self.last_id
    if ok and reply[1] == "ok" and len(reply) == 3:
      return reply[2]
    if ok and reply[1] == "raise" and len(reply) == 4 and type(reply[2]) is str and type(reply[3]) is tuple:
      raise _rebuild(reply[2], reply[3])
    if ok and reply[1] == "unsendable" and len(reply) == 3:
      raise SolutionError(f"the solution's answer could not be sent: {_short(reply[2])}")
    self.broken = ChannelError("protocol", f"the solution's reply is malformed: {_short(reply)}")
    self.failures += 1
    raise ChannelError(self.broken.kind, str(self.broken))

  def _payload(self, x) -> int:
    if type(x) is Remote and x._ptx_channel is self:
      return x._ptx_index
    raise plain_data.NotPlainData(f"a {type(x).__name__} is neither plain data nor a solution object")

  def _remote(self, payload) -> Remote:
    if not (type(payload) is tuple and len(payload) == 2 and type(payload[0]) is int and payload[0] >= 0
            and type(payload[1]) is str):
      raise plain_data.DecodeError(f"a handle must be (index, type name), got {_short(payload)}")
    remote = self.remotes.get(payload[0])
    if remote is None:
      remote = self.remotes[payload[0]] = Remote(self, *payload)
    return remote

  def _wait(self, poller) -> bool:
    left = self.clock.left()
    return left > 0 and bool(poller.poll(int(left * 1000) + 1))

  def _send(self, data: bytes) -> None:
    view = memoryview(len(data).to_bytes(4, "big") + data)
    while view:
      try:
        view = view[os.write(self.request_fd, view):]
      except BlockingIOError:
        pass
      except BrokenPipeError:
        raise ChannelError("gone", "the solution's process ended before reading the request") from None
      if view and not self._wait(self.writable):
        raise ChannelError("timeout", f"the solution took no request within the {self.clock.budget_s} s")

  def _receive(self):
    n = int.from_bytes(self._take(4), "big")
    if n > plain_data.MAX_MESSAGE_BYTES:
      raise ChannelError("protocol", f"the solution announced a message of {n} bytes "
                                     f"(at most {plain_data.MAX_MESSAGE_BYTES})")
    try:
      return plain_data.decode(self._take(n), self._remote)
    except plain_data.DecodeError as e:
      raise ChannelError("protocol", f"the solution sent a malformed message: {e}") from None

  def _take(self, n: int) -> bytes:
    while len(self.buffer) < n:
      if not self._wait(self.readable):
        raise ChannelError("timeout", f"the solution did not answer within the {self.clock.budget_s} s")
      chunk = os.read(self.reply_fd, 1 << 16)
      if not chunk:
        raise ChannelError("gone", "the solution's process ended (or closed the channel) before answering")
      self.buffer += chunk
    data = bytes(self.buffer[:n])
    del self.buffer[:n]
    return data


def _method(obj, name: str, /, *args, **kwargs):
  """`obj.name(*args, **kwargs)`, one request when `obj` is a solution object."""
  if type(obj) is Remote:
    return obj._ptx_channel.request("method", obj, name, args, kwargs)
  return getattr(obj, name)(*args, **kwargs)


_HELPERS = {"_ptx_eq": plain_data.same, "_ptx_in": plain_data.contains, "_ptx_method": _method}


def _own_module(name):
  """The grader's own copy of a standard module the solution imported, or None."""
  top = name.partition(".")[0] if type(name) is str else ""
  if top not in sys.stdlib_module_names or top in _ACTS_ON_IMPORT:
    return None
  try:
    __import__(name)
    return sys.modules[name]
  except Exception:
    return None


def _namespace(exports: dict, modules: dict) -> dict:
  """The tests' globals: what `from solution import *` binds, as far as it is safe to."""
  module = type(sys)("solution")  # for tests that import solution themselves
  namespace = {"__name__": "__main__", "__builtins__": builtins}
  for name, value in exports.items():
    if type(name) is not str or not name.isidentifier() or name.startswith("__"):
      continue
    if name in modules:
      value = _own_module(modules[name])
      if value is None:
        continue
    setattr(module, name, value)
    if not hasattr(builtins, name):
      namespace[name] = value
  sys.modules["solution"] = module
  return {**namespace, **_HELPERS}


def _describe(e: BaseException) -> str:
  try:
    text = str(e)
  except Exception:
    text = ""
  return _short(f"{type(e).__name__}: {text}" if text else type(e).__name__)


def _run_one(index: int, source: str, namespace: dict, channel: Channel, clock: _Clock):
  """Runs one test; returns None when it passed, else (kind, why)."""
  before = channel.failures
  try:
    code = compile(source, f"<test {index + 1}>", "exec", dont_inherit=True, optimize=0)
    try:
      clock.armed = True
      exec(code, namespace)
    finally:
      clock.armed = False
  except ChannelError as e:
    failure = (e.kind, str(e))
  except _Deadline:
    failure = ("timeout", f"the tests were still running at the end of their {clock.budget_s} s")
  except BaseException as e:
    failure = ("wrong", _describe(e))
  else:
    failure = None
  if channel.failures > before and (failure is None or failure[0] == "wrong"):
    failure = (channel.broken.kind, str(channel.broken))  # its code caught the channel's error
  return failure


class _Sink:
  """Where test code's prints go: kept short, never on the verdict's stdout."""

  def __init__(self):
    self.text = ""

  def write(self, text: str) -> int:
    self.text = (self.text + text)[:_OUTPUT_CHARS]
    return len(text)

  def flush(self) -> None:
    pass


def _json(value) -> str:
  """JSON for None, int and str (ASCII only), without importing json (it imports re)."""
  if value is None:
    return "null"
  if type(value) is int:
    return str(value)
  text = value.encode("ascii", "backslashreplace").decode("ascii").replace("\\", "\\\\").replace('"', '\\"')
  return '"' + "".join(c if " " <= c != "\x7f" else f"\\u{ord(c):04x}" for c in text) + '"'


def _grade(tests, channel: Channel, clock: _Clock) -> tuple[list, tuple | None]:
  """Runs the tests; returns each one's result and, when the solution never started, why."""
  try:
    namespace = _namespace(*channel.hello())
  except ChannelError as e:
    return [], (e.kind, str(e))
  except SolutionError as e:
    return [], ("wrong", _short(str(e)))
  results = []
  for i, source in enumerate(tests):
    if clock.left() <= 0:
      break
    results.append(_run_one(i, source, namespace, channel, clock))
  return results, None


def main() -> None:
  """Reads the tests, grades them against the solution, prints the verdict."""
  request_fd, reply_fd = int(sys.argv[1]), int(sys.argv[2])
  data = b""
  while chunk := os.read(0, 1 << 16):
    data += chunk
  nonce, tests, budget_s = plain_data.decode(data)
  clock = _Clock(budget_s)
  sys.stdout = sys.stderr = _Sink()
  try:
    results, not_started = _grade(tests, Channel(request_fd, reply_fd, clock), clock)
  finally:
    clock.stop()
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
  failed = next((i for i, r in enumerate(results) if r is not None), None)
  if not_started is not None:
    failed, (kind, failure) = 0, not_started
  elif failed is not None:
    kind, failure = results[failed]
  elif len(results) < len(tests):
    failed, kind, failure = len(results), "timeout", f"not run: the {budget_s} s for the tests ran out"
  else:
    kind, failure = "", ""
  verdict = {"nonce": nonce, "passed": results.count(None), "total": len(tests), "failed": failed,
             "kind": kind, "failure": failure}
  os.write(1, ("{" + ", ".join(f'"{k}": {_json(v)}' for k, v in verdict.items()) + "}\n").encode())


if __name__ == "__main__":
  main()
