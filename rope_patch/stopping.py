"""Ctrl-C for every job: the first one stops at the next safe point within seconds, a second one ends the process at
once; the command line then says, on a line of its own, the command that resumes.

Python runs a signal handler only between bytecodes of the main thread, so a SIGINT that arrives during one long
forward (a 32k-token window on a CPU: minutes) would wait for the whole forward. Here the signal is seen at once by a
watcher thread (``signal.set_wakeup_fd``: the interpreter's C-level handler writes the signal's number to a pipe),
which sets a flag; forward pre-hooks on every decoder layer and its direct children, installed for the job's
forwards only (``stoppable``), read the flag and raise ``JobInterrupted``. Finished results are already on disk (the
stores write each result the moment it exists), and a forward stopped halfway has written nothing. The second signal
makes the watcher print the resume command and leave with status 130, whatever the main thread is doing.

Outside a forward (loading, tokenizing, writing reports) the first signal raises ``JobInterrupted`` as soon as the
main thread runs Python again. Without ``listening`` (a Python caller), nothing here changes Python's own Ctrl-C.

One mechanism, two policies. Evaluations stop at the next decoder layer (``stoppable``); training stops at the end of
its optimizer step (``train/interrupt.py``'s ``StopRequest``, which takes the signals over and agrees on the step
across processes with one all-reduce). Under ``accelerate launch`` or torchrun, Ctrl-C reaches the launcher, which
sends it to every process; a signal may also reach one process alone. While an evaluation's forwards run, each
process shares its stop through the process group's key-value store (``_StopExchange``: a key set by the first
process stopped, polled by the others a few times a second), so every process stops at its next layer. A process
left waiting in a collective for one that stopped is released when that one exits, and that error is a stop too.
Only the main process (rank 0) says anything: the notice, and the one command that resumes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where hooks are installed: `rope-patch --help` imports this module
    from torch import nn

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
TILED_FROM = 8192  # forwards of this many tokens or more run SDPA over query tiles, the stop checked between them
STOP_TILE = 2048  # queries per tile: a 32k-token layer's attention in 16 steps
INTERRUPTED_STATUS = 130  # 128 + SIGINT, what shells report for a command stopped by Ctrl-C
POLL_SECONDS = 0.2  # how often a process of a multi-process evaluation looks for another one's stop


def is_main_process() -> bool:
    """Whether this process speaks for the run: rank 0 of ``accelerate launch``/torchrun (their ``RANK``), or a
    process started alone. Read from the environment, so it holds before the process group exists."""
    return os.environ.get("RANK", "0") == "0"


class JobInterrupted(KeyboardInterrupt):
    """A job stopped by Ctrl-C or SIGTERM at a safe point: everything it finished is saved, nothing half-done is."""

    def __init__(self, where: str = "") -> None:
        self.where = where
        super().__init__(f"interrupted{' ' + where if where else ''}")


class StopControl:
    """The process's one listener (``CONTROL``). ``listening`` (the command line, around a job) installs the handlers;
    ``stoppable(model)`` (a job, around its forwards) installs the layer hooks; ``requested`` says a stop was asked."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.signals = 0
        self.armed = 0  # > 0 while a job's forwards run: the first signal waits for the next layer
        self.delegated = 0  # > 0 while a job handles signals itself (finetune finishes its step)
        self.farewell = ""  # what the second signal prints before the process ends
        self.notice = ""  # what the first signal prints
        self.on_layer: Callable[[int, int], None] | None = None  # (layers done, layers) during one forward
        self.exchanges = 0  # stoppable blocks entered: each multi-process one shares its stop under its own key
        self.quiet = 0  # > 0 while the command line reports a stop: further signals wait for it

    @contextlib.contextmanager
    def listening(self, *, notice: str, farewell: str) -> Iterator[StopControl]:
        """Handle SIGINT and SIGTERM for the block (main thread only; elsewhere Python's defaults stay)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        self.requested.clear()
        self.signals, self.notice, self.farewell = 0, notice, farewell
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        previous_handlers = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        previous_fd = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        watcher = threading.Thread(target=self._watch, args=(read_end,), name="rope-patch-stop", daemon=True)
        watcher.start()
        try:
            yield self
        finally:
            signal.set_wakeup_fd(previous_fd)
            for number, handler in previous_handlers.items():
                signal.signal(number, handler)
            os.close(write_end)  # the watcher reads the end of the pipe and returns
            watcher.join(timeout=5)
            os.close(read_end)
            self.requested.clear()

    def _handle(self, number: int, frame) -> None:
        """Python's part, in the main thread between bytecodes: outside a forward, stop right here."""
        if not self.armed and not self.delegated and not self.quiet:
            raise JobInterrupted()

    def _watch(self, read_end: int) -> None:
        while True:
            try:
                received = os.read(read_end, 64)
            except OSError:
                return
            if not received:
                return
            for number in received:
                if number not in STOP_SIGNALS or self.delegated or self.quiet:
                    continue
                self.signals += 1
                if self.signals == 1:
                    self.requested.set()
                    if self.armed:
                        _say(self.notice)
                else:
                    _say(self.farewell)
                    os._exit(INTERRUPTED_STATUS)

    @contextlib.contextmanager
    def reporting(self) -> Iterator[None]:
        """While the command line says how a stopped run resumes, a further signal (a launcher ending the processes
        of a run one of which stopped) neither interrupts the message nor prints a second one."""
        self.quiet += 1
        try:
            yield
        finally:
            self.quiet -= 1

    def check(self, where: str = "") -> None:
        """Raise ``JobInterrupted`` if a stop was asked (a safe point: nothing half-written)."""
        if self.requested.is_set():
            raise JobInterrupted(where)

    @contextlib.contextmanager
    def stoppable(self, model: nn.Module) -> Iterator[None]:
        """The block's forwards stop at the next decoder layer (or a layer's next part: attention, MLP) once a stop
        is asked; ``on_layer`` hears each layer begin. The hooks are removed afterwards."""
        layers = decoder_layers(model)
        hooks = []

        def before_part(_module, _args) -> None:
            self.check("during a forward")

        for index, layer in enumerate(layers):
            hooks.append(layer.register_forward_pre_hook(self._layer_hook(index, len(layers))))
            hooks += [child.register_forward_pre_hook(before_part) for child in layer.children()]
        self.armed += 1
        self.exchanges += 1
        exchange = _StopExchange.start(self, f"rope_patch/stop/{self.exchanges}")
        try:
            with self._sdpa_in_query_tiles():
                yield
        except KeyboardInterrupt:
            if exchange is not None:  # told before this process leaves: the others may be waiting for it
                exchange.publish()
            raise
        except Exception as error:  # a collective left by a process that stopped: a stop here too, said in one line
            if self.requested.is_set() or (exchange is not None and exchange.asked_elsewhere()):
                self.requested.set()
                raise JobInterrupted("while the other processes stopped") from error
            raise
        finally:
            self.armed -= 1
            if exchange is not None:
                exchange.close()
            for hook in hooks:
                hook.remove()

    @contextlib.contextmanager
    def _sdpa_in_query_tiles(self) -> Iterator[None]:
        """transformers' SDPA attention, for the block, run over query tiles of ``STOP_TILE`` rows when a forward has
        ``TILED_FROM`` tokens or more, the stop checked between tiles: one layer's attention over 32k tokens is
        minutes on a CPU, a tile seconds. Each tile attends to the keys up to its last query (causal), under the
        model's own mask where it passes one; the same attention, in another summation order."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        had_local = "sdpa" in ALL_ATTENTION_FUNCTIONS._local_mapping
        previous = ALL_ATTENTION_FUNCTIONS._local_mapping.get("sdpa")
        whole = ALL_ATTENTION_FUNCTIONS["sdpa"]
        ALL_ATTENTION_FUNCTIONS["sdpa"] = self._tiled(whole)
        try:
            yield
        finally:
            if had_local:
                ALL_ATTENTION_FUNCTIONS["sdpa"] = previous
            else:
                del ALL_ATTENTION_FUNCTIONS["sdpa"]

    def _tiled(self, whole: Callable) -> Callable:
        import torch

        def sdpa_by_query_tiles(module, query, key, value, attention_mask, *args, **kwargs):
            length = query.shape[2]  # query: (B, H, L, D)
            # Only on a CPU: there a 32k layer is minutes. On a GPU it is milliseconds, and an explicit mask would
            # take SDPA off its flash/cuDNN kernels; the layer hooks are enough there.
            plain = (query.device.type != "cpu" or length < TILED_FROM or key.shape[2] != length or args
                     or kwargs.get("dropout", 0.0)
                     or kwargs.get("position_bias") is not None or kwargs.get("is_causal") is False
                     or (attention_mask is not None and attention_mask.shape[-1] != length))
            if plain:
                return whole(module, query, key, value, attention_mask, *args, **kwargs)
            kwargs.pop("is_causal", None)
            outputs = []
            for start in range(0, length, STOP_TILE):
                self.check("during a forward")
                end = min(length, start + STOP_TILE)
                if attention_mask is None:  # causal: row i of the tile sees keys 0 .. start + i
                    mask = torch.ones(end - start, end, dtype=torch.bool, device=query.device).tril(diagonal=start)
                else:
                    mask = attention_mask[..., start:end, :end]
                out, _ = whole(module, query[:, :, start:end], key[:, :, :end], value[:, :, :end], mask,
                               is_causal=False, **kwargs)
                outputs.append(out)  # (B, tile, H, D)
            return torch.cat(outputs, dim=1), None
        return sdpa_by_query_tiles

    def _layer_hook(self, index: int, count: int):
        def before_layer(_module, _args) -> None:
            self.check("during a forward")
            if self.on_layer is not None:
                self.on_layer(index, count)
        return before_layer

    @contextlib.contextmanager
    def layer_progress(self, callback: Callable[[int, int], None]) -> Iterator[None]:
        """``callback(layers done, layers)`` before each decoder layer of the block's forwards (a bar advancing
        within one long forward)."""
        previous, self.on_layer = self.on_layer, callback
        try:
            yield
        finally:
            self.on_layer = previous


class _StopExchange:
    """A stop shared by every process of a run through the process group's store (the launcher's TCP store): the
    first process stopped sets ``key`` (at once, by its poller, and in any case before it leaves); a thread in each
    polls it every ``POLL_SECONDS`` and stops its own process. Only where a process group of several processes
    exists."""

    def __init__(self, control: StopControl, store, key: str) -> None:
        self.control, self.store, self.key = control, store, key
        self.closed = threading.Event()
        self.published = False
        self.thread = threading.Thread(target=self._poll, name="rope-patch-stop-exchange", daemon=True)
        self.thread.start()

    @classmethod
    def start(cls, control: StopControl, key: str) -> _StopExchange | None:
        try:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
                return None
            store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001  no store to share through: each process hears its own signals
            return None
        return cls(control, store, key)

    def asked_elsewhere(self) -> bool:
        try:
            return bool(self.store.check([self.key]))
        except Exception:  # noqa: BLE001  the store went with the launcher
            return False

    def publish(self) -> None:
        """Tell the other processes (once) that this one stops."""
        if not self.published:
            self.published = True
            try:
                self.store.set(self.key, "1")
            except Exception:  # noqa: BLE001  the store went with the launcher, which stops every process itself
                pass

    def _poll(self) -> None:
        while not self.closed.wait(POLL_SECONDS):
            try:
                if self.control.requested.is_set():
                    self.publish()
                elif self.store.check([self.key]):
                    self.control.requested.set()
                    if self.control.armed and is_main_process():
                        _say(self.control.notice)
            except Exception:  # noqa: BLE001  the store is gone (the launcher stopped): each process on its own
                return

    def close(self) -> None:
        self.closed.set()
        self.thread.join(timeout=5)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder's layers in order: its ``layers``, else the longest ``nn.ModuleList`` of the model."""
    from torch import nn

    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return list(layers)
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def _say(message: str) -> None:
    """One message on its own line, clearing a progress bar's line first (from any thread); only the main process
    speaks."""
    if not message or not is_main_process():
        return
    try:
        from tqdm import tqdm

        tqdm.write(message, file=sys.stderr)
    except Exception:  # noqa: BLE001  the message matters more than the bar
        print(f"\n{message}", file=sys.stderr, flush=True)
    sys.stderr.flush()


CONTROL = StopControl()
