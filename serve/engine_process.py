"""``EngineProcess``: an engine run in a child process, behind the interface the server uses (``submit``,
``refuse``, ``shutdown``, the tokenizer and shape, and the gauges ``active``, ``waiting``, ``steps``, ...).

Why a process: onnxruntime-genai's Python calls keep the GIL while the model runs (onnxruntime's release it), so an
engine thread running a cohort step starves the server's event loop for the whole step: requests arrive late,
responses leave late, streams stall. Measured on SmolLM2 (one-shot 1.2x, 16 closed-loop clients, 64 tokens): the
same engine gave 257 tok/s in-process without HTTP but 129 tok/s behind the server. In its own process the engine
keeps its GIL to itself and the server's loop only moves bytes.

Protocol (one ``multiprocessing`` pipe, pickled tuples): parent -> child ``("submit", id, prompt_ids, params,
stream, group)``, ``("cancel", id)``, ``("shutdown",)``; child -> parent ``("ready",)`` or ``("load_error", text)``,
then ``("event", id, kind, payload)`` for every engine event, ``("stats", {...})`` every 50 ms, and ``("fatal", text)``
when the engine's worker dies. A child that disappears (killed, crashed) is fatal too: every pending request gets an
error and ``on_fatal`` is called, as for an engine that dies in-process.

The child is forked (Linux): it inherits the loaded modules, so it starts in well under a second; it builds the
engine itself (nothing of onnxruntime-genai exists in the parent).
"""

from __future__ import annotations

import multiprocessing
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from bdlora.models.runtime import DecoderShape
from bdlora.models.tokenizer import TextTokenizer
from bdlora.serve.genai_engine import trailing_pad
from bdlora.serve.interface import ServingEngine
from bdlora.serve.sequence import Request, safe_emit

_STATS = ("active", "steps", "decode_rows", "runs", "failed")
_STATS_EVERY = 0.05  # seconds between the child's gauge reports
_CANCEL_EVERY = 0.05  # seconds between the parent's scans for cancelled requests


def _child(conn, engine_cls, args: tuple, kw: dict) -> None:
    # A terminal's Ctrl-C (or a supervisor's SIGTERM) reaches the whole process group: the server drains and then
    # sends "shutdown"; this process must not die under the requests it is still finishing.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    lock = threading.Lock()

    def send(msg) -> None:
        with lock:
            conn.send(msg)

    try:
        eng = engine_cls(*args, on_fatal=lambda m: send(("fatal", m)), **kw)
    except Exception as e:  # noqa: BLE001  the parent raises it as the load error
        send(("load_error", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
        return
    send(("ready", {"pad": getattr(eng, "pad", None)}))
    live: dict[int, Request] = {}
    stop = threading.Event()

    def report() -> None:
        while not stop.wait(_STATS_EVERY):
            try:
                send(("stats", {**{k: getattr(eng, k) for k in _STATS}, "waiting": eng.waiting}))
            except (OSError, ValueError):
                return

    threading.Thread(target=report, name="bdlora-engine-stats", daemon=True).start()

    def emitter(rid: int):
        def emit(kind: str, payload) -> None:
            if kind in ("done", "error"):
                live.pop(rid, None)
            send(("event", rid, kind, payload))
        return emit

    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the server is gone
                break
            if msg[0] == "submit":
                _, rid, ids, params, stream, group = msg
                req = Request(ids, params, emitter(rid), stream=stream, group=group)
                live[rid] = req
                eng.submit(req)
            elif msg[0] == "cancel":
                req = live.pop(msg[1], None)
                if req is not None:
                    req.cancel()
            elif msg[0] == "shutdown":
                break
    finally:
        stop.set()
        eng.shutdown()


class EngineProcess(ServingEngine):
    """``engine_cls(*args, **kw)`` built and run in a child process; the same surface as ``Engine`` for the
    server (``held()`` and the model itself stay in the child)."""

    def __init__(self, engine_cls: type, onnx_dir: str | Path, *args, on_fatal: Callable[[str], None] | None = None,
                 **kw):
        self.dir = Path(onnx_dir)
        self.shape = DecoderShape.from_folder(self.dir)
        self.max_positions = self.shape.max_positions
        self.on_fatal = on_fatal
        self.error: str | None = None
        self.active = self.steps = self.decode_rows = self.runs = self.failed = 0
        self._child_waiting = 0
        self._pending: dict[int, Request] = {}
        self._lock = threading.Lock()  # sends, and the pending map
        self._closing = False
        ctx = multiprocessing.get_context("fork")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child, args=(child, engine_cls, (str(onnx_dir), *args), kw),
                                 name="bdlora-engine", daemon=True)
        self._proc.start()
        child.close()
        try:
            first = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise RuntimeError(f"the engine process exited while loading (exit code {self._proc.exitcode})") from None
        if first[0] == "load_error":
            self._proc.join(5)
            raise RuntimeError(first[1])
        self.pad = first[1].get("pad")
        self.tokenizer = TextTokenizer(self.dir)  # after the fork: the child never shares the parent's tokenizer
        self.tokenizer.max_token_bytes()  # measured once here, not in the first request
        self._reader = threading.Thread(target=self._read, name="bdlora-engine-events", daemon=True)
        self._reader.start()
        self._canceller = threading.Thread(target=self._watch_cancels, name="bdlora-engine-cancels", daemon=True)
        self._canceller.start()

    # --------------------------------------------------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        """Requests not yet running: what the child last reported queued, plus what was sent since (so a burst is
        counted before the child's next report)."""
        with self._lock:
            return max(self._child_waiting, len(self._pending) - self.active)

    @property
    def tracked(self) -> int:
        """Requests sent to the engine process and not yet finished (its own structures are the child's): 0 once
        idle, else a leak."""
        with self._lock:
            return len(self._pending)

    def refuse(self, prompt_ids: list[int]) -> str | None:
        """The child engine's rule, known here so a refused prompt never crosses the pipe (genai: a trailing pad
        id)."""

        return trailing_pad(self.pad, prompt_ids)

    def _accept(self, req: Request) -> None:
        with self._lock:
            self._pending[req.id] = req
            try:
                self._conn.send(("submit", req.id, list(req.prompt_ids), req.params, req.stream, req.group))
            except (OSError, ValueError) as e:
                self._pending.pop(req.id, None)
                safe_emit(req, "error", f"the engine process is gone ({type(e).__name__})")

    def shutdown(self, timeout: float = 30.0) -> None:
        self._closing = True
        with self._lock:
            try:
                self._conn.send(("shutdown",))
            except (OSError, ValueError):
                pass
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)

    # --------------------------------------------------------------------------------------------------------------

    def _read(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "event":
                _, rid, kind, payload = msg
                with self._lock:
                    req = self._pending.get(rid) if kind not in ("done", "error") else self._pending.pop(rid, None)
                if req is not None:
                    safe_emit(req, kind, payload)
            elif msg[0] == "stats":
                with self._lock:
                    for k in _STATS:
                        setattr(self, k, msg[1][k])
                    self._child_waiting = msg[1]["waiting"]
            elif msg[0] == "fatal":
                self._die(msg[1])
        if not self._closing:
            self._proc.join(1)
            self._die(f"the engine process exited (exit code {self._proc.exitcode})")

    def _die(self, message: str) -> None:
        if self.error is not None:
            return
        self.error = message
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for req in pending:
            safe_emit(req, "error", message)
        if self.on_fatal is not None:
            self.on_fatal(message)

    def _watch_cancels(self) -> None:
        """Forward cancellations (a client hung up): the child drops the sequence at its next step."""
        while not self._closing and self.error is None:
            time.sleep(_CANCEL_EVERY)
            with self._lock:
                gone = [rid for rid, r in self._pending.items() if r.cancelled.is_set()]
                for rid in gone:
                    del self._pending[rid]
                    try:
                        self._conn.send(("cancel", rid))
                    except (OSError, ValueError):
                        return
