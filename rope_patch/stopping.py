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
        if not self.armed and not self.delegated:
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
                if number not in STOP_SIGNALS or self.delegated:
                    continue
                self.signals += 1
                if self.signals == 1:
                    self.requested.set()
                    if self.armed:
                        _say(self.notice)
                else:
                    _say(self.farewell)
                    os._exit(INTERRUPTED_STATUS)

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
        try:
            with self._sdpa_in_query_tiles():
                yield
        finally:
            self.armed -= 1
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
    """One message on its own line, clearing a progress bar's line first (from any thread)."""
    if not message:
        return
    try:
        from tqdm import tqdm

        tqdm.write(message, file=sys.stderr)
    except Exception:  # noqa: BLE001  the message matters more than the bar
        print(f"\n{message}", file=sys.stderr, flush=True)
    sys.stderr.flush()


CONTROL = StopControl()
