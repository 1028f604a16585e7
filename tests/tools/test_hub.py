"""`oscar pull` without a network: one line from a quick probe, before any hub client runs (the
clients retry for half a minute). Only loopback addresses are contacted."""

from __future__ import annotations

import socket
import threading

import pytest
from factories import oscar

import oscar_calib.tools.hub as hub
import oscar_calib.tools.publish as publish
from oscar_calib.errors import PublishError

PROXIES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY", "no_proxy")


@pytest.fixture
def online(monkeypatch, tmp_path):
    """No offline switch, no proxy, an empty pull cache; the hub clients record any call."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", *PROXIES):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OSCAR_CACHE", str(tmp_path / "cache"))
    calls = []
    monkeypatch.setattr(publish, "_hf_snapshot_download", lambda **kw: calls.append(kw))
    return calls


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_hf_hub_offline_is_one_line_and_no_client_call(monkeypatch, capsys, online, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out, err = oscar("pull", "hf:my-org/tiny-oscar")
    assert code == 2 and out == ""
    assert err.strip().splitlines() == ["error: HF_HUB_OFFLINE=1 is set, so the Hugging Face hub is not contacted; "
                                        "unset it to download (nothing was fetched)"]
    assert online == [] and not (tmp_path / "cache" / "zoo" / "hf" / "my-org" / "tiny-oscar").exists()


def test_unreachable_hub_is_one_line_and_no_client_call(monkeypatch, capsys, online):
    port = closed_port()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    code, _, err = oscar("pull", "hf:my-org/tiny-oscar")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"error: cannot reach the Hugging Face hub at 127.0.0.1:{port} (connection failed: ")
    assert lines[0].endswith("no network? (nothing was fetched)") and online == []


def test_a_failed_name_lookup_and_a_silent_resolver(monkeypatch, online):
    def no_dns(*args, **kwargs):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(hub.socket, "getaddrinfo", no_dns)
    with pytest.raises(PublishError, match=r"at huggingface.co:443 \(name lookup failed: Name or service not known\)"):
        publish.pull("hf:org/name")

    asked, answer = threading.Event(), threading.Event()

    def hangs(*args, **kwargs):                    # a resolver that answers only once the test lets it
        asked.set()
        answer.wait(60)
        raise socket.gaierror(-3, "Temporary failure in name resolution")

    monkeypatch.setattr(hub.socket, "getaddrinfo", hangs)
    try:
        with pytest.raises(PublishError, match=r"no answer to the name lookup within 0.2 s"):
            hub.require_online("hf", timeout=0.2)
        assert asked.is_set() and not answer.is_set()      # asked, and given up on before any answer
    finally:
        answer.set()                                       # the lookup thread ends now
    assert online == []


def test_a_hub_that_answers_is_left_to_the_client(monkeypatch, online):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        hub.require_online("hf")                     # no error: the TCP connection was taken
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")      # a switch set to off is not offline
        hub.require_online("hf")


def test_the_proxy_is_probed_when_one_is_set(monkeypatch, online):
    port = closed_port()
    monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{port}")
    with pytest.raises(PublishError, match=f"at 127.0.0.1:{port} through the proxy the environment names"):
        hub.require_online("hf")


def test_rotationzoo_and_modelscope_probe_before_their_clients(monkeypatch, capsys, online):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = oscar("pull", "rotationzoo:qwen3-8b")
    assert code == 2 and err.strip().splitlines() == [
        "error: HF_HUB_OFFLINE=1 is set, so the Hugging Face hub is not contacted; unset it to download (nothing "
        "was fetched)"]
    port = closed_port()
    monkeypatch.setenv("MODELSCOPE_DOMAIN", f"http://127.0.0.1:{port}")     # HF_HUB_OFFLINE is not ModelScope's
    with pytest.raises(PublishError, match=f"cannot reach ModelScope at 127.0.0.1:{port}"):
        publish.pull("modelscope:org/name")
    assert online == []
