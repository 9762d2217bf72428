"""Progress of a benchmark run: a rich progress bar when rich is installed, else plain lines."""

from __future__ import annotations

import sys
import time


class PlainProgress:
    def __init__(self, total: int, stream=None):
        self.total = total
        self.done = 0
        self.stream = stream or sys.stderr
        self.t0 = time.monotonic()

    def _print(self, text: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.1f}s] {text}", file=self.stream, flush=True)

    def note(self, text: str) -> None:
        self._print(text)

    def trial_started(self, text: str) -> None:
        self._print(f"({self.done + 1}/{self.total}) {text} ...")

    def trial_done(self, text: str) -> None:
        self.done += 1
        self._print(f"({self.done}/{self.total}) {text}")

    def add_total(self, trials: int) -> None:
        """More trials than planned at the start (a second phase)."""
        self.total += trials

    def close(self) -> None:
        pass


class RichProgress(PlainProgress):
    def __init__(self, total: int):
        super().__init__(total)
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = Console(stderr=True, log_path=False)
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(),
                            TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                            console=self.console, transient=False)
        self.task = self.bar.add_task("trials", total=total)
        self.bar.start()

    def note(self, text: str) -> None:
        self.bar.console.log(text)

    def trial_started(self, text: str) -> None:
        self.bar.update(self.task, description=text)

    def trial_done(self, text: str) -> None:
        self.done += 1
        self.bar.console.log(text)
        self.bar.update(self.task, advance=1)

    def add_total(self, trials: int) -> None:
        super().add_total(trials)
        self.bar.update(self.task, total=self.total)

    def close(self) -> None:
        self.bar.stop()


def make_progress(total: int, plain: bool = False):
    if not plain:
        try:
            return RichProgress(total)
        except ImportError:
            pass
    return PlainProgress(total)
