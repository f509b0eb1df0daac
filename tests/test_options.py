"""The proxy's options: every bad value stops the proxy with an error that names the option, and every
option is documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from mitmproxy import exceptions
from mitmproxy.test import taddons

from slotkeeper import addon as addon_module
from slotkeeper.mitm import options

DOCS = Path(__file__).resolve().parent.parent / "docs" / "options.md"

BAD = [("slots_policy", "bogus"), ("slots_prefix_cache", "bogus"), ("slots_anthropic", "bogus"),
       ("slots_side_patterns", ["("]), ("slots_save_dir", "/nonexistent"), ("slots_cache_type", "q9_9"),
       ("slots_cache_type", "f16,f16,f16"), ("slots_state_url", "ftp://x"), ("slots_upstreams", ["nope"]),
       *((name, least - 1) for name, (least, _) in options.MINIMUMS.items())]


@pytest.mark.parametrize(("opt", "value"), BAD)
def test_a_bad_value_is_refused_naming_its_option(opt, value):
    addons = addon_module.make_addons()
    with taddons.context(*addons) as tctx, pytest.raises(exceptions.OptionsError, match=opt):
        tctx.configure(addons[1], **{opt: value})


@pytest.mark.parametrize("name", sorted(options.MINIMUMS))
def test_the_smallest_accepted_value_is_accepted(name, tmp_path):
    addons = addon_module.make_addons()
    with taddons.context(*addons) as tctx:
        tctx.configure(addons[1], slots_state_dir=str(tmp_path / "state"), **{name: options.MINIMUMS[name][0]})
        assert addons[1].rt.settings is not None


def test_options_from_strings_build_one_settings_object():
    addons = addon_module.make_addons()
    with taddons.context(*addons) as tctx:
        tctx.options.set("slots_policy=seed", "slots_ttl=30", "slots_session_headers=X-A",
                         "slots_session_headers=x-b", "slots_cache_type=q8_0,f16")
        s = addons[1].rt.settings
        assert s.policy.value == "seed" and s.ttl == 30 and s.session_headers == ("x-a", "x-b")
        assert (s.cache_type_k, s.cache_type_v) == ("q8_0", "f16")


def test_every_option_of_every_addon_is_in_docs_options_md():
    documented = set(re.findall(r"`(slots_[a-z_]+)`", DOCS.read_text()))
    addons = addon_module.make_addons()
    with taddons.context(*addons) as tctx:
        ours = {name for name in tctx.options._options if name.startswith("slots_")}
    assert ours and ours <= documented, sorted(ours - documented)


def test_prefix_checkpoints_have_a_cap_by_default_derived_from_the_page_budget(tmp_path):
    """No cap was the default: any client filled the disk with one prefix file per distinct system prompt."""
    addons = addon_module.make_addons()
    with taddons.context(*addons) as tctx:
        tctx.configure(addons[1], slots_state_dir=str(tmp_path / "state"))
        assert addons[1].rt.settings.checkpoint_max_bytes == 2048 << 20
        tctx.configure(addons[1], slots_page_max_mb=100)
        assert addons[1].rt.settings.checkpoint_max_bytes == 25 << 20
        tctx.configure(addons[1], slots_checkpoint_max_mb=0)
        assert addons[1].rt.settings.checkpoint_max_bytes == 0  # the operator's explicit choice


def test_every_option_is_described_in_under_80_words():
    """A user can predict an option from its description: its row in docs/options.md and its help text each say
    it in under 80 words (the details live in the docs the row points to)."""
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(slots_[a-z_]+)` \|[^|]*\|(.*)\|\s*$",
                                                         DOCS.read_text(), re.M)}
    with taddons.context(*addon_module.make_addons()) as tctx:
        names = [n for n in tctx.options._options if n.startswith("slots_")]
        helps = {n: tctx.options._options[n].help for n in names}
    assert len(names) > 30 and set(rows) >= set(names)
    wordy = {n: len(t.split()) for n, t in [*rows.items(), *helps.items()] if len(t.split()) >= 80}
    assert wordy == {}
