"""What tests/coll_chaos.py and tests/torch_chaos.py share: the ranks' threads and the
fault's thread, then the verdict (every rank an outcome; survivable faults end every
call; errors sooner than the timeout after the fault; closing ends) and one line."""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any


class Chaos:
    def __init__(self, n: int, timeout: float, errors: tuple[type, ...]) -> None:
        self.n, self.timeout, self.errors = n, timeout, errors
        self.outcome: list[Any] = [None] * n  # ("done", calls) or (error type, calls, message)
        self.errors_at: list[float | None] = [None] * n
        self.fault_at: list[float] = []
        self.bad: list[str] = []

    def ended(self, r: int, done: int, error: BaseException | None = None) -> None:
        """Rank r's outcome: every call done, an error the rank may raise (timed), or,
        with any other exception, a failure (with the traceback of the one being handled)."""
        if error is None:
            self.outcome[r] = ("done", done)
        elif isinstance(error, self.errors):
            self.errors_at[r] = time.monotonic()
            self.outcome[r] = (type(error).__name__, done, str(error)[:200])
        else:
            self.outcome[r] = ("UNEXPECTED", done)
            self.bad.append(f"rank {r}:\n{traceback.format_exc()}")

    def run(
        self, rank_main: Callable[[int], None], fault: Callable[[], None], delay: float
    ) -> float:
        """rank_main(r) on a thread per rank beside fault() `delay` seconds in (an error of
        the kinds the ranks may raise is the fault's own, e.g. close() raising the failure
        it waited for); seconds until all ended."""

        def do_fault() -> None:
            time.sleep(delay)  # the fault's moment, drawn from the seed (not a synchronisation)
            self.fault_at.append(time.monotonic())
            try:
                fault()
            except self.errors:
                pass
            except BaseException:
                self.bad.append(f"the fault:\n{traceback.format_exc()}")

        t0 = time.monotonic()
        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(self.n)]
        threads.append(threading.Thread(target=do_fault))
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout * 4 + 30)
            if t.is_alive():
                self.bad.append("a thread still runs after 4x the timeout")
        return time.monotonic() - t0

    def judge(self, fault: str, survivable: bool, calls: int) -> None:
        for r, o in enumerate(self.outcome):
            if o is None:
                self.bad.append(f"rank {r}: no outcome")
            elif survivable and o != ("done", calls):
                self.bad.append(f"rank {r} after a {fault} fault: {o}")
            at = self.errors_at[r]
            if at is not None and self.fault_at and at - self.fault_at[0] >= self.timeout:
                self.bad.append(
                    f"rank {r} raised {at - self.fault_at[0]:.1f} s after the fault: {o}"
                )

    def close(self, closes: list[Callable[[], None]], what: str) -> None:
        """Every rank's close at once (it is collective)."""
        threads = [threading.Thread(target=c) for c in closes]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout * 2 + 30)
            if t.is_alive():
                self.bad.append(f"{what} still runs after 2x the timeout")

    def report(self, head: str, took: float) -> int:
        """Prints the failures (stderr) and one line; the exit status."""
        for b in self.bad:
            print(b, file=sys.stderr)
        if "-v" in sys.argv:
            print(self.outcome)
        summary = [o[:2] if o else o for o in self.outcome]
        print(f"{head}; {took:.1f} s; {summary}; {len(self.bad)} failed")
        return 1 if self.bad else 0
