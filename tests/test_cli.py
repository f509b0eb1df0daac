"""The `slotkeeper` command's arguments: the mitmdump command line it runs, one line and exit status 2 for a
malformed upstream or listen address, `--addon-path`; and the repository's `addon.py` shim loading, as
`mitmdump -s` loads it, the same addon chain as the packaged `slotkeeper/addon.py`. (The installed command
itself, answering a request, is tests/test_wheel_install.py.)"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from mitmproxy.addons.script import load_script

from slotkeeper import addon as packaged
from slotkeeper.cli import main

ROOT = Path(__file__).resolve().parent.parent


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_the_command_line_is_make_runs_with_the_listen_address_save_dir_and_passed_options(capsys, tmp_path):
    code, out, err = run(capsys, "--upstream", "http://127.0.0.1:8080/", "--listen", "0.0.0.0:9000",
                         "--save-dir", str(tmp_path), "--dry-run", "--", "--set", "slots_policy=seed")
    assert (code, err) == (0, "")
    argv = out.split()
    assert Path(argv[0]).name == "mitmdump"
    assert argv[1:3] == ["-s", str(ROOT / "slotkeeper" / "addon.py")]
    joined = " ".join(argv)
    assert "--mode reverse:http://127.0.0.1:8080@0.0.0.0:9000" in joined
    for flag in ("connection_strategy=lazy", "flow_detail=0", "termlog_verbosity=alert",
                 f"slots_save_dir={tmp_path.resolve()}"):
        assert f"--set {flag}" in joined
    assert argv[-2:] == ["--set", "slots_policy=seed"]  # after ours: a passed option wins


def test_web_runs_mitmweb_and_the_default_listen_address_is_loopback(capsys):
    code, out, _ = run(capsys, "--upstream", "https://llama.example:8443", "--web", "--web-port", "9100",
                       "--dry-run")
    argv = out.split()
    assert code == 0 and Path(argv[0]).name == "mitmweb"
    assert "reverse:https://llama.example:8443@127.0.0.1:8081" in argv and "web_port=9100" in argv


@pytest.mark.parametrize(("upstream", "says"), [
    ("127.0.0.1:8080", "needs the scheme http:// or https://"),
    ("ftp://127.0.0.1:8080", "needs the scheme http:// or https://"),
    ("http://127.0.0.1:99999", "is not a URL like http://127.0.0.1:8080"),
    ("http://127.0.0.1:80x", "is not a URL like http://127.0.0.1:8080"),
    ("http://:8080", "names no host"),
    ("http://127.0.0.1:8080/v1", "only scheme, host and port"),
    ("http://u:p@127.0.0.1:8080", "only scheme, host and port"),
])
def test_a_malformed_upstream_is_one_line_and_exit_status_2(capsys, upstream, says):
    code, out, err = run(capsys, "--upstream", upstream)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith("slotkeeper: --upstream ") and says in err, err


@pytest.mark.parametrize("listen", ["127.0.0.1:0", "127.0.0.1:x", ":8081", "127.0.0.1:70000",
                                    # a second address smuggled into mitmproxy's mode spec; an unbracketed IPv6;
                                    # a bracketed IPv4; a host that is not a name
                                    "127.0.0.1:8081@0.0.0.0:9999", "::1:8081", "[127.0.0.1]:8081", "a b:8081",
                                    "host/x:8081"])
def test_a_malformed_listen_address_is_one_line_and_exit_status_2(capsys, listen):
    code, out, err = run(capsys, "--upstream", "http://127.0.0.1:8080", "--listen", listen, "--dry-run")
    assert (code, out) == (2, "") and err.count("\n") == 1 and err.startswith("slotkeeper: --listen "), err


def test_listen_accepts_ipv6_in_brackets_and_host_names(capsys):
    for listen, mode in (("[::1]:9001", "@::1:9001"), ("localhost:9002", "@localhost:9002"),
                         ("9003", "@127.0.0.1:9003")):
        code, out, err = run(capsys, "--upstream", "http://[::1]:8080", "--listen", listen, "--dry-run")
        assert (code, err) == (0, "") and f"reverse:http://[::1]:8080{mode}" in out, out


@pytest.mark.parametrize("port", ["0", "70000", "-1"])
def test_a_web_port_the_ui_would_not_listen_on_as_printed_is_one_line_and_exit_status_2(capsys, port):
    code, out, err = run(capsys, "--upstream", "http://127.0.0.1:8080", "--web", "--web-port", port, "--dry-run")
    assert (code, out) == (2, "") and err == f"slotkeeper: --web-port {port} is not a port in 1..65535\n", err


def test_dry_run_prints_arguments_a_shell_splits_back_into_the_same_argv(capsys, tmp_path):
    save = tmp_path / "save dir; touch $HOME/x"
    code, out, err = run(capsys, "--upstream", "http://127.0.0.1:8080", "--save-dir", str(save), "--dry-run",
                         "--", "--set", "slots_api_key=a b'c")
    assert (code, err) == (0, "")
    argv = shlex.split(out)
    assert f"slots_save_dir={save.resolve()}" in argv and argv[-1] == "slots_api_key=a b'c"


def test_no_upstream_is_one_line_and_exit_status_2(capsys):
    code, _, err = run(capsys)
    assert code == 2 and err == "slotkeeper: --upstream URL is required (e.g. --upstream http://127.0.0.1:8080)\n"


def test_addon_path_prints_the_packaged_addon(capsys):
    code, out, _ = run(capsys, "--addon-path")
    assert code == 0 and Path(out.strip()) == Path(packaged.__file__).resolve()


def test_the_root_addon_py_loads_the_packaged_addon_chain_as_mitmdump_loads_a_script():
    module = load_script(str(ROOT / "addon.py"))
    assert module is not None
    names = [type(a).__name__ for a in module.addons]
    assert names == [type(a).__name__ for a in packaged.make_addons()]
    assert names == ["LocalApi", "Pinning", "Watchdog", "FlowView", "RequestLog", "Commands"]
