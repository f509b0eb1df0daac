"""`make reliability`'s disk class: every disk budget holds at every moment, and files are opened safely.

- budgets: a real llama-server (SmolLM2, 2 slots) with a save dir shared by two mitmdump processes that share
  no state (each one's pages are the other's "orphans"), eight sessions taking turns (each with its own text
  before the `Current date:` marker, so each builds its own prefix checkpoint) for `seconds`; the save dir's
  `page-*.bin` and `prefix-*.bin` bytes are sampled every 0.25 s (the acceptance asks for every second) and
  must never pass `slots_page_max_mb` and `slots_checkpoint_max_mb`. Reliability round 4 found 7.4 times the
  page budget on disk (replaced pages waiting a minute outside it, orphans swept once per process) and one
  prefix file per distinct system prompt (no cap by default).
- model path that blocks: a stub whose `/props` names a FIFO as the model and a new `media_marker` at every
  probe: new sessions are answered in time, and SIGINT ends mitmdump (before, every worker thread hung on the
  FIFO's open, new sessions timed out at 45 s and SIGINT was ignored).
- a symlink planted as `slots_log_file`: nothing is appended to its target.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from bench.reliability import Row, Soak

PAGE_MB = 24          # SmolLM2: ~23 KB of KV a token, so a 400-token conversation's page is ~9 MB
CHECKPOINT_MB = 12    # about two prefix files of ~250 tokens
SAMPLE_EVERY = 0.25


def _bytes(save: Path, pattern: str) -> int:
    total = 0
    for p in save.glob(pattern):
        with contextlib.suppress(OSError):  # deleted between the listing and the stat
            total += p.lstat().st_size
    return total


def _messages(tag: str, turn: int) -> list[dict[str, str]]:
    rules = " ".join(f"Rule {i} for agent {tag}: keep every answer short and cite the file you changed."
                     for i in range(12))
    msgs = [{"role": "system", "content": f"You are coding agent {tag}. {rules}\nCurrent date: 2026-01-01"},
            {"role": "user", "content": f"task of {tag}: list the files"}]
    for i in range(turn):
        msgs += [{"role": "assistant", "content": f"step {i} of {tag} " + "done. " * 20},
                 {"role": "user", "content": f"output {i} of {tag}: " + "a line of tool output. " * 10}]
    return msgs


class Sampler(threading.Thread):
    """The save dir's page and prefix bytes every SAMPLE_EVERY seconds: peaks and samples over budget."""

    def __init__(self, save: Path, page_cap: int, prefix_cap: int) -> None:
        super().__init__(daemon=True)
        self.save, self.page_cap, self.prefix_cap = save, page_cap, prefix_cap
        self.samples = self.over = self.page_peak = self.prefix_peak = self.page_files_peak = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            pages, prefixes = _bytes(self.save, "page-*.bin"), _bytes(self.save, "prefix-*.bin")
            self.samples += 1
            self.over += pages > self.page_cap or prefixes > self.prefix_cap
            self.page_peak, self.prefix_peak = max(self.page_peak, pages), max(self.prefix_peak, prefixes)
            self.page_files_peak = max(self.page_files_peak, len(list(self.save.glob("page-*.bin"))))
            time.sleep(SAMPLE_EVERY)


def budgets(soak: Soak, row: Row, seconds: float) -> None:
    """Eight sessions through two proxies sharing one save dir (and no state), taking turns on two slots."""
    from bench.reliability import chat

    save = soak.dir("g-save")
    with soak.server(slots=2, ctx_per_slot=2048, slot_save_path=str(save)) as srv:
        opts = {"slots_save_dir": str(save), "slots_page_max_mb": PAGE_MB, "slots_checkpoint_max_mb": CHECKPOINT_MB,
                "slots_probe_interval": 0}
        pxs = [soak.proxy(srv.url, {**opts, "slots_state_dir": str(soak.dir(f"g-state-{i}")),
                                    "slots_log_file": str(soak.root / f"g{i}.jsonl")}, f"g{i}") for i in range(2)]
        sampler = Sampler(save, PAGE_MB << 20, CHECKPOINT_MB << 20)
        sampler.start()
        codes: list[int] = []
        end = time.monotonic() + seconds

        def session(i: int) -> None:
            turn = 0
            while time.monotonic() < end:
                try:
                    codes.append(chat(pxs[i % 2].url, _messages(f"s{i}", turn % 8), timeout=300).status_code)
                except httpx.HTTPError:
                    codes.append(0)
                turn += 1

        threads = [threading.Thread(target=session, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(2 * SAMPLE_EVERY)
        sampler.stop.set()
        sampler.join()
        for px in pxs:
            row.memory_mb = max(row.memory_mb, soak.stop(px))
        paged = sum(p.read_text().count('"kind": "page"') for p in soak.root.glob("g*.jsonl"))
    row.requests += len(codes)
    row.lost += sum(c != 200 for c in codes)
    mb = lambda b: round(b / (1 << 20), 2)  # noqa: E731
    row.notes.update({"page_peak_mb": mb(sampler.page_peak), "page_budget_mb": PAGE_MB,
                      "page_peak_x_budget": round(sampler.page_peak / (PAGE_MB << 20), 2),
                      "page_files_peak": sampler.page_files_peak, "prefix_peak_mb": mb(sampler.prefix_peak),
                      "prefix_cap_mb": CHECKPOINT_MB, "disk_samples": sampler.samples,
                      "disk_samples_over_budget": sampler.over, "paging_steps": paged})
    row.check(all(c == 200 for c in codes), f"{row.lost} of {len(codes)} requests failed")
    row.check(sampler.over == 0, f"{sampler.over} of {sampler.samples} samples over a disk budget "
              f"(pages {mb(sampler.page_peak)}/{PAGE_MB} MB, prefixes {mb(sampler.prefix_peak)}/{CHECKPOINT_MB} MB)")
    row.check(paged > 0 and sampler.page_peak > 0 and sampler.prefix_peak > 0,
              "the soak paged nothing or built no checkpoint (no budget was tested)")


def blocking_model(soak: Soak, row: Row) -> None:
    """A FIFO as the model file, a new media_marker every probe: sessions served in time, SIGINT obeyed."""
    from bench.reliability import chat

    fifo = soak.dir("outside-disk") / "model.gguf"  # "outside": the output scan must not open it either
    os.mkfifo(fifo)
    row.faults += 1
    stub = soak.stub(model_path=str(fifo), new_marker=True)
    px = soak.proxy(stub, {"slots_state_dir": str(soak.dir("h-state")), "slots_probe_interval": 1}, "h-fifo")
    waits, codes = [], []
    for i in range(12):  # a probe a second asks for the model check again each time
        t0 = time.monotonic()
        try:
            codes.append(chat(px.url, [{"role": "user", "content": f"fifo {i}"}], timeout=60).status_code)
        except httpx.HTTPError:
            codes.append(0)
        waits.append(time.monotonic() - t0)
        time.sleep(1)
    status = httpx.get(px.url + "/_slots/status", timeout=30).status_code
    assert px.proc is not None
    t0 = time.monotonic()
    px.proc.send_signal(signal.SIGINT)
    try:
        px.proc.wait(15)
        exited = time.monotonic() - t0
    except Exception:
        exited = -1.0
        px.proc.kill()
    row.requests += len(codes) + 1
    row.lost += sum(c != 200 for c in codes)
    row.notes.update({"fifo_model_longest_wait_s": round(max(waits), 2), "fifo_model_sigint_exit_s": round(exited, 2)})
    if row.check(codes == [200] * 12 and max(waits) < 5 and status == 200 and 0 <= exited < 15,
                 f"FIFO model path: waits up to {max(waits):.1f} s, status {status}, SIGINT exit {exited:.1f} s"):
        row.survived += 1


def log_symlink(soak: Soak, row: Row) -> None:
    """A symlink planted as `slots_log_file`: its target gets nothing."""
    from bench.reliability import chat

    target = soak.dir("outside-disk") / "victim.txt"
    target.write_text("KEEP\n")
    link = soak.root / "i-planted.jsonl"
    link.symlink_to(target)
    row.faults += 1
    stub = soak.stub()
    px = soak.proxy(stub, {"slots_state_dir": str(soak.dir("i-state")), "slots_log_file": str(link)}, "i-link")
    codes = [chat(px.url, [{"role": "user", "content": f"link {i}"}], timeout=30).status_code for i in range(3)]
    time.sleep(1)  # the log is written a moment later, off the event loop
    row.memory_mb = max(row.memory_mb, soak.stop(px))
    appended = len(target.read_bytes()) - len(b"KEEP\n")
    row.requests += len(codes)
    row.notes["symlinked_log_bytes_appended"] = appended
    if row.check(codes == [200] * 3 and appended == 0 and link.is_symlink(),
                 f"symlinked slots_log_file: {appended} bytes appended to its target"):
        row.survived += 1


def run(soak: Soak, seconds: float = 60.0) -> Row:
    from bench.reliability import Row, timed

    row = Row("disk: budgets, blocking model path, log symlink")
    with timed(row):
        budgets(soak, row, seconds)
        blocking_model(soak, row)
        log_symlink(soak, row)
    return row
