"""The model checks: what the model and the start-up probe mean for slot files, the page budget, the speeds
(pure part), and the driver that reads the header, runs the probe and gates paging (scripted server)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import pytest

from slotkeeper.drivers import gguf_io
from slotkeeper.drivers.upstream import Upstream
from slotlogic import capability, wording
from slotlogic.answers import Observation
from slotlogic.decisions import RequestFacts
from slotlogic.events import Event, ModelDescribed, ModelHeader, Probed, SpeedsMeasured
from slotlogic.model_facts import ModelFacts, ReuseKind
from slotlogic.server import CacheMode
from slotlogic.settings import CheckpointMode, Settings
from tests.conftest import FakeLlama
from tests.test_model_facts import common, write_gguf

LLAMA = {"general.architecture": "llama", "llama.block_count": 30, "llama.context_length": 8192,
         "llama.embedding_length": 576, "llama.attention.head_count": 9, "llama.attention.head_count_kv": 3}
GEMMA3 = {"general.architecture": "gemma3", "gemma3.block_count": 12, "gemma3.context_length": 8192,
          "gemma3.embedding_length": 640, "gemma3.attention.head_count": 4, "gemma3.attention.head_count_kv": 1,
          "gemma3.attention.key_length": 256, "gemma3.attention.value_length": 256,
          "gemma3.attention.sliding_window": 512}
MAMBA = {"general.architecture": "mamba", "mamba.block_count": 4, "mamba.embedding_length": 256,
         "mamba.ssm.conv_kernel": 4, "mamba.ssm.inner_size": 512, "mamba.ssm.state_size": 16}


def facts(meta):
    return ModelFacts.from_metadata(meta)


def test_the_probe_takes_only_an_empty_idle_slot():
    live = [{"id": 0, "n_prompt_tokens": 0, "is_processing": True}, {"id": 1, "n_prompt_tokens": 9},
            {"id": 2, "n_prompt_tokens": 0}, {"id": 3, "n_prompt_tokens": 0}]
    assert capability.probe_slot(live, 4) == 3 and capability.probe_slot(live, 3) == 2
    assert capability.probe_slot(live[:2], 4) is None and capability.probe_slot(None, 4) is None
    body = capability.probe_request(3)
    assert body["id_slot"] == 3 and body["cache_prompt"] is False and "slotkeeper" in body["prompt"]
    assert capability.probe_file("http://u:1").startswith("slotkeeper-probe-") and "/" not in \
        capability.probe_file("http://u:1/../x")


def test_speeds_come_from_the_probes_timings():
    t = {"timings": {"prompt_per_second": 312.5, "predicted_per_second": 45.0, "prompt_n": 301, "predicted_n": 24}}
    assert capability.throughput(t, 2) == capability.Throughput(312.5, 45.0, 301, 24, 2)
    assert capability.throughput({"timings": {"prompt_per_second": 0}}, 2) is None
    assert capability.throughput("nonsense", 2) is None


def test_only_sliding_window_and_recurrent_models_need_the_probe_save_and_only_with_files_wanted():
    assert not capability.needs_file_check(facts(LLAMA), False, True)
    assert capability.needs_file_check(facts(GEMMA3), False, True)
    assert not capability.needs_file_check(facts(GEMMA3), True, True)        # --swa-full: resumes anyway
    assert not capability.needs_file_check(facts(GEMMA3), False, False)      # no files wanted: nothing to gate
    assert capability.needs_file_check(facts(MAMBA), False, True)
    v = capability.verdict(facts(MAMBA), False, False)
    assert (v.files_ok, v.kind) == (False, ReuseKind.CHECKPOINTS_ONLY)
    assert capability.verdict(facts(MAMBA), False, True).files_ok
    assert capability.verdict(None, False, None).files_ok                     # no header: as before


def test_the_page_budget_in_tokens_and_the_status_view():
    f = facts(LLAMA)
    per_1k = f.slot_file_bytes_per_1k_tokens(n_tokens=4096)
    tokens = capability.page_budget_tokens(f, 8192 << 20, "f16", "f16", 4096)
    assert tokens == int((8192 << 20) / (per_1k / 1000)) and 350_000 < tokens < 400_000   # ~23 KB per token
    assert capability.page_budget_tokens(facts({}), 1 << 30, "f16", "f16", 4096) is None
    speed = capability.Throughput(300.0, 40.0, 300, 24, 1)
    out = capability.status(f, capability.verdict(f, False, None), speed, page_budget_bytes=8192 << 20,
                            paging=True, cache_type_k="f16", cache_type_v="f16", n_ctx=4096)
    assert out["model"]["architecture"] == "llama" and out["model"]["kv_bytes_per_token"] == 23040
    assert out["model"]["slot_files"] == "on" and out["page_budget"] == {"mb": 8192, "tokens": tokens}
    assert out["throughput"] == {"prefill_tok_s": 300.0, "decode_tok_s": 40.0}
    json.dumps(out)


def test_a_page_budget_too_small_for_the_model_is_said_once_with_the_size_that_holds_two_contexts_a_slot():
    """At GPU speeds a 70B-class model's page (320 KiB a token) is ~2 GB at 6K tokens: the 8 GB default holds four,
    and pages pushed out before their sessions came back were a third of the time paging cost in the simulator
    (bench/sim/gpu.py). The model's start-up lines say so and name the size that holds two full contexts a slot."""
    big = facts(LLAMA | {"llama.block_count": 80, "llama.embedding_length": 8192, "llama.attention.head_count": 64,
                         "llama.attention.head_count_kv": 8})
    per_token = big.kv_bytes_per_token("f16", "f16", 32768)
    assert per_token == 320 * 1024

    def lines(budget_mb: int, model: ModelFacts) -> str:
        e = ModelDescribed("http://s", model, "f16", "f16", 32768, False, None, True, budget_mb << 20, 4)
        return wording.event_line(e)[1]

    said = lines(8192, big)
    assert "the page budget (slots_page_max_mb 8,192) holds ~26,214 tokens" in said
    assert "(4 × 32,768)" in said and f"slots_page_max_mb={2 * 4 * 32768 * 320 // 1024} keeps them" in said
    assert "page budget" not in lines(81920, big)                     # two contexts a slot fit
    assert "page budget" not in lines(8192, facts(LLAMA))             # SmolLM2's 23 KB a token: 8 GB is plenty
    paging_off = ModelDescribed("http://s", big, "f16", "f16", 32768, False, None, True, 0, 4)
    assert "page budget" not in wording.event_line(paging_off)[1]


# --- the driver: header, probe, gate ---------------------------------------------------------------------------

class ProbeLlama(FakeLlama):
    """A scripted server whose `/props` names a model file the test wrote, and whose probe save reports a file
    size with or without checkpoints."""

    def __init__(self, path: Path, extra_bytes: int) -> None:
        super().__init__(total=2)
        self.props_data["model_path"] = str(path)  # type: ignore[index]
        self.extra = extra_bytes
        self.posts: list[tuple[str, Any]] = []
        self.facts = ModelFacts.from_metadata(gguf_io.read_header(path).metadata or {})

    async def post_json(self, path: str, body: Any, timeout: float) -> tuple[int, Any]:
        if path == "/v1/messages":  # the Anthropic route probe (not this test's business)
            return 0, None
        self.posts.append((path, body))
        if path == "/completion":
            return 200, {"timings": {"prompt_per_second": 250.0, "predicted_per_second": 50.0, "prompt_n": 300,
                                     "predicted_n": 24}}
        if path.endswith("action=save"):
            return 200, {"n_saved": 323, "n_written": self.facts.slot_file_bytes(323, n_streams=2) + self.extra,
                         "timings": {"save_ms": 2.0}}
        if path.endswith("action=restore"):
            return 200, {"n_restored": 323, "n_read": self.facts.slot_file_bytes(323, n_streams=2) + self.extra,
                         "timings": {"restore_ms": 1.0}}
        return 200, {}


def gemma3_file(tmp_path: Path) -> Path:
    def fill(w: gguf.GGUFWriter) -> None:
        common(w, layers=12, embd=640, heads=4)
        w.add_head_count_kv(1)
        w.add_key_length(256)
        w.add_value_length(256)
        w.add_sliding_window(512)
    return write_gguf(tmp_path / "gemma3.gguf", "gemma3", fill)


async def start(tmp_path: Path, llama: FakeLlama, **settings: Any) -> tuple[Upstream, list[Event]]:
    save = tmp_path / "slots"
    save.mkdir(exist_ok=True)
    events: list[Event] = []
    s = Settings(save_dir=str(save), paging=True, checkpoints=CheckpointMode.DISK, **settings)
    up = Upstream("http://up", s, tmp_path / "state", events.append, client=llama)
    # a server whose cache mode is known: that probe's own one-token requests are not this test's business (its
    # slots are claimed as the model check's are: tests/test_keeper.py; both on a real server: test_real_model_check)
    up.keeper.facts.cache_mode_found(CacheMode.KEEPS)
    await up.prober.probe()
    await up.settle()
    return up, events


@pytest.mark.parametrize(("extra", "files"), [(0, False), (6000, True)])
async def test_a_sliding_window_model_keeps_slot_files_only_where_the_probe_save_shows_checkpoints(
        tmp_path, extra, files):
    llama = ProbeLlama(gemma3_file(tmp_path), extra)
    up, events = await start(tmp_path, llama)
    paths = [p for p, _ in llama.posts]
    assert paths == ["/completion", "/slots/1?action=save", "/slots/1?action=erase"]
    assert llama.posts[0][1]["id_slot"] == 1 and llama.posts[1][1]["filename"].startswith("slotkeeper-probe-")
    assert (up.pages is not None) == files and up.checkpoints is not None
    assert up.checkpoints.persist == files                        # disk checkpoints off, memory warm-ups stay
    kinds = [type(e) for e in events]
    assert kinds == [ModelHeader, SpeedsMeasured, Probed, ModelDescribed], events  # the save's speed
    text = "\n".join(wording.event_line(e)[1] for e in events)
    assert "model: gemma3, 12 layers" in text and "slot file ~" in text
    if files:
        assert "slot files carry context checkpoints" in text and "writes its checkpoints into slot files" in text
        assert "stay off" not in text
    else:
        assert ("checkpoint and page files stay off: a restore could not resume (start llama-server with "
                "--swa-full and set slots_swa_full)") in text
    status = up.status_now()
    assert status["model"]["slot_files"] == ("on" if files else "off")
    assert status["model"]["checkpoints_in_files"] is files and status["throughput"] is None


async def test_with_swa_full_there_is_nothing_to_probe(tmp_path):
    llama = ProbeLlama(gemma3_file(tmp_path), 0)
    up, events = await start(tmp_path, llama, swa_full=True)
    assert llama.posts == [] and up.pages is not None
    assert "runs with --swa-full" in wording.event_line(events[-1])[1]


async def test_the_throughput_probe_feeds_the_status_and_the_seconds_saved(tmp_path):
    path = write_gguf(tmp_path / "llama.gguf", "llama", lambda w: common(w, 4), vocab=100)
    llama = ProbeLlama(path, 0)
    up, events = await start(tmp_path, llama, throughput_probe=True)
    # the probe's file is saved and read back once: the slot save and restore speeds (slotlogic.costs)
    assert [p for p, _ in llama.posts] == ["/completion", "/slots/1?action=save", "/slots/1?action=restore",
                                           "/slots/1?action=erase"]
    assert up.pages is not None and up.status_now()["throughput"] == {"prefill_tok_s": 250.0, "decode_tok_s": 50.0}
    text = "\n".join(wording.event_line(e)[1] for e in events if wording.logged(e))
    assert "start-up probe on slot 1: prefill 250 tok/s (300 tokens), decode 50 tok/s (24 tokens)" in text
    per_token = llama.facts.slot_file_bytes(323, n_streams=2) / 323
    speeds = up.status_now()["speeds"]
    assert speeds["prefill_tok_s"] == 250.0 and speeds["kv_bytes_per_token"] == round(per_token)
    assert speeds["save_mb_s"] == round(per_token * 323 / 0.002 / 1e6, 1)
    assert speeds["restore_mb_s"] == round(per_token * 323 / 0.001 / 1e6, 1)
    assert "slot save speed" in text and "slot restore speed" in text
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}).encode()
    decision = up.keeper.request(RequestFacts("POST", "/v1/messages", (), body, 0.0))
    up.answered(decision.ticket, Observation(cache_n=500, prompt_n=20), path="/v1/messages", seconds=3.0)
    assert up.keeper.status(up.store.last, 0.0)["sessions"][decision.ticket.session.short]["saved_s"] == 2.0
    # the same again in 0.1 s: 2.0 s more at that speed, but the session's requests took 3.1 s in all
    up.answered(decision.ticket, Observation(cache_n=500, prompt_n=20), path="/v1/messages", seconds=0.1)
    assert up.keeper.status(up.store.last, 0.0)["sessions"][decision.ticket.session.short]["saved_s"] == 3.1


async def test_a_model_file_that_is_not_here_changes_nothing(tmp_path):
    llama = FakeLlama(total=2)
    llama.props_data["model_path"] = str(tmp_path / "elsewhere.gguf")  # type: ignore[index]
    up, events = await start(tmp_path, llama)
    assert up.pages is not None and up.checkpoints is not None and up.checkpoints.persist
    assert [type(e) for e in events] == [ModelHeader]
    assert "model file not on this machine (remote llama-server?)" in wording.event_line(events[0])[1]
    assert up.status_now()["model"] is None and up.status_now()["page_budget"]["tokens"] is None


async def test_a_restart_with_another_model_is_checked_again_and_a_restart_with_the_same_one_is_quiet(tmp_path):
    path = write_gguf(tmp_path / "llama.gguf", "llama", lambda w: common(w, 4), vocab=100)
    llama = ProbeLlama(path, 0)
    up, events = await start(tmp_path, llama)
    assert [type(e) for e in events] == [ModelHeader, ModelDescribed]
    llama.props_data["media_marker"] = "<__media_b__>"                      # restarted, same model: quiet
    await up.prober.probe()
    await up.settle()
    assert [type(e) for e in events][-1] is not ModelHeader and len([e for e in events
                                                                     if isinstance(e, ModelDescribed)]) == 1
    llama.props_data |= {"media_marker": "<__media_c__>", "model_path": str(gemma3_file(tmp_path))}
    await up.prober.probe()
    await up.settle()
    described = [e for e in events if isinstance(e, ModelDescribed)]
    assert len(described) == 2 and described[-1].facts.architecture == "gemma3" and up.pages is None
